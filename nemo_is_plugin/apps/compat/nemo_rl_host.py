"""NeMo-RL as ``nemo-is compat`` runs it: the installed ``ClippedPGLossFn`` against the plugin's drop-in.

The config is read as NeMo-RL's ``load_config`` reads a master YAML (``defaults:`` inheritance, then Hydra-style
overrides; :mod:`nemo_is_plugin.adapters.recipes`), and only its ``loss_fn`` section matters. The host's part of it is
every key NeMo-RL's own ``ClippedPGLossConfig`` declares (read from the installed class: its pydantic fields, or the
keys of the older ``TypedDict``); the other keys are the plugin's. Both losses are built as ``grpo.setup`` builds
its loss, ``ClippedPGLossFn(ClippedPGLossConfig(**loss_fn))`` -- NeMo-RL's config model keeps extra keys, which is how
the plugin's keys reach the drop-in -- and called as NeMo-RL's workers call a LOGPROB loss, once per batch with the
batch's global counts.
"""

from __future__ import annotations

import importlib
import warnings
from pathlib import Path
from typing import Any, get_type_hints

import torch

from nemo_is_plugin.apps.compat.batches import CompatBatch
from nemo_is_plugin.apps.compat.compare import Outcome, run_call
from nemo_is_plugin.config import ConfigError, UnknownConfigKeyWarning
from nemo_is_plugin.config.unknown_keys import unknown_keys_message
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig

HOST_MODULE = "nemo_rl.algorithms.loss.loss_functions"
INSTALL_HINT = (
    "run nemo-is compat where NeMo-RL itself runs: in NeMo-RL's checkout, `uv run nemo-is compat ...` "
    "(nemo-is-plugin installed into that environment), or install NeMo-RL (https://github.com/NVIDIA-NeMo/RL)"
)
_DOCS = "docs/nemo_rl.md, 'Where the plugin deliberately differs'"
# NeMo-RL's algorithms by their master-config section, and the loss each one's setup builds (nemo_rl/algorithms/*.py,
# commit 7ea279ab): the plugin replaces ClippedPGLossFn, which grpo.py and ppo.py build; the others have other losses.
CLIPPED_PG_ALGORITHMS = ("grpo", "ppo")
OTHER_ALGORITHM_LOSSES = {
    "distillation": "DistillationLossFn (or CrossTokenizerDistillationLossFn)",
    "dpo": "DPOLossFn",
    "sft": "NLLLossFn",
    "rm": "PreferenceLossFn",
}
# loss_fn keys of DistillationLossConfig (a bare loss_fn section names no algorithm)
DISTILLATION_LOSS_KEYS = ("kl_type", "mixed_kl_weight", "zero_outside_topk")


class HostUnavailableError(RuntimeError):
    """The host trainer cannot be imported here; the message names what to install."""


def import_host(module: str, hint: str, what: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise HostUnavailableError(f"{what} is not importable here ({exc}): {hint}") from None


def _declared_keys(config_cls: type) -> set[str]:
    fields = getattr(config_cls, "model_fields", None)  # pydantic (NeMo-RL since #2325)
    if fields is not None:
        return set(fields)
    return set(get_type_hints(config_cls))  # the TypedDict of older NeMo-RL


def _refuse_other_losses(master: Any) -> None:
    """A recipe of a NeMo-RL algorithm whose loss is not ClippedPGLossFn has nothing the plugin replaces: say so,
    rather than call its loss_fn keys unknown (or its missing loss_fn section)."""
    if any(name in master for name in CLIPPED_PG_ALGORITHMS):
        return
    algorithm = next((name for name in OTHER_ALGORITHM_LOSSES if name in master), None)
    section = master.get("loss_fn", master) or {}  # a bare file is the section itself
    theirs = [k for k in section if k in DISTILLATION_LOSS_KEYS]
    if algorithm is None and not theirs:
        return
    what = f"a NeMo-RL {algorithm} recipe" if algorithm else "a NeMo-RL distillation loss_fn section"
    keys = f" (loss_fn keys {', '.join(theirs)})" if theirs else ""
    raise ConfigError(
        f"{what}{keys}: its loss is NeMo-RL's {OTHER_ALGORITHM_LOSSES[algorithm or 'distillation']}, not "
        "ClippedPGLossFn, the loss the plugin replaces (GRPO and PPO recipes): there is nothing to compare"
    )


class NeMoRLHost:
    """The installed NeMo-RL's ``ClippedPGLossFn`` and the plugin's, built from one master config."""

    name = "NeMo-RL"

    def __init__(self, config: str | Path, overrides: list[str] | tuple[str, ...] = ()):
        from nemo_is_plugin.adapters.recipes import load_loss_spec, load_yaml, loss_section

        module = import_host(HOST_MODULE, INSTALL_HINT, "NeMo-RL")
        self._loss_cls = module.ClippedPGLossFn
        self._config_cls = module.ClippedPGLossConfig
        master = load_yaml(config, overrides)
        _refuse_other_losses(master)
        section = loss_section(master)
        if section.get("score_centering"):
            raise ConfigError(
                "score_centering: NeMo-RL's ClippedPGLossFn has no score centering and compat's batches (synthetic or "
                "a rollout dump) hold no sampler head: compare without it (nemo-is validate runs it on a synthetic one)"
            )
        section.pop("name", None)
        with warnings.catch_warnings():  # reported below: a key neither loss reads is most likely a typo
            warnings.simplefilter("ignore", UnknownConfigKeyWarning)
            spec = load_loss_spec(
                config, overrides
            )  # the section validates as the plugin's config (RecipeError if not)
        unknown = [k for k in spec.given if k not in ClippedPGLossConfig.model_fields]
        if unknown:
            raise ConfigError(
                unknown_keys_message(unknown, set(ClippedPGLossConfig.model_fields))
                + ": neither NeMo-RL's ClippedPGLossFn nor the plugin reads them, so compat refuses them"
            )
        declared = _declared_keys(self._config_cls)
        self.host_keys = {k: v for k, v in section.items() if k in declared}
        self.plugin_keys = {k: v for k, v in section.items() if k not in declared}
        self.deliberate_settings: dict[str, str] = {}  # every NeMo-RL setting runs as NeMo-RL runs it
        self._losses: dict[str, Any] = {}

    # ------------------------------------------------------------------ building, as grpo.setup does
    def _config(self, keys: dict[str, Any]) -> Any:
        if hasattr(self._config_cls, "model_fields"):
            return self._config_cls(**keys)
        return dict(keys)

    def _loss(self, which: str, keys: dict[str, Any]) -> Any:
        """The cached loss object; raises what its constructor raises (NeMo-RL asserts on bad combinations)."""
        cache_key = f"{which}:{sorted(keys.items())!r}"
        if cache_key not in self._losses:
            if which == "host":
                self._losses[cache_key] = self._loss_cls(self._config(keys))
            else:
                from nemo_is_plugin.adapters.nemo_rl import NeMoRLLossFn

                self._losses[cache_key] = NeMoRLLossFn(self._config(keys))
        return self._losses[cache_key]

    @staticmethod
    def _call(build, batch: CompatBatch) -> Outcome:
        def call():
            loss_fn = build()
            data = {k: v.clone() for k, v in batch.data.items()}
            x = batch.logprobs.clone().requires_grad_(True)
            sm = data["sample_mask"]
            loss, metrics = loss_fn(
                next_token_logprobs=x,
                data=data,
                global_valid_seqs=sm.sum(),
                global_valid_toks=(data["token_mask"][:, 1:] * sm[:, None]).sum(),
            )
            return loss, metrics, x

        return run_call(call)

    def run_host(self, batch: CompatBatch) -> Outcome:
        return self._call(lambda: self._loss("host", self.host_keys), batch)

    def run_plugin(self, batch: CompatBatch, plugin_keys: dict[str, Any]) -> Outcome:
        return self._call(lambda: self._loss("plugin", {**self.host_keys, **plugin_keys}), batch)

    # ------------------------------------------------------------------ documented differences
    def deliberate(self, kind: str, name: str, batch: CompatBatch) -> str | None:
        if kind != "nan_gradient":
            return None
        keys = self.host_keys
        beta = 0.0 if keys.get("use_kl_in_reward") else keys.get("reference_policy_kl_penalty", 0.01)
        gen = batch.data["generation_logprobs"][:, 1:]
        nonfinite_gen = bool((~torch.isfinite(gen) & batch.valid).any())
        if keys.get("use_on_policy_kl_approximation") and beta != 0 and nonfinite_gen:
            return (
                "NaN gradients: NeMo-RL's on-policy KL weight at a -inf generation log-prob back-propagates 0 * inf; "
                f"the plugin differentiates the value NeMo-RL computes ({_DOCS})"
            )
        return None


__all__ = ["HOST_MODULE", "HostUnavailableError", "NeMoRLHost", "import_host"]
