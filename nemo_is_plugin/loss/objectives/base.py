"""What a policy objective is: one class holding its formula, its keys, its refusals and its metrics, registered by
name with :func:`register_objective`.

An objective turns the current log-probs ``c`` and their anchor ``a`` (pi_old, or the rollout policy mu under
``old_policy_logprobs: generation``) into a per-token surrogate loss and the indicators its metrics read
(:class:`SurrogateOut`). Everything else of the loss is the objective's surroundings, computed once for every
objective by :mod:`nemo_is_plugin.loss.terms`: the IS weights that multiply its per-token loss, the KL term, the
aggregation, the metrics every objective shares.

A new objective is one module in this package: a subclass of :class:`PolicyObjective` decorated with
:func:`register_objective`, and its keys as a :class:`~nemo_is_plugin.config.keys.KeySection` (flat ``loss_fn`` keys,
validated by ``ClippedPGLossConfig``, which inherits every registered section). The package imports its modules by
discovery: nothing else is edited.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from nemo_is_plugin.config.keys import KeySection
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.objectives.nemo_rl_switches import (
    DEFAULT_OBJECTIVE,
    NEMO_RL_CLIP_KEYS,
    NEMO_RL_SWITCHES,
    RATIO_SWITCHES,
    effective_objective,
    nemo_rl_key_refusals,
    selecting_switch,
)
from nemo_is_plugin.loss.ratios import token_log_ratio

if TYPE_CHECKING:
    from nemo_is_plugin.loss.objectives.config_view import ObjectiveConfig


class ObjectiveBook(Protocol):
    """What an objective's ``report`` writes its metrics to: the loss's ``MetricBook``, or a host adapter's book that
    reduces them as its host does (``adapters/slime/metrics.py``)."""

    layout: TokenLayout
    valid: torch.Tensor

    def token_mean(self, name: str, values: torch.Tensor, mask: torch.Tensor | None = None) -> None: ...

    def seq_mean(self, name: str, per_seq: torch.Tensor, sample_mask: torch.Tensor) -> None: ...

    def extrema(self, name: str, values: torch.Tensor, valid: torch.Tensor) -> None: ...


# verl (compute_policy_loss_dppo_tv / _sapo) and UniRL (_cppo_mask) clamp the token log-ratio here before exp.
OBJECTIVE_LOG_RATIO_CLAMP = 20.0


@dataclass(kw_only=True)
class SurrogateOut:
    """An objective's per-token result, built by keyword: its loss, and the ratio and clip indicators its metrics read
    where the objective has them (None: it has none; the shared metrics then report nothing under that name).

    loss: Float[*T] per-token loss (to be minimised). ratio: Float[*T] the policy ratio its loss reads (detached), None
    for an objective without one (REINFORCE, GPG read log pi itself). clipped_ratio: Float[*T] the ratio after the
    objective's clip (detached; None: no clipped ratio). clipped / clipped_low / clipped_high / dual_clipped: Bool[*T]
    indicators (CTPO's definitions for PPO's clip): clipped = the objective dropped or clipped the token (verl's
    ``pg_clipfrac``); high = that with A > 0, the ratio above its bound; low = that with A < 0 (A <= 0 for the trust
    masks); dual = the dual clip, or DPPO's ratio cap, is active. None: the objective has no such clip."""

    loss: torch.Tensor
    ratio: torch.Tensor | None = None
    clipped_ratio: torch.Tensor | None = None
    clipped: torch.Tensor | None = None
    clipped_low: torch.Tensor | None = None
    clipped_high: torch.Tensor | None = None
    dual_clipped: torch.Tensor | None = None


@dataclass
class ObjectiveInputs:
    """What an objective's formula reads. Token tensors of ``layout`` (or flat ``[n]`` slices of them in the fused
    single pass, whose layout is then not read), all detached but ``curr``.

    curr: c (requires grad). anchor: a, the old log-probs the ratio divides by, equal to ``c`` (detached) on tokens
    that do not count (:func:`~nemo_is_plugin.loss.terms.ratio_anchor`). positions: n_t, the 1-based position among
    unmasked tokens. causal_anchor: set by the fused single pass for the cumulative ratios: the value of the ratio's
    stop-gradient part from the running sums of earlier chunks (``separable.PrefixCarry``); None otherwise.
    """

    config: ObjectiveConfig
    curr: torch.Tensor
    anchor: torch.Tensor
    advantages: torch.Tensor
    token_mask: torch.Tensor
    valid: torch.Tensor
    layout: TokenLayout
    positions: torch.Tensor
    causal_anchor: torch.Tensor | None = None

    def token_log_ratio(self, default_clamp: float | None = OBJECTIVE_LOG_RATIO_CLAMP) -> torch.Tensor:
        """d = c - a, clamped at +-``token_log_ratio_clamp`` when set, else at +-``default_clamp``."""
        clamp = self.config.token_log_ratio_clamp
        return token_log_ratio(self.curr, self.anchor, default_clamp if clamp is None else clamp)


@dataclass
class ObjectiveOut:
    """An objective's per-token surrogate, and what its own metrics read (``state``: e.g. CPPO's budget, a batch
    statistic; None when it reports only the shared clip fractions)."""

    surrogate: SurrogateOut
    state: Any = None


class PolicyObjective:
    """One ``policy_objective``: its formula and what follows from it, nothing of any host. Subclasses set the class
    attributes and override :meth:`surrogate`; the other hooks have defaults.

    name: the value of ``policy_objective``. keys: its :class:`KeySection` (None: no keys of its own). required: keys
    that must be set with it. ratio_levels: the ``ratio_level`` values it accepts when one is set (none: the key must
    stay unset); ratio: what it uses instead, for that refusal. summary: one line of the key's description.
    pi_old_is_current: the old log-probs are the current ones, detached (the on-policy ratio): the batch's
    ``prev_logprobs`` are not read, and the IS weights compare sg(c) with mu.

    What a host needs to know of an objective lives with that host, keyed by objective name: NeMo-RL's clip keys and
    switches (:data:`~nemo_is_plugin.loss.objectives.nemo_rl_switches.NEMO_RL_RATIO_KEYS`, read by the loss's
    NeMo-RL-shaped config), verl's modes and the level of verl's own IS weights (``adapters/verl/loss_modes.py``).
    """

    name: ClassVar[str] = ""
    keys: ClassVar[type[KeySection] | None] = None
    required: ClassVar[tuple[str, ...]] = ()
    ratio_levels: ClassVar[tuple[str, ...]] = ()
    ratio: ClassVar[str] = "no policy ratio"
    summary: ClassVar[str] = ""
    pi_old_is_current: ClassVar[bool] = False

    def surrogate(self, t: ObjectiveInputs) -> ObjectiveOut:
        """The per-token loss and its indicators (module docstring)."""
        raise NotImplementedError

    def refusals(self, cfg: ObjectiveConfig) -> list[str]:
        """Cross-field checks when this objective is chosen (each message names the fields and the fix)."""
        return []

    def whole_batch_reason(self, cfg: ObjectiveConfig) -> str | None:
        """Why a token's gradient needs log-probs beyond those of its own and earlier tokens (a sequence sum, a
        quantile, a batch statistic): the fused loss then takes two passes. None: it does not."""
        return None

    def causal(self, cfg: ObjectiveConfig) -> bool:
        """True when a token's loss reads the log-probs of the earlier tokens of its sequence (the cumulative ratios):
        the fused single pass then carries per-sequence running sums from chunk to chunk."""
        return False

    def differentiates_ratio(self, cfg: ObjectiveConfig) -> bool:
        """True when the surrogate differentiates an unclamped policy ratio exp(log r) itself, so that a ratio beyond
        the dtype's range makes the gradient NaN (``output_checks.check_finite_loss`` then refuses the call). The
        objectives that clamp log r first, or stop its gradient, do not."""
        return False

    def report(self, book: ObjectiveBook, out: ObjectiveOut, sample_mask: torch.Tensor) -> None:
        """The objective's own metrics, beside the clip fractions every objective reports from its indicators."""

    def finalize(self, metrics: Mapping[str, float]) -> dict[str, float]:
        """Non-additive statistics derived from its summed metrics (``finalize_metrics``); none by default."""
        return {}

    def describe(self, cfg: ObjectiveConfig) -> str:
        """The trust region in words (``nemo-is validate --show-effective``)."""
        return self.summary

    def describe_ratio(self, cfg: ObjectiveConfig) -> str | None:
        """The policy ratio in words, where the objective defines its own; None: the configured ratio level."""
        return None

    def score_centering_refusals(self, cfg: ObjectiveConfig) -> list[str]:
        """Why ``score_centering`` does not compose with this objective (checked with ``score_centering: true``). By
        default it does not: an objective with which it composes (its gradient weights a token's own score by a
        function of that token's ratio and IS weight) overrides this."""
        return [
            "score_centering centres the score of PPO / REINFORCE's token policy gradient; policy_objective="
            f"{self.name!r} weights a token's score by its own gate or trust mask, which the head coefficients do not "
            "model: use ppo_clip or score_centering: false"
        ]


class TokenRatioObjective(PolicyObjective):
    """An objective on the token ratio alone: its mask or gate reads each token's own probability, so a sequence or
    cumulative ``ratio_level`` is refused."""

    ratio_levels = ("token",)
    ratio = "the token ratio (its mask or gate is per token probability)"


OBJECTIVES: dict[str, PolicyObjective] = {}


# Set once ClippedPGLossConfig is built from the registry: its keys and policy_objective choices are fixed then.
_SEALED_BY: list[str] = []


def seal_registry(by: str) -> None:
    """Refuse registrations from now on: ``by`` (what was built from the registry) would not see them."""
    _SEALED_BY.append(by)


def register_objective(cls: type[PolicyObjective]) -> type[PolicyObjective]:
    """Class decorator: register one instance of ``cls`` under ``cls.name`` (a name registered twice is an error, and
    so is a registration once the config model is built)."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in OBJECTIVES:
        raise ValueError(f"policy_objective {cls.name!r} is registered twice ({cls.__name__})")
    if _SEALED_BY:
        raise ValueError(
            f"policy_objective {cls.name!r} ({cls.__name__}) is registered after {_SEALED_BY[0]} was built from the "
            "registry, so its keys and name would be unknown to the config: name its module in the entry-point group "
            "'nemo_is_plugin.objectives', or import it before the config is first used"
        )
    OBJECTIVES[cls.name] = cls()
    return cls


def objective_of(cfg: ObjectiveConfig) -> PolicyObjective:
    """The registered objective of a config: the one lookup, of the name the config resolved once when it was
    validated (``effective_objective``; ``ClippedPGLossConfig.objective`` is this)."""
    return OBJECTIVES[cfg.effective_objective]


def chosen_as(cfg: ObjectiveConfig) -> str:
    """How the config chose its objective, for messages: ``policy_objective='x'`` or ``use_cispo=true (cispo)``."""
    switch, name = cfg.objective_switch, cfg.effective_objective
    return f"policy_objective={name!r}" if switch is None else f"{switch}=true (policy_objective {name!r})"


def key_sections() -> list[tuple[type[KeySection], list[str]]]:
    """Every registered key section once, in registration order, with the objectives that read it."""
    out: dict[type[KeySection], list[str]] = {}
    for name, objective in OBJECTIVES.items():
        if objective.keys is not None:
            out.setdefault(objective.keys, []).append(name)
    return list(out.items())


def objective_contradictions(cfg: ObjectiveConfig) -> list[str]:
    """The config checks every objective shares (run by ``ClippedPGLossConfig`` with the generic ones of
    :mod:`nemo_is_plugin.config.contradictions`): the keys of the objectives not chosen (each section's
    :meth:`~nemo_is_plugin.config.keys.KeySection.unread`), the chosen objective's required keys and ratio level, then
    its own refusals."""
    objective = objective_of(cfg)
    chosen = objective.name
    out = [
        msg
        for section, readers in key_sections()
        if chosen not in readers
        for msg in section.unread(cfg, readers, chosen)
    ]
    out += nemo_rl_key_refusals(cfg)
    for key in objective.required:
        if getattr(cfg, key) is None:
            out.append(f"{chosen_as(cfg)} needs {key} (see docs/objectives.md)")
    if cfg.ratio_level is not None and cfg.ratio_level not in objective.ratio_levels:
        out.append(f"{chosen_as(cfg)} uses {objective.ratio}: unset ratio_level={cfg.ratio_level!r}")
    out += objective.refusals(cfg)
    return out + (objective.score_centering_refusals(cfg) if cfg.score_centering else [])


def max_unclipped_on_tie(unclipped: torch.Tensor, clipped: torch.Tensor) -> torch.Tensor:
    """max(unclipped, clipped), a tie going to the unclipped branch by explicit selection.

    The two tie wherever the ratio is inside its clip range or on a bound. On a bound the unclipped derivative is one
    of the loss's one-sided derivatives (its derivative where the bound is not a kink, e.g. the upper bound with
    A < 0); ``torch.maximum`` splits a tie evenly and the clipped branch then brings clamp's own tie rule (gradient 1
    up to torch 2.13, 0 from 2.15), which gave half the derivative at such a smooth point."""
    return torch.where(clipped > unclipped, clipped, unclipped)


@dataclass
class TrustMask:
    """keep: Bool[*T] tokens inside a trust region. masked_high / masked_low: Bool[*T] tokens dropped with A > 0 /
    with A <= 0 (disjoint; their union is ``~keep``). divergence: Float[*T] the divergence the rule thresholds."""

    keep: torch.Tensor
    masked_high: torch.Tensor
    masked_low: torch.Tensor
    divergence: torch.Tensor


def split_by_sign(keep: torch.Tensor, advantages: torch.Tensor, divergence: torch.Tensor) -> TrustMask:
    """A trust region's keep-mask with its dropped tokens split by advantage sign (the metric quadrants)."""
    positive = advantages > 0
    dropped = ~keep
    return TrustMask(keep, dropped & positive, dropped & ~positive, divergence)


def masked_ratio_surrogate(log_ratio: torch.Tensor, advantages: torch.Tensor, mask: TrustMask) -> SurrogateOut:
    """-A r on kept tokens (prime-rl ``ipo``, CPPO): the ratio's own gradient, no truncation."""
    ratio = torch.exp(log_ratio)
    loss = -advantages * ratio * mask.keep.to(ratio.dtype)
    return SurrogateOut(
        loss=loss, ratio=ratio.detach(), clipped=~mask.keep, clipped_low=mask.masked_low, clipped_high=mask.masked_high
    )


__all__ = [
    "DEFAULT_OBJECTIVE",
    "NEMO_RL_CLIP_KEYS",
    "NEMO_RL_SWITCHES",
    "OBJECTIVES",
    "OBJECTIVE_LOG_RATIO_CLAMP",
    "RATIO_SWITCHES",
    "ObjectiveInputs",
    "ObjectiveOut",
    "PolicyObjective",
    "SurrogateOut",
    "TokenRatioObjective",
    "TrustMask",
    "key_sections",
    "masked_ratio_surrogate",
    "chosen_as",
    "effective_objective",
    "max_unclipped_on_tie",
    "nemo_rl_key_refusals",
    "objective_of",
    "register_objective",
    "selecting_switch",
    "split_by_sign",
]
