"""The fused-path parity problem and its reference, shared by the fused LM-head tests: a tiny head problem whose
prev / generation / reference log-probs sit around the true ones, the configs that make clipping and truncation
active on it, the naive path's loss / metrics / gradients, and the comparisons."""

from __future__ import annotations

import pytest
import torch

from nemo_is_plugin import build_loss_fn
from nemo_is_plugin.apps.bench.paths import naive_logprobs
from nemo_is_plugin.apps.bench.problem import HeadProblem, make_problem
from nemo_is_plugin.distributed.entry_points.fused_linear_loss import fused_linear_pg_loss

RATIO_LEVELS = ("token", "sequence", "sequence_token", "cumulative", "cumulative_mean")
IS_LEVELS = ("token", "sequence", "sequence_mean", "cumulative")
CHUNK = 5  # tokens per chunk: chunks straddle sequence boundaries (T = 8 per sequence)


# a clip and TIS band tight enough that clipping and truncation are active on the synthetic mismatch
TIGHT_TIS = dict(
    use_importance_sampling_correction=True,
    truncated_importance_sampling_type="tis",
    truncated_importance_sampling_ratio=1.05,
    ratio_clip_min=0.03,
    ratio_clip_max=0.03,
)


def level_config(ratio_level: str, is_level: str) -> dict:
    """``TIGHT_TIS`` at these ratio and IS levels."""
    return dict(
        ratio_level=ratio_level,
        is_correction_level=is_level,
        **TIGHT_TIS,
        loss_aggregation="seq-mean-token-mean" if ratio_level == "sequence" else "token-mean",
        token_level_loss=ratio_level != "sequence",
    )


def problem(dtype=torch.float32, seed=0, vocab=37) -> HeadProblem:
    """Tiny problem whose prev/gen/ref log-probs sit around the true ones (ratios near 1, both clip sides hit)."""
    p = make_problem(3, 9, 16, vocab, seed=seed)
    true_lp = naive_logprobs(p.hidden.double(), p.weight.double(), p.target)
    return make_problem(3, 9, 16, vocab, seed=seed, dtype=dtype, base_logprobs=true_lp)


def run(p: HeadProblem, logprob_fn, config: dict, hidden=None, weight=None):
    """(loss, metrics, d hidden, d weight) of ``loss_fn(logprob_fn(hidden, weight, target))``."""
    h = (p.hidden if hidden is None else hidden).clone().requires_grad_(True)
    w = (p.weight if weight is None else weight).clone().requires_grad_(True)
    loss_fn = build_loss_fn(config)
    lp = logprob_fn(h, w, p.target)
    loss, metrics = loss_fn(
        next_token_logprobs=lp,
        data=p.data,
        global_valid_seqs=p.global_valid_seqs,
        global_valid_toks=p.global_valid_toks,
    )
    loss.backward()
    return loss.detach(), metrics, h.grad, w.grad


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def assert_metrics_close(got: dict, want: dict, rtol: float = 1e-5, atol: float = 1e-7) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=rtol, abs=atol), key


def pg_problem(dtype=torch.float32, seed=0, vocab=37):
    """``problem`` with per-token advantages of both signs (its own are all +0.1, so the
    dual clip and the low clip never act) and mixed rewards (its own are all 0: no positive-sample NLL)."""
    p = problem(dtype=dtype, seed=seed, vocab=vocab)
    g = torch.Generator().manual_seed(100 + seed)
    p.data["advantages"] = torch.randn(p.data["advantages"].shape, generator=g)
    p.data["rewards"] = torch.tensor([1.0, 0.0, 1.0])
    return p


def fused(
    p, cfg, *, hidden=None, weight=None, h_grad=True, w_grad=True, upstream=None, data=None, target=None, **kwargs
):
    """(loss, metrics, d hidden, d weight) of ``fused_linear_pg_loss`` on problem ``p`` (CHUNK tokens per chunk)."""
    h = (p.hidden if hidden is None else hidden).clone().requires_grad_(h_grad)
    w = (p.weight if weight is None else weight).clone().requires_grad_(w_grad)
    kwargs.setdefault("chunk_size", CHUNK)
    loss, metrics = fused_linear_pg_loss(
        build_loss_fn(cfg),
        h,
        w,
        p.target if target is None else target,
        p.data if data is None else data,
        p.global_valid_seqs,
        p.global_valid_toks,
        **kwargs,
    )
    if loss.requires_grad:
        (loss if upstream is None else upstream * loss).backward()
    return loss.detach(), metrics, h.grad, w.grad


def assert_parity(got, want, rtol=1e-5, grad_rtol=1e-5, metric_atol=1e-7):
    loss, metrics, dx, dw = got
    ref_loss, ref_metrics, ref_dx, ref_dw = want
    # the loss like the metrics: relative + absolute (mixed-sign advantages make it a cancelling sum: e.g. -0.00834
    # whose fp32 naive value is itself 1.2e-5 relative from fp64)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=rtol, abs=metric_atol)
    assert_metrics_close(metrics, ref_metrics, rtol=rtol, atol=metric_atol)
    assert dx.dtype == ref_dx.dtype or dx.dtype == torch.bfloat16
    assert rel_err(dx, ref_dx) < grad_rtol, rel_err(dx, ref_dx)
    assert rel_err(dw, ref_dw) < grad_rtol, rel_err(dw, ref_dw)
    # the loss actually reaches both inputs (a test of all-zero gradients could not fail)
    assert ref_dx.abs().max() > 0 and ref_dw.abs().max() > 0


def forbid(monkeypatch, module, what):
    def boom(*args, **kwargs):
        raise AssertionError(f"{what} must not run here")

    monkeypatch.setattr(module, "chunk_logits", boom)


def variant(**changes) -> dict:
    """level_config('token', 'token') with ``changes``; a value None removes the key (back to its default)."""
    cfg = level_config("token", "token")
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    return cfg


def aggregation(mode: str, **more) -> dict:
    # token_level_loss would contradict a sequence aggregation: leave it to follow loss_aggregation
    return variant(loss_aggregation=mode, token_level_loss=None, **more)


# ---- policy objectives (test_fused_linear_objectives, test_fused_linear_tp)
OBJECTIVE_IS = dict(
    use_importance_sampling_correction=True,
    is_correction_level="token",
    truncated_importance_sampling_type="tis",
    truncated_importance_sampling_ratio=1.05,
)
# thresholds small enough that every trust region drops tokens on this problem (test_trust_regions_bite)
OBJECTIVE_CONFIGS = {
    "dppo_tv": dict(policy_objective="dppo_tv", dppo_delta_low=2e-5, dppo_delta_high=1e-5, dppo_ratio_cap=1.02),
    "dppo_kl": dict(policy_objective="dppo_kl", dppo_delta_low=1e-9, dppo_delta_high=2e-9),
    "prob_diff": dict(policy_objective="prob_diff", prob_diff_threshold=5e-4),
    "sapo": dict(policy_objective="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05),
    "gpg": dict(policy_objective="gpg"),
    "dro": dict(policy_objective="dro", dro_beta=0.5),
    "gmpo": dict(
        policy_objective="gmpo",
        gmpo_clip_low=0.01,
        gmpo_clip_high=0.01,
        loss_aggregation="seq-mean-token-mean",
        **{**OBJECTIVE_IS, "is_correction_level": "sequence_mean"},
    ),
    "cppo": dict(policy_objective="cppo", cppo_delta=1e-6, cppo_w_min=0.8, cppo_delta_b=2e-7),
}
LOCAL_OBJECTIVES = ("dppo_tv", "dppo_kl", "prob_diff", "sapo", "gpg", "dro")
SEQUENCE_OBJECTIVES = ("gmpo", "cppo")


def objective_config(name: str) -> dict:
    """A policy objective (docs/objectives.md) with token TIS weights and the KL term, on ``pg_problem``."""
    return {**OBJECTIVE_IS, "reference_policy_kl_penalty": 0.05, **OBJECTIVE_CONFIGS[name]}
