"""The unknown-key policy of a ``loss_fn`` section: a warning by default (NeMo-RL accepts extra keys), an error in
strict mode (per call, or for the whole process through ``NEMO_IS_STRICT_CONFIG``). Imports without torch.
"""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Iterable
from contextvars import ContextVar

from nemo_is_plugin.config.errors import ConfigError, UnknownConfigKeyWarning

# Truthy value of this variable makes unknown keys an error everywhere (NeMo-RL builds the loss itself, so a constructor
# flag would not reach it); ``load_loss_config(..., strict=...)`` decides per call.
STRICT_KEYS_ENV = "NEMO_IS_STRICT_CONFIG"


# Set for the duration of one validation by ``load_loss_config(strict=...)`` / ``model_validate(context=...)``
# (the custom ``__init__`` makes pydantic drop the validation context, so the flag travels here).
STRICT_KEYS_OVERRIDE: ContextVar[bool | None] = ContextVar("nemo_is_strict_keys", default=None)


def strict_keys_default() -> bool:
    """Whether unknown keys are an error when the caller does not say: ``NEMO_IS_STRICT_CONFIG`` is 1/true/yes/on."""
    return os.environ.get(STRICT_KEYS_ENV, "").strip().lower() in ("1", "true", "yes", "on")


# Keys of another host's vocabulary that the hosts' adapters translate into plugin keys (adapters/host_vocabulary.py):
# the assembled config, which reads plugin keys only, refuses them rather than ignore a correction the user asked for.
ADAPTER_TRANSLATED_KEYS = {
    "rollout_correction": "verl's rollout_correction (a preset or its keys), which the hosts' adapters translate "
    "(NeMoRLLossFn, verl's policy_loss.nemo_is and slime's nemo_is sections, nemo-is validate), is not a key of the "
    "config itself: build through an adapter, or write the plugin keys it stands for (nemo_is_plugin.adapters.verl."
    "config.rollout_correction_entry_keys gives them)",
}


def closest_name(name: str, known: Iterable[str]) -> str | None:
    """The known name nearest to a misspelled ``name`` (difflib, ratio >= 0.5), or None: every "did you mean"."""
    near = difflib.get_close_matches(str(name), sorted(known), n=1, cutoff=0.5)
    return near[0] if near else None


def unknown_keys_message(unknown: list[str], known: set[str], section: str = "loss_fn") -> str:
    """``unknown <section> key(s): 'x' (did you mean 'y'?), ...`` with the nearest valid key of each."""
    hints = []
    for key in unknown:
        near = closest_name(key, known)
        hints.append(f"'{key}'" + (f" (did you mean '{near}'?)" if near else ""))
    return f"unknown {section} key(s): " + ", ".join(hints)


def check_unknown_keys(
    unknown: list[str],
    known: set[str],
    *,
    strict: bool,
    section: str = "loss_fn",
    ignored_as: str = "NeMo-RL accepts extra keys",
) -> None:
    """The unknown-key policy: an error (``ConfigError``) when ``strict``, else an :class:`UnknownConfigKeyWarning`
    saying why (``ignored_as``: the host whose section it is; each adapter names its own).

    NeMo-RL's own config model accepts extra keys, so a section NeMo-RL runs with must not be refused by default.
    """
    if not unknown:
        return
    message = unknown_keys_message(unknown, known, section)
    if strict:
        raise ConfigError(
            message + ". Valid keys are the NeMo-RL ClippedPGLossConfig keys and the plugin keys listed in "
            f"docs/config.md (strict mode: unset {STRICT_KEYS_ENV} to only warn)."
        )
    warnings.warn(
        message + f"; they are ignored ({ignored_as}). Set {STRICT_KEYS_ENV}=1 to make this an error.",
        UnknownConfigKeyWarning,
        stacklevel=2,
    )
