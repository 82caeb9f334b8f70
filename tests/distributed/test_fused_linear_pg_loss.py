"""fused_linear_pg_loss (the policy-gradient loss straight from hidden states and the LM head) equals the naive path
(full logits -> fp32 log_softmax -> gather -> ClippedPGLoss): loss, every metric, dX and dW.

Single process. fp32: 1e-5 relative (loss and metrics 1e-5 relative + 1e-7 absolute) as in test_fused_linear_loss; bf16
hidden/weight: loss and metrics 1e-5 against an fp32 reference on the exact bf16 values, gradients 1e-2 (one bf16
rounding); fp64: 1e-10. Every ratio level x IS level runs in the schedule it must take (single pass for token and
cumulative ratios, two-pass for sequence ones: the other schedule's GEMM is forbidden). Autograd handling, the event
order of the chunk GEMMs and layouts: test_fused_linear_pg_loss_schedule.py.
"""

from __future__ import annotations

import math

import pytest
import torch

import nemo_is_plugin.distributed.entry_points.fused_linear_loss as fused_loss_module
import nemo_is_plugin.distributed.head.fused_linear as fused_linear_module
from nemo_is_plugin.apps.bench.paths import naive_logprobs
from nemo_is_plugin.apps.bench.problem import make_problem

from ._fused_cases import (
    IS_LEVELS,
    RATIO_LEVELS,
    aggregation,
    assert_metrics_close,
    assert_parity,
    forbid,
    fused,
    level_config,
    rel_err,
    run,
    variant,
)
from ._fused_cases import pg_problem as problem

CAUSAL_RATIO_LEVELS = ("cumulative", "cumulative_mean")  # single pass with a running prefix sum
SEQUENCE_RATIO_LEVELS = [r for r in RATIO_LEVELS if r not in ("token", *CAUSAL_RATIO_LEVELS)]


# ---------------------------------------------------------------------------------------------------- every level
@pytest.mark.parametrize("single_pass", [None, True])
@pytest.mark.parametrize("is_level", IS_LEVELS)
def test_token_ratio_every_is_level_single_pass(monkeypatch, is_level, single_pass):
    """Token ratio x every IS level: the single pass runs (the two-pass kernel is forbidden) and equals naive."""
    p, cfg = problem(), level_config("token", is_level)
    want = run(p, naive_logprobs, cfg)
    forbid(monkeypatch, fused_linear_module, "the two-pass fused_linear_logprobs")
    assert_parity(fused(p, cfg, single_pass=single_pass), want)


@pytest.mark.parametrize("is_level", IS_LEVELS)
def test_token_ratio_forced_two_pass(monkeypatch, is_level):
    """single_pass=False takes the two-pass schedule even for a separable config: same numbers."""
    p, cfg = problem(), level_config("token", is_level)
    want = run(p, naive_logprobs, cfg)
    forbid(monkeypatch, fused_loss_module, "the single pass")
    assert_parity(fused(p, cfg, single_pass=False), want)


@pytest.mark.parametrize("single_pass", [None, True])
@pytest.mark.parametrize("is_level", IS_LEVELS)
@pytest.mark.parametrize("ratio_level", CAUSAL_RATIO_LEVELS)
def test_cumulative_ratios_every_is_level_single_pass(monkeypatch, ratio_level, is_level, single_pass):
    """CTPO's cumulative ratios are causal: the single pass (per-sequence running sums carried across chunks that
    split sequences, CHUNK=5 vs 8 tokens per row) equals naive at every IS level."""
    p, cfg = problem(), level_config(ratio_level, is_level)
    want = run(p, naive_logprobs, cfg)
    forbid(monkeypatch, fused_linear_module, "the two-pass fused_linear_logprobs")
    assert_parity(fused(p, cfg, single_pass=single_pass), want)


@pytest.mark.parametrize("chunk_size", [1, 3, 8, 1000])
@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"token_log_ratio_clamp": 0.04, "max_log_ratio": 0.02},
        {
            "log_ratio_clip_low": 0.01,
            "log_ratio_clip_high": 0.015,
            "clip_position_power": 0.5,
            "log_ratio_clip_c": 0.05,
            "ratio_clip_c": None,
        },
    ],
)
def test_cumulative_single_pass_any_chunking_and_ctpo_clip(monkeypatch, chunk_size, extra):
    """Chunk sizes that split sequences anywhere (1 token, odd, one row, everything) and CTPO's clamps / adaptive
    log-space clip give the naive path's numbers."""
    p = problem()
    cfg = {k: v for k, v in dict(level_config("cumulative", "cumulative"), **extra).items() if v is not None}
    want = run(p, naive_logprobs, cfg)
    forbid(monkeypatch, fused_linear_module, "the two-pass fused_linear_logprobs")
    assert_parity(fused(p, cfg, single_pass=True, chunk_size=chunk_size), want)


@pytest.mark.parametrize("is_level", IS_LEVELS)
@pytest.mark.parametrize("ratio_level", SEQUENCE_RATIO_LEVELS)
def test_sequence_ratio_levels_fall_back_to_two_pass(monkeypatch, ratio_level, is_level):
    p, cfg = problem(), level_config(ratio_level, is_level)
    want = run(p, naive_logprobs, cfg)
    forbid(monkeypatch, fused_loss_module, "the single pass")
    assert_parity(fused(p, cfg), want)


@pytest.mark.parametrize("ratio_level", SEQUENCE_RATIO_LEVELS)
def test_single_pass_true_rejects_sequence_ratio_levels(ratio_level):
    p, cfg = problem(), level_config(ratio_level, "token")
    with pytest.raises(ValueError, match=f"ratio_level='{ratio_level}'"):
        fused(p, cfg, single_pass=True)


def test_single_pass_true_rejects_force_on_policy_ratio():
    """force_on_policy_ratio takes the old log-probs (hence the IS weights) from c: not separable."""
    p = problem()
    cfg = dict(level_config("token", "sequence"), ratio_level=None, force_on_policy_ratio=True)
    with pytest.raises(ValueError, match="single_pass=True"):
        fused(p, cfg, single_pass=True)
    assert_parity(fused(p, cfg), run(p, naive_logprobs, cfg))  # auto: two-pass, same numbers


# ---------------------------------------------------------------------------------------------------- config sweep
_KL = dict(reference_policy_kl_penalty=0.1)
SEPARABLE_CONFIGS = {
    "tis_with_min": variant(truncated_importance_sampling_ratio_min=0.97),
    "icepop": variant(
        truncated_importance_sampling_type="icepop",
        truncated_importance_sampling_ratio=1.05,
        truncated_importance_sampling_ratio_min=0.95,
    ),
    "seq_mask_tis": variant(
        truncated_importance_sampling_type="seq-mask-tis",
        truncated_importance_sampling_ratio=1.03,
        truncated_importance_sampling_ratio_min=0.97,
    ),
    "seq_mis": variant(
        truncated_importance_sampling_type="seq-mis",
        truncated_importance_sampling_ratio=1.1,
        truncated_importance_sampling_ratio_min=0.9,
    ),
    "seq_mis_without_is_weights": variant(
        truncated_importance_sampling_type="seq-mis",
        truncated_importance_sampling_ratio=1.1,
        truncated_importance_sampling_ratio_min=0.9,
        use_importance_sampling_correction=False,
        is_correction_level=None,
    ),
    "geo_rs": variant(
        truncated_importance_sampling_type="geo-rs",
        truncated_importance_sampling_ratio=1.03,
        truncated_importance_sampling_ratio_min=0.97,
    ),
    "tis_plus_geo_rs_rejection": variant(
        importance_sampling_rejection="geo-rs",
        importance_sampling_rejection_min=0.97,
        importance_sampling_rejection_max=1.03,
    ),
    "kl_k1": variant(reference_policy_kl_type="k1", **_KL),
    "kl_k2": variant(reference_policy_kl_type="k2", **_KL),
    "kl_k3": variant(reference_policy_kl_type="k3", **_KL),
    "kl_k3_k2_gradient": variant(reference_policy_kl_type="k3", reference_policy_kl_gradient="k2", **_KL),
    "kl_k1_k2_gradient": variant(reference_policy_kl_type="k1", reference_policy_kl_gradient="k2", **_KL),
    "kl_on_policy_approximation": variant(use_on_policy_kl_approximation=True, **_KL),
    "kl_tight_clamps": variant(kl_input_clamp_value=0.05, kl_output_clamp_value=0.01, **_KL),
    "agg_token_mean": aggregation("token-mean"),
    "agg_seq_mean_token_mean": aggregation("seq-mean-token-mean"),
    "agg_seq_mean_token_sum": aggregation("seq-mean-token-sum"),
    "agg_seq_mean_token_sum_norm": aggregation("seq-mean-token-sum-norm", loss_aggregation_norm=8.0),
    "agg_token_sum": aggregation("token-sum"),
    "verl_rejection_rules": variant(
        importance_sampling_rejection_rules=[
            {"option": "token_k1", "threshold": "0.9_1.1"},
            {"option": "seq_mean_k3", "threshold": 0.002},
            {"option": "seq_max_k2", "threshold": 0.006},
        ]
    ),
    "prob_diff_rejection_rules": variant(
        importance_sampling_rejection_rules=[
            {"statistic": "prob_diff", "aggregation": "token", "max": 1e-3},
            {"statistic": "prob_diff", "aggregation": "sequence_mean", "max": 2e-3},
            {"option": "seq_mean_k3", "threshold": 0.002},
        ]
    ),
    "agg_nemo_rl_token_level_loss_false": variant(token_level_loss=False, loss_aggregation=None),
    "cispo": variant(use_cispo=True),
    "disable_ppo_ratio": variant(disable_ppo_ratio=True),
    "disable_ppo_ratio_dual_clip": variant(disable_ppo_ratio=True, ratio_clip_c=1.5),
    "log_space_clip": variant(log_ratio_clip_low=0.02, log_ratio_clip_high=0.03),
    "log_space_clip_position_power": variant(
        log_ratio_clip_low=0.01,
        log_ratio_clip_high=0.015,
        clip_position_power=0.5,
        log_ratio_clip_c=0.05,
    ),
    "dual_clip": variant(ratio_clip_c=1.02),
    "token_log_ratio_clamp_and_max": variant(token_log_ratio_clamp=0.04, max_log_ratio=0.02),
    "positive_example_nll": variant(positive_example_nll_weight=0.5),
    "batch_normalize": variant(importance_sampling_batch_normalize=True),
    "veto": variant(importance_sampling_veto_threshold=0.96),
    "no_is_correction": variant(
        use_importance_sampling_correction=False,
        truncated_importance_sampling_type=None,
        truncated_importance_sampling_ratio=None,
        is_correction_level=None,
    ),
    "nemo_rl_defaults": {},
    "kl_in_reward": variant(use_kl_in_reward=True, **_KL),
}


@pytest.mark.parametrize("name", sorted(SEPARABLE_CONFIGS))
def test_separable_config_sweep(monkeypatch, name):
    p, cfg = problem(), SEPARABLE_CONFIGS[name]
    want = run(p, naive_logprobs, cfg)
    forbid(monkeypatch, fused_linear_module, "the two-pass fused_linear_logprobs")
    assert_parity(fused(p, cfg, single_pass=True), want)


def test_config_sweep_exercises_its_features():
    """The sweep's problem actually hits what each config switches on (so that the parity is not vacuous)."""
    p = problem()
    m = {
        name: run(p, naive_logprobs, SEPARABLE_CONFIGS[name])[1]
        for name in (
            "icepop",
            "seq_mask_tis",
            "seq_mis",
            "geo_rs",
            "veto",
            "dual_clip",
            "log_space_clip_position_power",
            "kl_k3",
            "positive_example_nll",
            "token_log_ratio_clamp_and_max",
            "tis_plus_geo_rs_rejection",
            "verl_rejection_rules",
            "prob_diff_rejection_rules",
        )
    }
    for name in ("icepop", "seq_mis", "geo_rs", "veto", "tis_plus_geo_rs_rejection", "verl_rejection_rules"):
        assert 0 < m[name]["is_rejected_fraction"] < 1, name
    for rule in ("token_k1", "sequence_mean_k3", "sequence_max_k2"):
        assert 0 < m["verl_rejection_rules"][f"is_rejection_{rule}_rejected_fraction"] < 1, rule
    for rule in ("token_prob_diff", "sequence_mean_prob_diff"):
        assert 0 < m["prob_diff_rejection_rules"][f"is_rejection_{rule}_rejected_fraction"] < 1, rule
    assert 0 < m["seq_mask_tis"]["is_oob_ratio"] < 1
    assert m["dual_clip"]["clip_fraction_dual"] > 0
    assert m["log_space_clip_position_power"]["clip_fraction"] > 0
    assert m["kl_k3"]["kl_penalty"] != 0 and m["positive_example_nll"]["positive_nll_loss"] != 0
    assert m["token_log_ratio_clamp_and_max"]["probs_ratio_max"] <= math.exp(0.02) + 1e-6


@pytest.mark.parametrize("chunk_size", [1, 1000])
@pytest.mark.parametrize("is_level", ["token", "cumulative"])
def test_chunk_size_one_and_larger_than_the_batch(is_level, chunk_size):
    p, cfg = problem(), level_config("token", is_level)
    assert chunk_size == 1 or chunk_size > p.num_tokens
    assert_parity(fused(p, cfg, chunk_size=chunk_size, single_pass=True), run(p, naive_logprobs, cfg))


@pytest.mark.parametrize("temperature", [0.7, 1.6])
def test_temperature(temperature):
    """Logits divided by the temperature; prev/gen/ref log-probs sit around the tempered ones (clip active)."""
    base = make_problem(3, 9, 16, 37, seed=0)
    true_lp = naive_logprobs(base.hidden.double(), base.weight.double() / temperature, base.target)
    p = make_problem(3, 9, 16, 37, seed=0, base_logprobs=true_lp)
    cfg = level_config("token", "cumulative")
    want = run(p, lambda h, w, t: naive_logprobs(h, w / temperature, t), cfg)
    assert_parity(fused(p, cfg, temperature=temperature, single_pass=True), want)
    # and the tempered loss is not the untempered one (the temperature is really applied)
    assert rel_err(fused(p, cfg, single_pass=True)[2], want[2]) > 1e-2


# ---------------------------------------------------------------------------------------------------- dtypes
@pytest.mark.parametrize("is_level", IS_LEVELS)
def test_bf16_parity(is_level):
    p, cfg = problem(dtype=torch.bfloat16, seed=1), level_config("token", is_level)
    want = run(p, naive_logprobs, cfg, p.hidden.float(), p.weight.float())
    got = fused(p, cfg, single_pass=True)
    assert got[2].dtype == torch.bfloat16 and got[3].dtype == torch.bfloat16
    assert_parity(got, want, grad_rtol=1e-2)


def naive_logprobs_fp64(hidden, weight, target):
    """naive_logprobs without its fp32 cast (it runs log_softmax in fp32 whatever the input)."""
    logp = torch.log_softmax(hidden @ weight.t(), dim=-1)
    return logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)


FP64_CONFIGS = {
    "token-token": level_config("token", "token"),
    "token-cumulative-kl": dict(level_config("token", "cumulative"), reference_policy_kl_penalty=0.1),
    "sequence-sequence": level_config("sequence", "sequence"),
}


@pytest.mark.parametrize("name", sorted(FP64_CONFIGS))
def test_fp64_loss_and_metrics(name):
    p, cfg = problem(dtype=torch.float64), FP64_CONFIGS[name]
    ref_loss, ref_metrics, ref_dx, _ = run(p, naive_logprobs_fp64, cfg)
    assert ref_dx.dtype == torch.float64
    loss, metrics, dx, dw = fused(p, cfg)
    assert loss.dtype == torch.float64 and dx.dtype == torch.float64 and dw.dtype == torch.float64
    assert rel_err(loss, ref_loss) < 1e-10
    assert_metrics_close(metrics, ref_metrics, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("name", sorted(FP64_CONFIGS))
def test_fp64_gradients_two_pass(name):
    p, cfg = problem(dtype=torch.float64), FP64_CONFIGS[name]
    want = run(p, naive_logprobs_fp64, cfg)
    assert_parity(fused(p, cfg, single_pass=False), want, rtol=1e-10, grad_rtol=1e-10, metric_atol=1e-13)


@pytest.mark.parametrize("name", ["token-token", "token-cumulative-kl"])
def test_fp64_gradients_single_pass(name):
    p, cfg = problem(dtype=torch.float64), FP64_CONFIGS[name]
    want = run(p, naive_logprobs_fp64, cfg)
    assert_parity(fused(p, cfg, single_pass=True), want, rtol=1e-10, grad_rtol=1e-10, metric_atol=1e-13)
