"""The metric normalisations NeMo-RL's ClippedPGLossFn advertises (``metric_normalizations``: which denominator
each metric's split rescale takes), in a model of NeMo-RL's own unit tests (tests/unit/algorithms/test_loss_functions.py
at 7ea279ab: ``TestMetricNormalizationAdvertisement`` and ``test_split_rescale_matches_sync_normalization``), run
against the adapter. The loss values of the same file: test_nemo_rl_unit_contract.py.

The data and hand computations are this file's own; each test names the NeMo-RL test it models.
"""

from __future__ import annotations

import pytest
import torch

from adapters.nemo_rl_host import HostLossConfig, host_batch
from nemo_is_plugin.adapters.nemo_rl import ClippedPGLossFn
from nemo_is_plugin.adapters.nemo_rl.protocol import MetricNormalizer


def test_metric_normalizations_default_config():  # TestMetricNormalizationAdvertisement.test_default_grpo_config
    norms = ClippedPGLossFn(HostLossConfig()).metric_normalizations
    for key in (
        "loss",
        "kl_penalty",
        "sampling_importance_ratio",
        "probs_ratio",
        "probs_ratio_clamped",
        "token_mult_prob_error",
        "gen_kl_error",
        "policy_kl_error",
        "js_divergence_error",
        "approx_entropy",
    ):
        assert norms[key] is MetricNormalizer.TOKENS, key
    for key in ("num_valid_samples", "positive_nll_loss", "probs_ratio_min", "probs_ratio_max"):
        assert norms[key] is MetricNormalizer.NONE, key
    assert "is_oob_ratio" not in norms


@pytest.mark.parametrize(
    "cfg, want",
    [
        (
            dict(
                token_level_loss=False, sequence_level_importance_ratios=True, use_importance_sampling_correction=True
            ),
            {
                "loss": "SEQUENCES",
                "kl_penalty": "SEQUENCES",
                "sampling_importance_ratio": "SEQUENCES",
                "token_mult_prob_error": "TOKENS",
                "probs_ratio": "TOKENS",
            },
        ),
        (
            dict(
                use_importance_sampling_correction=True,
                truncated_importance_sampling_type="seq-mask-tis",
                truncated_importance_sampling_ratio=2.0,
                truncated_importance_sampling_ratio_min=0.5,
            ),
            {"loss": "TOKENS", "is_oob_ratio": "SEQUENCES"},
        ),
        (
            dict(
                token_level_loss=False,
                use_importance_sampling_correction=True,
                truncated_importance_sampling_type="tis",
                truncated_importance_sampling_ratio=2.0,
            ),
            {"loss": "SEQUENCES", "is_oob_ratio": "TOKENS"},
        ),
    ],
    ids=["gspo", "seq_mask_tis_token_loss", "tis_sequence_loss"],
)
def test_metric_normalizations_follow_the_flags(cfg, want):  # the other three TestMetricNormalizationAdvertisement
    norms = ClippedPGLossFn(HostLossConfig(**cfg)).metric_normalizations
    for key, kind in want.items():
        assert norms[key] is getattr(MetricNormalizer, kind), key


def test_split_rescale_matches_sync_normalization():  # test_split_rescale_matches_sync_normalization
    g = torch.Generator().manual_seed(7)
    fn = ClippedPGLossFn(
        HostLossConfig(
            use_importance_sampling_correction=True,
            truncated_importance_sampling_type="seq-mask-tis",
            truncated_importance_sampling_ratio=1.4,
            truncated_importance_sampling_ratio_min=0.75,
        )
    )
    batches = []
    for _ in range(2):
        data = host_batch(batch=4, seq=8)
        data.update(
            advantages=torch.randn(4, 8, generator=g),
            prev_logprobs=-torch.rand(4, 8, generator=g),
            generation_logprobs=-torch.rand(4, 8, generator=g),
            reference_policy_logprobs=-torch.rand(4, 8, generator=g),
            sample_mask=torch.tensor([1, 0, 1, 1]),
        )
        data["token_mask"][1, -3:] = 0
        batches.append((data, -torch.rand(4, 7, generator=g)))
    n_seq = sum(d["sample_mask"].sum() for d, _ in batches).float()
    n_tok = sum((d["token_mask"][:, 1:] * d["sample_mask"][:, None]).sum() for d, _ in batches).float()

    def totals(seqs, toks):
        out: dict[str, float] = {}
        for data, x in batches:
            for k, v in fn(x, data, seqs, toks)[1].items():
                out[k] = out.get(k, 0.0) + v
        return out

    synced, raw = totals(n_seq, n_tok), totals(torch.tensor(1.0), torch.tensor(1.0))
    for key, kind in fn.metric_normalizations.items():
        if kind is MetricNormalizer.NONE:
            continue
        denom = n_tok if kind is MetricNormalizer.TOKENS else n_seq
        assert raw[key] / denom.item() == pytest.approx(synced[key], rel=1e-5, abs=1e-7), key
    assert raw["num_valid_samples"] == pytest.approx(synced["num_valid_samples"])
