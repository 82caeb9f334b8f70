"""Score centering (arXiv 2609.20807): the per-token term that subtracts the sampler's expected weighted score.

At one prefix, with p the trainer (differentiable), q the sampler, y ~ q the sampled token, A the advantage and
f the token IS weight's calibration as a function of r = p / q, the centred loss of the token is

    l_t = -sg(A) [ sg(f(r_y)) log p_y  -  sum_v sg(q_v f(r_v)) log p_v ]

whose expectation over y ~ q has zero gradient for a constant A: the drift E_q[A] E_q[f grad log p] that a mismatched
sampler adds is cancelled, leaving Cov_q(A, f grad log p). Only the sampler's top-k head H is recorded; its tail is
modelled as rho p (rho = max(1 - Q_H, eps) / max(1 - P_H, eps)), on which r = 1 / rho is constant, and since
sum_v p_v grad log p_v = 0 the tail folds onto the head:

    l_t = policy term  +  sg(A) sum_{v in H} sg(c_v) log p_v,   c_v = q_v f(r_v) - alpha p_v,   alpha = rho f(1 / rho)

The head is one record, :class:`ScoreCenteringHead`, and each of its tensors has one name in the package from the
host's batch to the term: ``head_ids`` (the sampler's top-k ids), ``sampler_head`` (q at them), ``trainer_head`` (p at
them); the hosts' own keys (NeMo-RL's ``rollout_topk_ids`` / ``rollout_topk_logprobs`` / ``curr_topk_logprobs``, verl's
``rollout_topk_ids`` / ``rollout_topk_log_probs`` / ``topk_log_probs``, slime's ``rollout_topk_token_ids`` /
``rollout_topk_log_probs``) are read once, where each host's data enters. This module computes the second part
(:func:`centering_term`), f (:class:`Calibration`, from the IS keys), the head's checks, and the label and head
log-probs from one log-softmax (:func:`label_and_head_logprobs`). It sits at the floor of the other terms' math (it
imports only leaves of the loss package). Every
coefficient is detached: the gradient flows through the k head log-probs only. Sources: the paper's official loss
(github.com/MJ10/score-centering, ``losses.py``), verl ``verl/trainer/ppo/score_centering.py`` (PR #8010, commit
c6236f51), SkyRL PR #2244; docs/config.md, *Score centering*, derives each composition.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

import torch

from nemo_is_plugin.loss.denominator import Denominator
from nemo_is_plugin.loss.input_values import DeferredCheck

if TYPE_CHECKING:
    from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
    from nemo_is_plugin.loss.correction import ISCorrection

CalibrationKind = Literal["none", "tis", "icepop"]


@dataclass(frozen=True)
class ScoreCenteringHead:
    """The sampler's top-k head of each token, ``[*T, k]`` each, as score centering reads it.

    head_ids: integer vocabulary ids (None once only the log-probs are carried: the term never reads the ids).
    sampler_head: q_v, the sampler's full-vocabulary log-probs at them; -inf marks an empty slot (zero mass, no
    gradient). trainer_head: p_v, the trainer's log-probs at the same ids, requires grad, from the same log-softmax as
    the label's (a second normalisation would skew the tail ratio rho); None until the trainer's pass has computed
    them.
    """

    head_ids: torch.Tensor | None
    sampler_head: torch.Tensor
    trainer_head: torch.Tensor | None = None


@dataclass(frozen=True)
class Calibration:
    """f, the sampled token's IS weight as a function of its ratio r = p / q, evaluated on log r (never overflows):

    none    f(r) = 1                          (IS off: plain score centering)
    tis     f(r) = clamp(r, low or 0, high)   (truncated IS)
    icepop  f(r) = r 1[low <= r <= high]      (masked IS, IcePop / MIS)
    """

    kind: CalibrationKind = "none"
    low: float | None = None
    high: float | None = None

    @classmethod
    def of(cls, cfg: ClippedPGLossConfig) -> Calibration:
        """The f of a config's IS keys (the config refuses every setting without one: contradictions.py)."""
        if not cfg.use_importance_sampling_correction:
            return cls()
        kind = cfg.truncated_importance_sampling_type
        if kind not in ("tis", "icepop"):
            raise ValueError(f"score centering has no calibration for truncated_importance_sampling_type={kind!r}")
        return cls(kind, cfg.truncated_importance_sampling_ratio_min, cfg.truncated_importance_sampling_ratio)

    def __call__(self, log_r: torch.Tensor) -> torch.Tensor:
        if self.kind == "none":
            return torch.ones_like(log_r)
        lo = -math.inf if not self.low else math.log(self.low)
        hi = math.log(self.high) if self.high is not None else math.inf
        if self.kind == "tis":
            return torch.exp(log_r.clamp(lo, hi))
        in_band = (log_r >= lo) & (log_r <= hi)
        return torch.where(in_band, torch.exp(log_r.clamp(max=hi)), torch.zeros_like(log_r))


@dataclass(frozen=True)
class CenteringSpec:
    """Score centering's batch constants besides the sampler head: f, the tail floor, and 1 / the divisor of
    ``importance_sampling_batch_normalize`` (the coefficients are divided as the weights are; None without it)."""

    calibration: Calibration
    tail_floor: float
    scale: torch.Tensor | None = None

    @classmethod
    def of(cls, cfg: ClippedPGLossConfig, correction: ISCorrection | None) -> CenteringSpec:
        scale = None
        if cfg.importance_sampling_batch_normalize and correction is not None:
            factor = correction.batch_norm_factor  # the weights were divided by it where it is positive
            scale = torch.where(factor > 0, 1.0 / factor, torch.ones_like(factor))
        return cls(Calibration.of(cfg), cfg.score_centering_tail_floor, scale)


@dataclass
class CenteringOut:
    """The score-centering term of each token and what its metrics read (token tensors ``[*T]``, heads ``[*T, k]``).

    term: sg(A) sum_v sg(c_v) log p_v, with gradient through the head log-probs; 0 on tokens that do not count.
    coef: c_v (detached; 0 on empty slots). sampler_tail / trainer_tail: 1 - Q_H and 1 - P_H. rho: the tail ratio.
    filled: bool [*T, k], the head slots that hold a sampler log-prob. counted: bool [*T], the tokens the term acts on.
    """

    term: torch.Tensor
    coef: torch.Tensor
    sampler_tail: torch.Tensor
    trainer_tail: torch.Tensor
    rho: torch.Tensor
    filled: torch.Tensor
    counted: torch.Tensor


def centering_term(
    trainer_head: torch.Tensor,
    sampler_head: torch.Tensor,
    advantages: torch.Tensor,
    counted: torch.Tensor,
    calibration: Calibration,
    *,
    tail_floor: float,
    scale: torch.Tensor | None = None,
) -> CenteringOut:
    """The score-centering term of each token (see the module docstring).

    Args:
        trainer_head: Float[*T, k] the trainer's log-probs p_v at the head ids (requires grad).
        sampler_head: Float[*T, k] the sampler's log-probs q_v at them; -inf marks an empty slot.
        advantages: Float[*T] A (detached here).
        counted: bool [*T], the tokens the term acts on (the valid tokens with a finite generation log-prob).
        calibration: f. tail_floor: eps of rho. scale: 0-d factor of every coefficient (batch normalisation's 1/Z).
    """
    filled = torch.isfinite(sampler_head) & counted.unsqueeze(-1)
    # Empty slots and tokens that do not count take log p = 0 through a where: their gradient is exactly 0 whatever
    # value the slot holds (a padding id's log-prob, -inf).
    lp = torch.where(filled, trainer_head, torch.zeros_like(trainer_head))
    with torch.no_grad():
        lp_d = lp.detach()
        q_log = torch.where(filled, sampler_head.to(lp.dtype), torch.zeros_like(lp_d))
        p = torch.where(filled, lp_d.exp(), torch.zeros_like(lp_d))
        q = torch.where(filled, q_log.exp(), torch.zeros_like(lp_d))
        trainer_tail, sampler_tail = 1.0 - p.sum(-1), 1.0 - q.sum(-1)
        rho = sampler_tail.clamp_min(tail_floor) / trainer_tail.clamp_min(tail_floor)
        alpha = rho * calibration(-torch.log(rho))  # the modelled tail's ratio p / q is 1 / rho
        coef = torch.where(filled, q * calibration(lp_d - q_log) - alpha.unsqueeze(-1) * p, torch.zeros_like(p))
        if scale is not None:
            coef = coef * scale
        a = torch.where(counted, advantages.detach().to(lp.dtype), torch.zeros_like(alpha))
    term = a * (coef * lp).sum(-1)
    return CenteringOut(term, coef, sampler_tail, trainer_tail, rho, filled, counted)


def label_and_head_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, head_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-probs of ``labels [*T]`` and of ``head_ids [*T, k]`` from one log-softmax of ``logits [*T, V]``
    (fp32 for half-precision logits): the same normaliser for both, as the tail ratio rho needs."""
    dtype = torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype
    logp = torch.log_softmax(logits.to(dtype), dim=-1)
    label = logp.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    return label, logp.gather(-1, head_ids.long())


def check_head_shapes(
    token_shape: tuple[int, ...],
    top_k: int | None,
    head_ids: torch.Tensor | None,
    sampler_head: torch.Tensor | None,
    trainer_head: torch.Tensor | None,
    *,
    names: tuple[str, str, str] = ("rollout_topk_ids", "rollout_topk_logprobs", "curr_topk_logprobs"),
    hint: str = "",
) -> None:
    """Shapes and dtypes of the head tensors (no host read): each ``[*T, k]`` with ``*T = token_shape`` and k =
    ``top_k`` when set; ids integer, log-probs floating point. ``hint`` is appended to a shape error. Raises
    ``ValueError`` / ``TypeError`` naming the tensor, or ``KeyError`` for a missing one."""
    tensors = dict(zip(names, (head_ids, sampler_head, trainer_head)))
    missing = [name for name, t in tensors.items() if t is None]
    if missing:
        raise KeyError(
            f"score_centering: true needs {', '.join(missing)} (the sampler's top-k head of each token and the "
            "trainer's log-probs at it); set score_centering: false or record the head (docs/config.md)"
        )
    k = None
    for name, t in tensors.items():
        assert t is not None
        expect = "[*T, k]" if top_k is None else f"[*T, {top_k}]"
        if t.dim() != len(token_shape) + 1 or tuple(t.shape[:-1]) != tuple(token_shape):
            raise ValueError(f"{name} has shape {list(t.shape)}, expected {expect} with *T = {list(token_shape)}{hint}")
        if top_k is not None and t.shape[-1] != top_k:
            raise ValueError(f"{name} has k = {t.shape[-1]} log-probs per token, score_centering_top_k = {top_k}")
        if k is not None and t.shape[-1] != k:
            raise ValueError(f"the head tensors disagree on k: {name} has {t.shape[-1]}, the others {k}")
        k = t.shape[-1]
        integer = not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool
        if name == names[0] and not integer:
            raise TypeError(f"{name} has dtype {t.dtype}, expected an integer dtype (vocabulary ids)")
        if name != names[0] and not t.is_floating_point():
            raise TypeError(f"{name} has dtype {t.dtype}, expected a floating-point dtype")


@torch.no_grad()
def head_value_checks(
    counted: torch.Tensor,
    sampler_head: torch.Tensor,
    trainer_head: torch.Tensor,
    names: tuple[str, str],
    tolerance: float,
) -> list[DeferredCheck]:
    """The checks, unread (0-d device counts and what raises for them), of what the term cannot compute on the tokens it
    acts on (``counted``, bool [*T]): a sampler log-prob that is NaN, +inf or above ``tolerance`` (a -inf is an empty
    slot), and a trainer log-prob that is not finite in a filled slot (its coefficient times -inf). Other tokens may
    hold anything (padding). Read with a caller's other checks (``PendingInputChecks.add``) or alone
    (:func:`check_head_values`)."""
    filled = torch.isfinite(sampler_head) & counted.unsqueeze(-1)
    bad_q = counted.unsqueeze(-1) & ((sampler_head != -math.inf) & ~filled | (sampler_head > tolerance))
    bad_p = filled & ~torch.isfinite(trainer_head)

    def refusal(name: str, bad: torch.Tensor, values: torch.Tensor) -> DeferredCheck:
        def raise_if_bad(count: float) -> None:
            if count:
                first = [int(i) for i in bad.nonzero()[0]]
                value = values[tuple(first)].item()
                raise ValueError(
                    f"{name} holds {int(count)} value(s) the score-centering term cannot use on counted tokens (NaN, "
                    "+inf or positive sampler log-probs; non-finite trainer log-probs where the sampler's are finite), "
                    f"first at {first} = {value!r}; mark an empty head slot with -inf in both"
                )

        return DeferredCheck(bad.sum(), raise_if_bad)

    return [refusal(names[0], bad_q, sampler_head), refusal(names[1], bad_p, trainer_head)]


def check_head_values(
    counted: torch.Tensor,
    sampler_head: torch.Tensor,
    trainer_head: torch.Tensor,
    names: tuple[str, str],
    tolerance: float,
) -> None:
    """:func:`head_value_checks` read at once (one host read): raises for the first bad head tensor."""
    checks = head_value_checks(counted, sampler_head, trainer_head, names, tolerance)
    counts = torch.stack([c.scalar for c in checks]).tolist()  # the one host read
    for check, count in zip(checks, counts):
        check.raise_if_bad(count)


class CenteringBook(Protocol):
    """What :func:`score_centering_metrics` writes to: the loss's ``MetricBook``, or a host adapter's book (slime's
    reduces with its own reducer)."""

    def add_sum(self, name: str, value: torch.Tensor, per: Denominator) -> None: ...

    def token_mean(self, name: str, values: torch.Tensor, mask: torch.Tensor | None = None) -> None: ...


@torch.no_grad()
def score_centering_metrics(
    book: CenteringBook,
    out: CenteringOut,
    loss_part: torch.Tensor,
    per: Denominator,
    curr: torch.Tensor,
    trainer_head: torch.Tensor,
    advantages: torch.Tensor,
    is_weight: torch.Tensor | None,
) -> None:
    """What shows the term at work (token means over the tokens it acts on, divided by the global token count):

    score_centering_loss            its aggregated value (the loss's denominator)
    score_centering_sampler_tail    1 - Q_H, the sampler's mass outside the head
    score_centering_trainer_tail    1 - P_H, the trainer's
    score_centering_tail_ratio      rho
    score_centering_drift           sum_v |c_v|: the L1 size of the sampler-minus-trainer weighted score it removes
                                    (0 on-policy: q = p gives rho = 1 and c = 0)
    score_centering_grad_abs        |A| sum_v |c_v|, the term's coefficient mass on the head's scores
    score_centering_pg_grad_abs     |A| w_t, the policy term's on the sampled token's score (at pi = pi_old)
    score_centering_sampled_in_head the fraction of tokens whose sampled token is in the head (its trainer log-prob
                                    equals a head slot's: the same log-softmax gives the same value)
    and, after summation (``finalize_metrics``), score_centering_share = grad_abs / (grad_abs + pg_grad_abs).
    """
    book.add_sum("score_centering_loss", loss_part, per)
    mask = out.counted.to(out.coef.dtype)
    coef_l1 = out.coef.abs().sum(-1)
    a = advantages.abs().to(coef_l1.dtype)
    w = torch.ones_like(a) if is_weight is None else is_weight.to(a.dtype)
    in_head = (out.filled & (trainer_head.detach().to(curr.dtype) == curr.detach().unsqueeze(-1))).any(-1)
    for name, values in (
        ("score_centering_sampler_tail", out.sampler_tail),
        ("score_centering_trainer_tail", out.trainer_tail),
        ("score_centering_tail_ratio", out.rho),
        ("score_centering_drift", coef_l1),
        ("score_centering_grad_abs", a * coef_l1),
        ("score_centering_pg_grad_abs", a * w.abs()),
        ("score_centering_sampled_in_head", in_head.to(mask.dtype)),
    ):
        book.token_mean(name, torch.where(out.counted, values, torch.zeros_like(values)), mask)


__all__ = [
    "Calibration",
    "CenteringBook",
    "CenteringOut",
    "CenteringSpec",
    "ScoreCenteringHead",
    "centering_term",
    "check_head_shapes",
    "check_head_values",
    "head_value_checks",
    "label_and_head_logprobs",
    "score_centering_metrics",
]
