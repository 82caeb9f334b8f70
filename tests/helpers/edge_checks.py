"""The invariants the edge-input grid test checks on one (config, edge input): what docs/config.md ("Edge inputs")
promises, the weight rule of a non-finite generation log-prob, and that masked values change nothing.

- :func:`nemo_rl_call` runs ``ClippedPGLoss.__call__`` (NeMo-RL's layout) and returns its outcome: loss, gradient and
  metrics, or the exception;
- :func:`check_outcome` compares an outcome with :func:`helpers.edge_inputs.expectation` (and with the base batch's
  outcome for ``same``);
- :func:`check_weight_rule` checks the IS weights of ``compute_is_correction`` (the function every loss path calls)
  at the tokens a non-finite generation log-prob zeroes, and that the loss's gradient there is 0 where nothing else
  reads those tokens.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from helpers.edge_inputs import KEYS, EdgeInput, Expectation
from nemo_is_plugin import ClippedPGLossConfig, TokenLayout, build_loss_fn
from nemo_is_plugin.loss.correction import compute_is_correction
from nemo_is_plugin.loss.separable import CAUSAL_LEVELS, is_token_separable
from nemo_is_plugin.loss.terms import is_correction_kwargs

# NeMo-RL's own mismatch metrics, inf / NaN where a generation log-prob is not finite (docs/nemo_rl.md), as NeMo-RL's
NEMO_RL_MISMATCH = {"token_mult_prob_error", "gen_kl_error", "policy_kl_error", "js_divergence_error", "approx_entropy"}


@dataclass
class Outcome:
    loss: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    metrics: dict[str, float] | None = None
    error: Exception | None = None


def counts(data: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    sm = data["sample_mask"]
    return sm.sum(), (data["token_mask"][:, 1:] * sm[:, None]).sum()


def nemo_rl_call(cfg: ClippedPGLossConfig, curr: torch.Tensor, data: dict[str, torch.Tensor]) -> Outcome:
    x = curr.detach().clone().requires_grad_(True)
    n_seq, n_tok = counts(data)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the tolerant mode's one-time warnings
            loss, metrics = build_loss_fn(cfg)(
                next_token_logprobs=x, data=data, global_valid_seqs=n_seq, global_valid_toks=n_tok
            )
            if loss.requires_grad:
                loss.backward()
    except (ValueError, KeyError, TypeError) as exc:
        return Outcome(error=exc)
    grad = torch.zeros_like(x) if x.grad is None else x.grad
    return Outcome(loss.detach(), grad, dict(metrics))


def check_outcome(got: Outcome, want: Expectation, edge: EdgeInput, base: Outcome, where: str) -> None:
    if want.outcome == "refused":
        assert isinstance(got.error, ValueError), f"{where}: not refused ({got.error!r}, loss {got.loss})"
        text = str(got.error)
        assert "\n" not in text and want.tensor in text, f"{where}: the refusal must name {want.tensor}: {text}"
        return
    assert got.error is None, f"{where}: raised {got.error!r}"
    assert got.loss is not None and got.grad is not None and got.metrics is not None
    if want.outcome == "same":
        assert torch.equal(got.loss, base.loss), f"{where}: loss {got.loss} != {base.loss}"
        assert torch.equal(got.grad, base.grad), f"{where}: gradient changed"
        changed = [k for k, v in base.metrics.items() if not _same(got.metrics[k], v)]
        assert not changed, f"{where}: metrics changed {changed}"
        return
    assert torch.isfinite(got.loss), f"{where}: loss {got.loss}"
    assert torch.isfinite(got.grad).all(), f"{where}: gradient {got.grad}"
    allowed = NEMO_RL_MISMATCH if edge.key == KEYS["gen"] and edge.value is not None else set()
    nan = [k for k, v in got.metrics.items() if math.isnan(v) and k not in allowed]
    assert not nan, f"{where}: NaN metrics {nan}"
    if want.outcome == "zero":
        assert got.loss.item() == 0.0 and (got.grad == 0).all(), f"{where}: loss {got.loss} on no token"


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def zeroed_tokens(cfg: ClippedPGLossConfig, edge: EdgeInput, token_mask: torch.Tensor) -> torch.Tensor | None:
    """Bool[B, S-1]: the counted tokens whose IS weight the non-finite generation log-prob of ``edge`` makes 0
    (docs/config.md), None when it promises no zero there (NeMo-RL's tis with a min lifts it to the min; without IS
    weights and rejections nothing reads the generation log-probs)."""
    if edge.key != KEYS["gen"] or edge.value is None or math.isfinite(edge.value) or edge.where != "valid":
        return None
    bad = torch.zeros_like(token_mask, dtype=torch.bool)
    for i, j in edge.positions:
        bad[i, j - 1] = True
    rejects = (
        cfg.truncated_importance_sampling_type in ("seq-mask-tis", "seq-mis", "geo-rs")
        or bool(cfg.rejection_rules)
        or cfg.importance_sampling_veto_threshold is not None
    )
    nemo_rl_exact = cfg.is_correction_level is None
    if not cfg.use_importance_sampling_correction:
        return bad if rejects else None
    lifted = (
        nemo_rl_exact
        and cfg.truncated_importance_sampling_type == "tis"
        and cfg.truncated_importance_sampling_ratio_min
    )
    if lifted and not rejects:
        return None
    level = cfg.effective_is_level
    if nemo_rl_exact and lifted:
        return bad  # the rejection drops the token itself; its sequence's weight is tis's min
    counted = token_mask != 0
    if level in ("sequence", "sequence_mean"):
        return counted & bad.any(-1, keepdim=True)
    if level == "cumulative":
        return counted & (torch.cumsum(bad.int(), -1) > 0)
    return bad


def token_local(cfg: ClippedPGLossConfig) -> bool:
    """Whether the loss term of token t reads no other token's current log-prob (its gradient is its own)."""
    if cfg.bypasses_prev:
        return False
    causal = cfg.policy_objective == "ppo_clip" and cfg.effective_ratio_level in CAUSAL_LEVELS
    return is_token_separable(cfg) or cfg.force_on_policy_ratio or causal


def check_weight_rule(cfg: ClippedPGLossConfig, edge: EdgeInput, curr, data, got: Outcome, where: str) -> None:
    tm = data["token_mask"][:, 1:].double()
    zero = zeroed_tokens(cfg, edge, tm)
    if zero is None or got.error is not None:
        return
    valid = tm * data["sample_mask"][:, None].double()
    prev = curr.detach().double() if cfg.force_on_policy_ratio else data["prev_logprobs"][:, 1:].double()
    gen = data["generation_logprobs"][:, 1:].double()
    layout = TokenLayout.padded(*tm.shape)
    corr = compute_is_correction(prev, gen, tm, valid, layout, **is_correction_kwargs(cfg))
    assert (corr.weights[zero] == 0).all(), f"{where}: weights {corr.weights[zero].tolist()} where 0 is promised"
    assert torch.isfinite(corr.weights).all(), f"{where}: non-finite weights"
    assert got.metrics is not None and math.isfinite(got.metrics["is_weight_max"])
    whole_rows = bool((zero.any(-1) == (zero | (tm == 0)).all(-1)).all())
    quiet = cfg.effective_kl_penalty == 0 and cfg.positive_example_nll_weight == 0
    if quiet and (token_local(cfg) or whole_rows):
        assert got.grad is not None and (got.grad[zero] == 0).all(), f"{where}: gradient {got.grad[zero].tolist()}"
