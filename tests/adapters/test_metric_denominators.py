"""Each metric's denominator, declared where the loss emits it, as NeMo-RL's adapter advertises it.

The values below are those the previous mechanism (name lists applied to the metric names of a fake-batch call)
produced; before it was removed the two were compared on every golden config, every recipe under configs/ and 400
drawn configs, and agreed everywhere. They are checked by hand against NeMo-RL's own table (``ClippedPGLossFn.
__init__``, nemo_rl/algorithms/loss/loss_functions.py at commit 7ea279ab): ``loss`` / ``kl_penalty`` follow the
loss type, ``sampling_importance_ratio`` counts sequences for NeMo-RL's GSPO weight, ``is_oob_ratio`` counts sequences
for seq-mask-tis, extrema, ``num_valid_samples`` and ``positive_nll_loss`` are never rescaled; the plugin's own
metrics divide by the count named in their definition (loss/metrics.py, loss/mismatch_metrics.py).
"""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from nemo_is_plugin.adapters.nemo_rl import NeMoRLLossFn
from nemo_is_plugin.adapters.nemo_rl.protocol import MetricNormalizer
from nemo_is_plugin.adapters.nemo_rl.step_metrics import is_summed_extremum, micro_batch_mean_name
from nemo_is_plugin.adapters.shared import renormalize
from nemo_is_plugin.loss import ClippedPGLoss
from nemo_is_plugin.loss.denominator import Denominator
from nemo_is_plugin.loss.metrics import MetricValues

T, S, N = MetricNormalizer.TOKENS, MetricNormalizer.SEQUENCES, MetricNormalizer.NONE
BUCKETS = ("1_16", "16_128", "128_1024", "1024_8192", "8192_inf")

# NeMo-RL's default GRPO loss (every plugin key unset): 52 metrics.
DEFAULT = {
    **dict.fromkeys(
        (
            "token_mult_prob_error",
            "gen_kl_error",
            "policy_kl_error",
            "js_divergence_error",
            "kl_penalty",
            "loss",
            "probs_ratio",
            "probs_ratio_clamped",
            "clip_fraction",
            "clip_fraction_low",
            "clip_fraction_high",
            "clip_fraction_dual",
            "sampling_importance_ratio",
            "is_weight_mean",
            "is_weight_sq_mean",
            "is_raw_weight_mean",
            "is_raw_weight_sq_mean",
            "is_truncated_fraction",
            "is_rejected_fraction",
            "approx_entropy",
            "input_nonfinite_generation_fraction",
            "input_positive_logprob_fraction",
            "mismatch_kl_k1",
            "mismatch_kl_k3",
            "is_token_weight_sq_mean",
            *(f"{kind}/pos_{b}" for b in BUCKETS for kind in ("clip_frac", "token_frac")),
        ),
        T,
    ),
    **dict.fromkeys(
        (
            "sampling_importance_ratio_seq_mean",
            "is_rejected_seq_fraction",
            "training_log_ppl",
            "rollout_log_ppl",
            "log_ppl_diff",
            "log_ppl_abs_diff",
            "is_seq_weight_sq_mean",
        ),
        S,
    ),
    **dict.fromkeys(
        (
            *(
                f"{m}_{e}"
                for m in ("probs_ratio", "probs_ratio_clamped", "is_weight", "is_raw_weight")
                for e in ("min", "max")
            ),
            "num_valid_samples",
            "positive_nll_loss",
        ),
        N,
    ),
}


def _rule_metrics(prefix: str) -> dict:
    return {
        f"{prefix}_mean": T,
        f"{prefix}_min": N,
        f"{prefix}_max": N,
        f"{prefix}_rejected_fraction": T,
        f"{prefix}_rejected_seq_fraction": S,
    }


# config -> the metrics whose denominator differs from DEFAULT's, or that DEFAULT does not have
CASES = {
    "default": ({}, {}),
    "gspo_nemo_rl": (
        {
            "sequence_level_importance_ratios": True,
            "token_level_loss": False,
            "use_importance_sampling_correction": True,
        },
        {"loss": S, "kl_penalty": S, "sampling_importance_ratio": S},
    ),
    "token_tis": (
        {
            "use_importance_sampling_correction": True,
            "truncated_importance_sampling_type": "tis",
            "truncated_importance_sampling_ratio": 2.0,
        },
        {"is_oob_ratio": T},
    ),
    "seq_mask_tis": (
        {
            "use_importance_sampling_correction": True,
            "truncated_importance_sampling_type": "seq-mask-tis",
            "truncated_importance_sampling_ratio": 1.05,
            "truncated_importance_sampling_ratio_min": 0.95,
        },
        {"is_oob_ratio": S},
    ),
    "rules_seq_mean": (
        {
            "old_policy_logprobs": "generation",
            "loss_aggregation": "seq-mean-token-mean",
            "importance_sampling_rejection_rules": [
                {"option": "token_k1", "threshold": "0.5_2.0"},
                {"option": "seq_max_k3", "threshold": 0.2},
            ],
        },
        {
            "loss": S,
            "kl_penalty": S,
            **_rule_metrics("is_rejection_token_k1"),
            **_rule_metrics("is_rejection_sequence_max_k3"),
            "is_rejection_rejected_fraction": T,
            "is_rejection_rejected_seq_fraction": S,
        },
    ),
}


def test_default_table_has_every_metric_once():
    assert len(DEFAULT) == 52


@pytest.mark.parametrize("name", sorted(CASES))
def test_nemo_rl_metric_normalizations(name):
    """The loss's table, under the names NeMo-RL's step gets: the plugin's extrema (not NeMo-RL's four) as
    share-weighted micro-batch means, divided by the sequence count."""
    config, changed = CASES[name]
    want = {
        (micro_batch_mean_name(k) if is_summed_extremum(k) else k): (S if is_summed_extremum(k) else v)
        for k, v in {**DEFAULT, **changed}.items()
    }
    assert NeMoRLLossFn(config).metric_normalizations == want
    assert {k for k, v in want.items() if k.endswith(("_min", "_max"))} <= {
        "probs_ratio_min",
        "probs_ratio_max",
        "probs_ratio_clamped_min",
        "probs_ratio_clamped_max",
    }


def test_token_sum_loss_is_never_rescaled():
    """verl's token-sum (NeMo-RL's adapter refuses it): the loss and KL are plain sums."""
    got = {
        k: MetricNormalizer(v.value)
        for k, v in ClippedPGLoss({"loss_aggregation": "token-sum"}).metric_denominators().items()
    }
    assert got == {**DEFAULT, "loss": N, "kl_penalty": N}


def test_the_call_returns_the_traced_denominators():
    """The metrics of a real call carry the same declarations as the meta-tensor trace, for the same names."""
    g = torch.Generator().manual_seed(0)
    b, s = 3, 5
    data = {
        "token_mask": torch.tensor([[0.0, 1, 1, 1, 0], [0, 1, 1, 0, 0], [0, 1, 1, 1, 1]]),
        "sample_mask": torch.ones(b),
        "advantages": torch.randn(b, s, generator=g),
        "prev_logprobs": -torch.rand(b, s, generator=g),
        "generation_logprobs": -torch.rand(b, s, generator=g),
        "reference_policy_logprobs": -torch.rand(b, s, generator=g),
    }
    loss = ClippedPGLoss(CASES["seq_mask_tis"][0])
    _, metrics = loss(-torch.rand(b, s - 1, generator=g), data, 3.0, 9.0)
    assert isinstance(metrics, MetricValues)
    assert metrics.denominators == loss.metric_denominators()
    assert set(metrics) == set(metrics.denominators)
    assert not any(math.isnan(v) for v in metrics.values())
    again = pickle.loads(pickle.dumps(metrics))  # metrics travel between Ray workers
    assert again == metrics and again.denominators == metrics.denominators


def test_renormalize_changes_denominators():
    metrics = MetricValues(
        {"probs_ratio": 2.0, "is_oob_ratio": 3.0, "num_valid_samples": 4.0, "loss_max": 5.0},
        {"probs_ratio": Denominator.TOKENS, "is_oob_ratio": Denominator.SEQUENCES}
        | dict.fromkeys(("num_valid_samples", "loss_max"), Denominator.NONE),
    )
    out = renormalize(metrics, tokens=(10.0, 5.0), seqs=(4.0, 2.0))
    assert out == {"probs_ratio": 4.0, "is_oob_ratio": 6.0, "num_valid_samples": 4.0, "loss_max": 5.0}
    one = MetricValues({"probs_ratio": 2.0}, {"probs_ratio": Denominator.TOKENS})
    assert renormalize(one, tokens=(10.0, 0.0), seqs=(1, 1)) == {"probs_ratio": 0.0}
