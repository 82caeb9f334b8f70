"""KL(pi_theta || pi_ref) estimators per token (Schulman's k1, k2, k3) with NeMo-RL's clamps and weights.

With logr = log pi_ref - log pi_theta (= ref - c):  k1 = -logr,  k2 = logr^2 / 2,  k3 = exp(logr) - 1 - logr.
All three are (nearly) unbiased *values* of the KL for samples from pi_theta, but as losses their gradients differ:
E[grad k2] = grad KL, while E[grad k3] = -E[(pi_ref/pi_theta) grad log pi_theta] != grad KL (docs/evidence.md, 3).

``weights`` multiplies the estimator before the output clamp. NeMo-RL passes w = exp(c - sg[c]) (value 1, gradient
grad c), which adds the score-function term k * grad log pi; with it, w * k1 and w * k3 have unbiased expected
gradients but w * k2 does not (its expectation is grad E[k2]; measured in docs/evidence.md), and
``use_on_policy_kl_approximation`` uses w = exp(c - g) instead. ``straight_through_k2`` keeps the value of the chosen
estimator (weights and clamps included) and replaces the gradient by k2's pathwise gradient (c - ref) grad c, which is
unbiased for tokens sampled from pi_theta (verl's ``k3+``, which is broken in verl b178a3cd). :class:`KLSpec` is one
KL term's choice of all of these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

import torch

from nemo_is_plugin.config.field_types import KLType
from nemo_is_plugin.loss.is_weights import exp_or_zero

if TYPE_CHECKING:
    from nemo_is_plugin.loss.config_model import ClippedPGLossConfig

KL_TYPES: tuple[str, ...] = get_args(KLType)


def kl_estimate(logr: torch.Tensor, kl_type: str) -> torch.Tensor:
    """k1 / k2 / k3 of ``logr = ref - logprobs``. Float[*T] -> Float[*T]."""
    if kl_type == "k1":
        return -logr
    if kl_type == "k2":
        return torch.square(logr) / 2
    if kl_type == "k3":
        return torch.exp(logr) - 1 - logr
    raise ValueError(f"reference_policy_kl_type must be one of {KL_TYPES}, got {kl_type!r}")


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    *,
    kl_type: str,
    input_clamp: float | None = None,
    output_clamp: float | None = None,
    weights: torch.Tensor | None = None,
    straight_through_k2: bool = False,
) -> torch.Tensor:
    """Per-token KL penalty.

    Args:
        logprobs: Float[*T] log pi_theta of the sampled tokens (requires grad for a loss).
        ref_logprobs: Float[*T] log pi_ref (no grad).
        kl_type: k1 | k2 | k3.
        input_clamp: clamp of logr to +-value; where it is active the weight is detached (no gradient leaks).
        output_clamp: clamp of the weighted estimate to +-value.
        weights: Float[*T] per-token weight multiplied before the output clamp (see module docstring).
        straight_through_k2: value of ``kl_type``, gradient of k2.
    Returns:
        Float[*T].
    """
    logr = ref_logprobs - logprobs
    w = weights
    if input_clamp is not None:
        active = (logr < -input_clamp) | (logr > input_clamp)
        # an explicit selection, not clamp's own tie rule (1 up to torch 2.13, 0 from 2.15): at |logr| == clamp the
        # weight stays live, so the estimator must too, or the gradient mixes the two sides (no subgradient)
        logr = torch.where(active, logr.clamp(-input_clamp, input_clamp), logr)
        if w is not None:
            w = torch.where(active, w.detach(), w)
    kl = kl_estimate(logr, kl_type)
    if w is not None:
        kl = w * kl
    if straight_through_k2:
        k2 = kl_estimate(logr, "k2")
        kl = k2 + (kl - k2).detach()
    if output_clamp is not None:
        kl = kl.clamp(-output_clamp, output_clamp)
    return kl


def score_function_weight(logprobs: torch.Tensor) -> torch.Tensor:
    """exp(c - sg[c]): value 1, gradient grad c; NeMo-RL's default KL weight. NaN/inf -> 0 as in NeMo-RL."""
    return torch.nan_to_num(torch.exp(logprobs - logprobs.detach()), nan=0.0, posinf=0.0, neginf=0.0)


KLWeight = Literal["score_function", "generation", "anchor", "none"]


@dataclass(frozen=True)
class KLSpec:
    """How the per-token KL penalty is computed (:func:`kl_penalty`): the estimator, its clamps, its weight, i.e.
    which role's log-probs weight it (``score_function``: exp(c - sg c), NeMo-RL's default; ``generation``:
    exp(c - log mu), the on-policy approximation; ``anchor``: exp(c - log pi_old), slime's unbiased KL; ``none``) and
    whether its gradient is k2's (straight-through). A host's ``Roles`` carries it (loss/roles.py)."""

    kl_type: str
    input_clamp: float | None = None
    output_clamp: float | None = None
    weight: KLWeight = "none"
    straight_through_k2: bool = False

    @classmethod
    def of(cls, cfg: ClippedPGLossConfig) -> KLSpec:
        """The plugin's KL keys."""
        return cls(
            kl_type=cfg.reference_policy_kl_type,
            input_clamp=cfg.kl_input_clamp_value,
            output_clamp=cfg.kl_output_clamp_value,
            weight="generation" if cfg.use_on_policy_kl_approximation else "score_function",
            straight_through_k2=cfg.reference_policy_kl_gradient == "k2",
        )

    def tokens(self, c: torch.Tensor, reference: torch.Tensor, generation: torch.Tensor, anchor: torch.Tensor):
        """The per-token KL of ``c`` to ``reference`` (before its coefficient); token-wise in ``c``."""
        weights = {
            "score_function": lambda: score_function_weight(c),
            "generation": lambda: exp_or_zero(c - generation),
            "anchor": lambda: torch.exp(c - anchor),
            "none": lambda: None,
        }[self.weight]()
        return kl_penalty(
            c,
            reference,
            kl_type=self.kl_type,
            input_clamp=self.input_clamp,
            output_clamp=self.output_clamp,
            weights=weights,
            straight_through_k2=self.straight_through_k2,
        )
