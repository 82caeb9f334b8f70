"""Property-based tests of the loss over random shapes, masks, dtypes and configurations (hypothesis).

Properties:
- finiteness: finite inputs with IS log-ratios p - g up to +-1e4, fp32/bf16/fp16 log-probs, give a finite loss,
  finite gradients and no NaN metric, for every valid configuration (NeMo-RL's exact path included: NeMo-RL zeroes
  overflowing IS weights); policy log-ratios c - p up to +-1e4 give a finite loss when the config caps the ratio
  (max_log_ratio), whatever the ratio level;
- all-masked: loss exactly 0, zero gradient, no NaN metric;
- invariants: generation == prev gives IS weight 1 at every level (the loss equals the loss without IS);
  current == prev gives ratio 1 at every ratio level; permuting sequences permutes per-sequence results and leaves
  the loss unchanged; splitting a batch into micro-batches with the global counts sums to the whole-batch loss,
  gradient and additive metrics.

Example counts: about 2,100 examples by default (``_EXAMPLES``, ~40 s on one CPU thread); the environment variable
``NEMO_IS_PROPERTY_SCALE=<k>`` multiplies them (e.g. 5 for a nightly run).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers.loss_strategies import (
    HYPOTHESIS_SETTINGS,
    IS_LEVELS,
    PROPERTY_SCALE,
    RATIO_LEVELS,
    batches,
    counts,
    loss_configs,
)
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from nemo_is_plugin import ClippedPGLossConfig, TokenLayout, build_loss_fn
from nemo_is_plugin.loss.correction import compute_is_correction
from nemo_is_plugin.loss.ratios import policy_log_ratio
from nemo_is_plugin.loss.terms import is_correction_kwargs

torch.set_num_threads(1)

_EXAMPLES = {
    "finite": 500 * PROPERTY_SCALE,
    "masked": 200 * PROPERTY_SCALE,
    "invariant": 250 * PROPERTY_SCALE,
    "split": 300 * PROPERTY_SCALE,
}


def run(cfg: ClippedPGLossConfig, x: torch.Tensor, data: dict, n_seq=None, n_tok=None):
    """(loss, grad wrt x, metrics)."""
    if n_seq is None:
        n_seq, n_tok = counts(data)
    x = x.detach().clone().requires_grad_(True)
    loss, metrics = build_loss_fn(cfg)(
        next_token_logprobs=x, data=data, global_valid_seqs=n_seq, global_valid_toks=n_tok
    )
    (grad,) = torch.autograd.grad(loss, x, allow_unused=True)
    return loss.detach(), (torch.zeros_like(x) if grad is None else grad), metrics


def nan_metrics(metrics: dict[str, float]) -> list[str]:
    return [k for k, v in metrics.items() if isinstance(v, float) and math.isnan(v)]


# --------------------------------------------------------------------------------------------- finiteness
@settings(max_examples=_EXAMPLES["finite"], **HYPOTHESIS_SETTINGS)
@given(cfg=loss_configs(), batch=batches(policy_scale=0.3))
def test_finite_inputs_give_finite_loss_and_gradient(cfg, batch):
    x, data = batch
    loss, grad, metrics = run(cfg, x, data)
    assert torch.isfinite(loss), (cfg.model_dump(exclude_defaults=True), loss)
    if x.dtype == torch.float16:
        # The loss computes in float32 and autograd returns the gradient in the input's dtype: a float16
        # gradient can only be finite where its float32 value is representable (|g| <= 65504).
        _, grad32, _ = run(cfg, x.float(), data)
        assert torch.isfinite(grad32).all(), cfg.model_dump(exclude_defaults=True)
        representable = grad32.abs() <= torch.finfo(torch.float16).max
        assert torch.isfinite(grad[representable]).all(), cfg.model_dump(exclude_defaults=True)
    else:
        assert torch.isfinite(grad).all(), cfg.model_dump(exclude_defaults=True)
    assert not nan_metrics(metrics), nan_metrics(metrics)


@settings(max_examples=_EXAMPLES["finite"] // 2, **HYPOTHESIS_SETTINGS)
@given(
    level=st.sampled_from(RATIO_LEVELS[1:]),
    is_level=st.sampled_from(IS_LEVELS),
    batch=batches(policy_scale=1e4, is_scale=1e4, dtype=torch.float32),
)
def test_extreme_policy_log_ratios_are_finite_when_the_ratio_is_capped(level, is_level, batch):
    cfg = ClippedPGLossConfig(
        ratio_level=level,
        max_log_ratio=10.0,
        use_importance_sampling_correction=True,
        is_correction_level=is_level,
        token_level_loss=level != "sequence",
    )
    x, data = batch
    loss, grad, _ = run(cfg, x, data)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()


@pytest.mark.parametrize(
    ("length", "is_level"),
    [(n, lv) for n in (1, 2, 32768) for lv in IS_LEVELS],
)
def test_lengths_1_to_32k_are_finite(length, is_level):
    """One response of ``length`` tokens with a 0.05 per-token mismatch: sum(p - g) reaches 1.6e3 at 32k."""
    torch.manual_seed(length)
    s = length + 1
    prev = -torch.rand(1, s) * 2
    gen = (prev - 0.05).clamp(max=0.0)
    data = {
        "token_mask": torch.ones(1, s),
        "sample_mask": torch.ones(1),
        "advantages": -torch.ones(1, s),
        "prev_logprobs": prev,
        "generation_logprobs": gen,
        "reference_policy_logprobs": prev,
    }
    cfg = ClippedPGLossConfig(use_importance_sampling_correction=True, is_correction_level=is_level)
    loss, grad, metrics = run(cfg, prev[:, 1:] + 0.0, data)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert not nan_metrics(metrics)


# --------------------------------------------------------------------------------------------- all masked
@settings(max_examples=_EXAMPLES["masked"], **HYPOTHESIS_SETTINGS)
@given(cfg=loss_configs(), batch=batches(), which=st.sampled_from(["token_mask", "sample_mask", "both"]))
def test_all_masked_batch_gives_zero_loss_and_no_nan(cfg, batch, which):
    x, data = batch
    if which in ("token_mask", "both"):
        data["token_mask"] = torch.zeros_like(data["token_mask"])
    if which in ("sample_mask", "both"):
        data["sample_mask"] = torch.zeros_like(data["sample_mask"])
    loss, grad, metrics = run(cfg, x, data)
    assert loss.item() == 0.0
    assert (grad == 0).all()
    assert not nan_metrics(metrics), nan_metrics(metrics)
    # NeMo-RL reports min/max over no token as +inf/-inf; every other metric must be finite
    bad = [k for k, v in metrics.items() if not math.isfinite(v) and not k.endswith(("_min", "_max"))]
    assert not bad, {k: metrics[k] for k in bad}


# --------------------------------------------------------------------------------------------- invariants
@settings(max_examples=_EXAMPLES["invariant"], **HYPOTHESIS_SETTINGS)
@given(cfg=loss_configs(force_is=True), batch=batches(dtype=torch.float64, is_scale=1e-3))
def test_generation_equal_prev_gives_is_weight_one_at_every_level(cfg, batch):
    x, data = batch
    if cfg.force_on_policy_ratio:  # NeMo-RL: prev := current log-probs everywhere, the IS weight included
        data["prev_logprobs"][:, 1:] = x
    data["generation_logprobs"] = data["prev_logprobs"].clone()
    prev, tm = data["prev_logprobs"][:, 1:], data["token_mask"][:, 1:]
    layout = TokenLayout.padded(*prev.shape)
    for level in IS_LEVELS:
        corr = compute_is_correction(
            prev,
            prev,
            tm,
            tm,
            layout,
            level=level,
            nemo_rl_exact=False,
            apply_weights=True,
            truncation=None,
            low=None,
            high=None,
            veto_threshold=None,
            batch_normalize=False,
        )
        assert torch.equal(corr.weights[tm != 0], torch.ones_like(corr.weights[tm != 0])), level
    # with truncation bands that contain 1, the configured IS changes nothing: the loss equals the loss without IS
    corr = compute_is_correction(prev, prev, tm, tm, layout, **is_correction_kwargs(cfg))
    torch.testing.assert_close(corr.weights[tm != 0], torch.ones_like(corr.weights[tm != 0]), rtol=0.0, atol=0.0)
    off = cfg.model_copy(
        update=dict(
            use_importance_sampling_correction=False,
            truncated_importance_sampling_type=None,
            truncated_importance_sampling_ratio=None,
            is_correction_level=None,
            truncated_importance_sampling_ratio_min=None,
            importance_sampling_veto_threshold=None,
            importance_sampling_batch_normalize=False,
        )
    )
    l_on, g_on, _ = run(cfg, x, data)
    l_off, g_off, _ = run(off, x, data)
    torch.testing.assert_close(l_on, l_off, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_on, g_off, rtol=1e-12, atol=1e-12)


@settings(max_examples=_EXAMPLES["invariant"], **HYPOTHESIS_SETTINGS)
@given(batch=batches(dtype=torch.float64), clamp=st.sampled_from([None, 20.0]))
def test_current_equal_prev_gives_ratio_one_at_every_ratio_level(batch, clamp):
    _, data = batch
    prev, tm = data["prev_logprobs"][:, 1:], data["token_mask"][:, 1:]
    layout = TokenLayout.padded(*prev.shape)
    curr = prev.clone().requires_grad_(True)
    for level in RATIO_LEVELS[1:]:
        log_r = policy_log_ratio(level, curr, prev, tm, layout, token_clamp=clamp)
        assert torch.equal(torch.exp(log_r)[tm != 0], torch.ones_like(prev[tm != 0])), level
    for level in RATIO_LEVELS[1:]:
        cfg = ClippedPGLossConfig(ratio_level=level, token_level_loss=level != "sequence")
        _, _, m = run(cfg, prev, data)
        n_seq, n_tok = counts(data)
        assert m["probs_ratio"] == pytest.approx(float(n_tok) / (float(n_tok) + 1e-8), rel=1e-12), level


@settings(max_examples=_EXAMPLES["invariant"], **HYPOTHESIS_SETTINGS)
@given(cfg=loss_configs(), batch=batches(dtype=torch.float64), seed=st.integers(0, 2**16))
def test_permuting_sequences_permutes_results(cfg, batch, seed):
    x, data = batch
    b = x.shape[0]
    perm = torch.as_tensor(np.random.default_rng(seed).permutation(b))
    pdata = {k: v[perm] for k, v in data.items()}
    loss, grad, metrics = run(cfg, x, data)
    p_loss, p_grad, p_metrics = run(cfg, x[perm], pdata)
    torch.testing.assert_close(p_loss, loss, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(p_grad, grad[perm], rtol=1e-9, atol=1e-12)
    for k, v in metrics.items():
        assert p_metrics[k] == pytest.approx(v, rel=1e-9, abs=1e-12, nan_ok=True), k
    # per-sequence IS weights follow the sequences
    prev, gen, tm = (data[k][:, 1:] for k in ("prev_logprobs", "generation_logprobs", "token_mask"))
    layout = TokenLayout.padded(*prev.shape)
    kw = is_correction_kwargs(cfg)
    kw["batch_normalize"] = False
    w = compute_is_correction(prev, gen, tm, tm, layout, **kw).weights
    pw = compute_is_correction(prev[perm], gen[perm], tm[perm], tm[perm], layout, **kw).weights
    torch.testing.assert_close(pw, w[perm], rtol=1e-12, atol=0.0)


# Metrics that are not additive across micro-batches by NeMo-RL's own definition (see docs/design.md).
_NOT_ADDITIVE_WHEN = {
    # NeMo-RL's GSPO broadcast bug: sum_i w_i * sum_j s_j / N is quadratic in the batch
    "sampling_importance_ratio": lambda c: c.sequence_level_importance_ratios and c.is_correction_level is None,
    # NeMo-RL divides the VAPO NLL by the local count of positive tokens
    "positive_nll_loss": lambda c: c.positive_example_nll_weight != 0,
    "loss": lambda c: c.positive_example_nll_weight != 0,
}


@settings(max_examples=_EXAMPLES["split"], **HYPOTHESIS_SETTINGS)
@given(cfg=loss_configs(), batch=batches(dtype=torch.float64, min_b=2, max_b=5), cut=st.integers(1, 4))
def test_micro_batches_with_global_counts_sum_to_the_whole_batch(cfg, batch, cut):
    # batch normalisation divides by the micro-batch mean (documented), the VAPO NLL by a local count (NeMo-RL)
    assume(not cfg.importance_sampling_batch_normalize and cfg.positive_example_nll_weight == 0)
    x, data = batch
    b = x.shape[0]
    cut = min(cut, b - 1)
    n_seq, n_tok = counts(data)
    loss, grad, metrics = run(cfg, x, data, n_seq, n_tok)
    parts = [slice(0, cut), slice(cut, b)]
    outs = [run(cfg, x[s], {k: v[s] for k, v in data.items()}, n_seq, n_tok) for s in parts]
    torch.testing.assert_close(outs[0][0] + outs[1][0], loss, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(torch.cat([outs[0][1], outs[1][1]]), grad, rtol=1e-9, atol=1e-12)
    for k, v in metrics.items():
        if k in _NOT_ADDITIVE_WHEN and _NOT_ADDITIVE_WHEN[k](cfg):
            continue
        a, c = outs[0][2][k], outs[1][2][k]
        combined = min(a, c) if k.endswith("_min") else max(a, c) if k.endswith("_max") else a + c
        # NaN metrics are the finiteness tests' business; here only additivity is checked
        assert combined == pytest.approx(v, rel=1e-9, abs=1e-12, nan_ok=True), (
            k,
            cfg.model_dump(exclude_defaults=True),
        )


# ------------------------------------------------------------------ regressions of bugs these properties found
def _one_sequence(curr: list[float], prev: list[float], gen: list[float], adv: float = -1.0):
    """B = 1: next_token_logprobs [1, S-1] = curr; prev / gen are [1, S] (column 0 unused); all tokens valid."""
    s = len(prev)
    data = {
        "token_mask": torch.tensor([[0.0] + [1.0] * (s - 1)]),
        "sample_mask": torch.ones(1),
        "advantages": torch.full((1, s), adv),
        "prev_logprobs": torch.tensor([prev]),
        "generation_logprobs": torch.tensor([gen]),
        "reference_policy_logprobs": torch.tensor([prev]),
    }
    return torch.tensor([curr]), data


@pytest.mark.parametrize("masked", [False, True])
def test_on_policy_kl_weight_overflow_gradient(masked):
    x, data = _one_sequence([-0.1], [0.0, -0.1], [0.0, -100.0])
    if masked:
        data["token_mask"][0, 1] = 0.0
    cfg = ClippedPGLossConfig(reference_policy_kl_penalty=0.01, use_on_policy_kl_approximation=True)
    loss, grad, _ = run(cfg, x, data)
    assert torch.isfinite(loss) and torch.isfinite(grad).all(), grad


def test_approx_entropy_with_certain_token_and_overflow():
    x, data = _one_sequence([0.0], [0.0, -0.1], [0.0, -535.0])
    _, _, metrics = run(ClippedPGLossConfig(), x, data)
    assert not nan_metrics(metrics), metrics["approx_entropy"]


def test_cumulative_is_weights_do_not_overflow_the_loss():
    x, data = _one_sequence([-0.1] * 200, [-0.1] * 201, [-0.6] * 201)
    cfg = ClippedPGLossConfig(use_importance_sampling_correction=True, is_correction_level="cumulative")
    loss, grad, _ = run(cfg, x, data)
    assert torch.isfinite(loss) and torch.isfinite(grad).all(), loss


def test_batch_normalised_weights_are_exactly_one_on_policy():
    prev = -torch.rand(2, 5, dtype=torch.float64)
    tm = torch.ones(2, 5, dtype=torch.float64)
    corr = compute_is_correction(
        prev,
        prev,
        tm,
        tm,
        TokenLayout.padded(2, 5),
        level="token",
        nemo_rl_exact=False,
        apply_weights=True,
        truncation=None,
        low=None,
        high=None,
        veto_threshold=None,
        batch_normalize=True,
    )
    assert torch.equal(corr.weights, torch.ones_like(corr.weights)), corr.weights
