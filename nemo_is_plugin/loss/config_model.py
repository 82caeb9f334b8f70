"""The loss configuration: NeMo-RL's ``loss_fn`` keys, plus independent IS / ratio / clip / KL / aggregation choices.

The keys themselves (type, default, choices, range) are the fields of :class:`~nemo_is_plugin.config.keys.LossKeys`
and of each policy objective's :class:`~nemo_is_plugin.config.keys.KeySection`, declared in the objective's module
(``nemo_is_plugin/loss/objectives/``) next to its formula: the only places where defaults live. This module imports no
torch itself, but it imports the objective modules (which do) to assemble the model, so it sits in the loss layer,
above them; the package root re-exports ``ClippedPGLossConfig`` lazily (docs/design.md, *Layers*). Every NeMo-RL
``ClippedPGLossConfig`` key is accepted with NeMo-RL's name, type and default, so an existing NeMo-RL ``loss_fn``
section validates unchanged.
The new fields default to ``None`` / off, in which case the loss reproduces NeMo-RL's ``ClippedPGLossFn``.

Formulas (p = prev_logprobs, g = generation_logprobs, c = current log-probs, m = token mask, t = 1-based position among
unmasked tokens):

- ratio_level (policy ratio pi_theta / pi_old):
    token            r_t = exp(c_t - p_t)                                   (PPO / GRPO)
    sequence         r_i = exp(sum_t m_t (c_t - p_t) / sum_t m_t)           (GSPO; one ratio per sequence)
    sequence_token   r_it = sg[r_i] * exp(c_t - sg[c_t])                    (GSPO-token; gradient through token t)
    cumulative       r_it = exp(sg[sum_{j<=t} m_j (c_j - p_j)] + c_t - sg[c_t])   (CTPO cumprod)
    cumulative_mean  as cumulative with the prefix sum divided by t         (CTPO geomean)
- is_correction_level (IS weight pi_prev / pi_gen, always detached):
    token            w_t = exp(p_t - g_t)
    sequence         w_i = exp(sum_t m_t (p_t - g_t))                       (NeMo-RL GSPO default; collapses when long)
    sequence_mean    w_i = exp(sum_t m_t (p_t - g_t) / sum_t m_t)          (NeMo-RL PR #2269, geometric mean)
    cumulative       w_it = exp(sum_{j<=t} m_j (p_j - g_j))                 (prefix correction; no framework has it)
- log-space clip (CTPO), when log_ratio_clip_low/high are set:
    clipped ratio = exp(clamp(log r, -eps_low * t^power, eps_high * t^power)); dual clip c_t = exp(eps_c * t^power).
- rejection rules (verl's rollout_rs): keep a token / sequence while min <= agg_t k(y_t) <= max, y = clamp(p - g, +-20),
    k1 = -y, k2 = y^2 / 2, k3 = e^y - 1 - y, or prob_diff = |e^p - e^g| (unclamped), agg = per token | sequence sum |
    mean | max (RejectionRule).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, PrivateAttr, ValidationError, ValidatorFunctionWrapHandler, field_validator, model_validator

from nemo_is_plugin.config.contradictions import contradictions
from nemo_is_plugin.config.errors import ConfigError, ConfigValidationError
from nemo_is_plugin.config.field_types import NumericRange
from nemo_is_plugin.config.keys import (
    TOKEN_AGGREGATIONS,
    LossKeys,
)
from nemo_is_plugin.config.unknown_keys import (
    ADAPTER_TRANSLATED_KEYS,
    STRICT_KEYS_OVERRIDE,
    check_unknown_keys,
    strict_keys_default,
    unknown_keys_message,
)
from nemo_is_plugin.loss.objectives import (
    DEFAULT_OBJECTIVE,
    OBJECTIVES,
    key_sections,
    load_entry_point_objectives,
    objective_contradictions,
    objective_names,
    objective_of,
    seal_registry,
    unresolved_objective_message,
)
from nemo_is_plugin.loss.objectives import base as objective_base
from nemo_is_plugin.loss.objectives._import_path import REGISTERED_BY_PATH, is_import_path, objective_by_import_path
from nemo_is_plugin.loss.objectives.nemo_rl_switches import resolve_objective

# Other packages' objectives (entry-point group nemo_is_plugin.objectives) register before the model is built from the
# registry. This module is imported on first use (the package root re-exports it lazily), and built once. An entry
# point that fails to load is a warning here; a config naming an objective it would have provided is refused below.
load_entry_point_objectives()

if TYPE_CHECKING:
    from pydantic_core import InitErrorDetails  # a TypedDict: a type only

    # Typed code reads an objective's keys through its section (``DppoKeys.of(cfg)``), in the objective's module.
    _Keys = LossKeys
    PolicyObjective = str
else:
    # The generic keys first, then each registered objective's section (pydantic lists the fields of the last base
    # first), so that a new objective's keys join the model without an edit here.
    _Keys = type("_Keys", (*reversed([section for section, _ in key_sections()]), LossKeys), {})
    PolicyObjective = Literal[objective_names()]


class ClippedPGLossConfig(_Keys):
    """Configuration of :class:`nemo_is_plugin.loss.ClippedPGLoss`.

    Its keys (NeMo-RL's ``ClippedPGLossConfig`` at commit 7ea279ab, then the plugin's independent choices) are the
    fields of :class:`~nemo_is_plugin.config.keys.LossKeys`, each with its type, default, choices and valid range;
    this class adds the unknown-key policy, the combination checks and the derived choices. See ``docs/config.md``.
    """

    _objective: tuple[str, str | None] | None = PrivateAttr(None)  # (effective_objective, objective_switch)
    policy_objective: PolicyObjective = Field(
        DEFAULT_OBJECTIVE,
        description="The per-token surrogate and its trust region, anchored at pi_old (docs/objectives.md): "
        + ", ".join(OBJECTIVES[name].summary for name in objective_names())
        + ".",
    )

    # ------------------------------------------------------------------ construction: one exception type
    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigValidationError.wrap(exc) from None

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> ClippedPGLossConfig:
        """pydantic's ``model_validate``; ``context={"strict_keys": True}`` makes unknown keys an error."""
        token = STRICT_KEYS_OVERRIDE.set((kwargs.get("context") or {}).get("strict_keys"))
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as exc:
            raise ConfigValidationError.wrap(exc) from None
        finally:
            STRICT_KEYS_OVERRIDE.reset(token)

    def __setattr__(self, name: str, value: Any) -> None:
        fields = type(self).model_fields
        if name not in fields and not name.startswith("_"):  # assigning an unknown key is always an error
            error = ConfigError(unknown_keys_message([name], set(fields)))
            detail: InitErrorDetails = {"type": "value_error", "loc": (name,), "input": value, "ctx": {"error": error}}
            raise ConfigValidationError.from_exception_data(type(self).__name__, [detail])
        try:
            super().__setattr__(name, value)
        except ValidationError as exc:
            raise ConfigValidationError.wrap(exc) from None

    # ------------------------------------------------------------------ validation
    @field_validator("policy_objective", mode="wrap")
    @classmethod
    def _known_objective(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        # A name nothing registers gets one line (the nearest name, the entry points that failed) instead of
        # pydantic's list of every choice; a value of the wrong type is pydantic's to refuse.
        # A 'module:Class' value is imported (loss/objectives/_import_path.py): a registered class gives its name,
        # a class without keys is registered under the path, which stays outside the choices of the Literal.
        if not isinstance(value, str):
            return handler(value)
        if value not in OBJECTIVES:
            if not is_import_path(value):
                raise ConfigError(unresolved_objective_message(value, objective_names()))
            value = objective_by_import_path(value)
        return value if value in REGISTERED_BY_PATH else handler(value)

    @model_validator(mode="before")
    @classmethod
    def _drop_unknown_keys(cls, data: Any) -> Any:
        if isinstance(data, Mapping):  # a dict, or e.g. an OmegaConf DictConfig given to model_validate
            known = set(cls.model_fields)
            unknown = [k for k in data if k not in known]
            translated = [ADAPTER_TRANSLATED_KEYS[k] for k in unknown if k in ADAPTER_TRANSLATED_KEYS]
            if translated:
                raise ConfigError("; ".join(translated))
            if unknown:
                strict = STRICT_KEYS_OVERRIDE.get()
                check_unknown_keys(unknown, known, strict=strict_keys_default() if strict is None else bool(strict))
                data = {k: v for k, v in data.items() if k in known}
        return data

    @model_validator(mode="after")
    def _check_combinations(self) -> ClippedPGLossConfig:
        # token_level_loss follows an explicit loss_aggregation unless the user set both (then they must agree), so
        # that a model_dump() reloads unchanged.
        if self.loss_aggregation is not None and "token_level_loss" not in self.model_fields_set:
            self.__dict__["token_level_loss"] = self.loss_aggregation in TOKEN_AGGREGATIONS
        # The objective, resolved once per validation (NeMo-RL's switches read here only): what every reader reads.
        self._objective = None
        self._resolved_objective()
        # Runs only once every field is valid: out-of-range values were refused by their NumericRange already.
        shared = objective_contradictions(self)  # the rules every objective shares, then the objective's own
        errors = [msg for msg in contradictions(self, shared) if msg]
        if errors:
            raise ConfigError("; ".join(errors))
        return self

    # ------------------------------------------------------------------ derived choices (the generic ones: LossKeys)
    def _resolved_objective(self) -> tuple[str, str | None]:
        """(the objective computed, the NeMo-RL switch that selected it): resolved at validation, which every
        construction and assignment runs; resolved here only for a model built without validation
        (``model_construct``)."""
        if self._objective is None:
            self._objective = resolve_objective(self.policy_objective, self)
        return self._objective

    @property
    def effective_objective(self) -> str:
        """The objective computed: ``policy_objective``, or the one NeMo-RL's switch selects under ``ppo_clip``
        (``force_on_policy_ratio`` -> ``on_policy``, ``disable_ppo_ratio`` -> ``reinforce``, ``use_cispo`` ->
        ``cispo``; :func:`~nemo_is_plugin.loss.objectives.nemo_rl_switches.resolve_objective`), resolved once."""
        return self._resolved_objective()[0]

    @property
    def objective_switch(self) -> str | None:
        """The NeMo-RL switch that selected the objective (``use_cispo``, ...); None: ``policy_objective`` names it."""
        return self._resolved_objective()[1]

    @property
    def objective(self) -> objective_base.PolicyObjective:
        """The registered objective this config computes (:func:`~nemo_is_plugin.loss.objectives.objective_of`)."""
        return objective_of(self)

    @property
    def uses_log_space_clip(self) -> bool:
        """Whether PPO's clip is CTPO's log-space clip (``log_ratio_clip_low`` / ``_high`` set)."""
        from nemo_is_plugin.loss.objectives.ppo_clip import uses_log_space_clip

        return uses_log_space_clip(self)


seal_registry(ClippedPGLossConfig.__qualname__)

# Every numeric key's interval, read from its field (the docs' range table and the tests compare against it).
NUMERIC_RANGES: dict[str, NumericRange] = {
    key: meta
    for key, info in ClippedPGLossConfig.model_fields.items()
    for meta in info.metadata
    if isinstance(meta, NumericRange)
}


def load_loss_config(
    config: ClippedPGLossConfig | dict[str, Any], *, strict: bool | None = None
) -> ClippedPGLossConfig:
    """Validate a NeMo-RL ``loss_fn`` mapping (or pass an existing config through).

    Raises :class:`ConfigValidationError` (a pydantic ``ValidationError``, ``ValueError`` and ``AssertionError``).
    ``strict``: unknown keys are an error (True) or a warning (False); None reads ``NEMO_IS_STRICT_CONFIG``.
    """
    if isinstance(config, ClippedPGLossConfig):
        return config
    if not isinstance(config, dict):
        try:
            config = dict(config)  # e.g. an OmegaConf DictConfig converted by the caller, or a Mapping
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"loss_fn config must be a mapping, got {type(config).__name__}") from exc
    context = None if strict is None else {"strict_keys": strict}
    return ClippedPGLossConfig.model_validate(config, context=context)
