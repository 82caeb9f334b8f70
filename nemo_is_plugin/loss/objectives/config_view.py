"""What a policy objective reads of the assembled config: :class:`ObjectiveConfig`, a ``typing.Protocol``.

The assembled ``ClippedPGLossConfig`` (``loss/config_model.py``) is built from the registry, so it imports the
objectives; were the objectives to name it, even for annotations only, config and objectives would form a circle. They
name this view instead: the generic keys and derived choices an objective may read, each typed as in
:class:`~nemo_is_plugin.config.keys.LossKeys`. ``ClippedPGLossConfig`` satisfies it structurally (it declares every one
of them), which mypy checks wherever a config is passed to an objective. An objective reads its own keys through its
section, ``MyKeys.of(cfg)`` (:meth:`~nemo_is_plugin.config.keys.KeySection.of`: at run time the config inherits every
registered section). Imports neither torch nor the loss.
"""

from __future__ import annotations

from typing import Protocol

from nemo_is_plugin.config.keys import ISCorrectionLevel, LossAggregation, RatioLevel
from nemo_is_plugin.config.rejection_rule import RejectionRule


class ObjectiveConfig(Protocol):
    """The config as an objective's hooks receive it (read-only): ``policy_objective``, the generic keys of PPO's
    ratio and clip, and the derived choices (``LossKeys``'s ``effective_*`` properties) that objectives read.
    NeMo-RL's ratio switches (``use_cispo``, ...) are read by name (``getattr``) by the registry.
    ``effective_objective`` / ``objective_switch``: the objective computed and the NeMo-RL switch that selected it
    (None: ``policy_objective`` names it), resolved once when the config was validated."""

    @property
    def policy_objective(self) -> str: ...

    @property
    def effective_objective(self) -> str: ...

    @property
    def objective_switch(self) -> str | None: ...

    @property
    def ratio_clip_min(self) -> float: ...

    @property
    def ratio_clip_max(self) -> float: ...

    @property
    def ratio_clip_c(self) -> float | None: ...

    @property
    def ratio_level(self) -> RatioLevel | None: ...

    @property
    def token_log_ratio_clamp(self) -> float | None: ...

    @property
    def token_level_loss(self) -> bool: ...

    @property
    def use_importance_sampling_correction(self) -> bool: ...

    @property
    def score_centering(self) -> bool: ...

    @property
    def effective_ratio_level(self) -> RatioLevel: ...

    @property
    def effective_is_level(self) -> ISCorrectionLevel: ...

    @property
    def effective_loss_aggregation(self) -> LossAggregation: ...

    @property
    def rejection_rules(self) -> tuple[RejectionRule, ...]: ...

    @property
    def bypasses_prev(self) -> bool: ...
