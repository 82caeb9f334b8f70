"""YAML recipes -> :class:`~nemo_is_plugin.config.ClippedPGLossConfig`, through OmegaConf.

A *recipe* is any YAML a host trainer reads: a bare ``loss_fn`` mapping, or a host's whole master config (NeMo-RL's
``grpo_*.yaml``, verl's ``ppo_trainer.yaml``) from which only one section -- ``loss_fn`` by default, any dotted path
otherwise -- is read. What is supported, in the order it is applied:

1. ``defaults:`` inheritance as NeMo-RL's ``load_config`` does it: a path (or list of paths, relative to the file) whose
   configs are merged first, the file's own keys on top;
2. CLI-style dotted overrides, Hydra syntax: ``loss_fn.is_correction_level=sequence_mean`` (the key must exist in
   the file or be a loss config field),
   ``+loss_fn.new_key=1`` (the key must not exist), ``++key=value`` (either), ``~key`` (delete). Values are parsed as
   YAML (``null``, ``true``, ``0.5``, ``[1, 2]``);
3. interpolations (``${grpo.max_len}``, ``${oc.env:VAR,default}``) resolved *inside the section only*, against the
   whole config, so an unresolvable interpolation elsewhere in a master config does not matter;
4. validation by the pydantic config, whose errors name the offending keys.

The section may carry ``name: <registered loss>`` (see :mod:`nemo_is_plugin.registry`); it is split off before
validation.
"""

from __future__ import annotations

import copy
import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from nemo_is_plugin.config import ClippedPGLossConfig, ConfigError
from nemo_is_plugin.registry import DEFAULT_LOSS_NAME, NAME_KEY, split_name

Source = Union[str, "os.PathLike[str]", Mapping[str, Any], DictConfig]
DEFAULT_SECTION = "loss_fn"
_DEFAULTS_KEY = "defaults"


class RecipeError(ConfigError):
    """A recipe that cannot be read: missing file or section, bad override, cyclic ``defaults``."""


@dataclass(frozen=True)
class LossSpec:
    """What a recipe asks for: the registered loss ``name`` and its validated ``config``."""

    name: str
    config: ClippedPGLossConfig


# ----------------------------------------------------------------------------------------------- loading


def _load_file(path: Path, seen: tuple[Path, ...] = ()) -> DictConfig:
    path = path.expanduser().resolve()
    if path in seen:
        raise RecipeError(f"cyclic 'defaults' chain: {' -> '.join(str(p) for p in (*seen, path))}")
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {path}")
    try:
        cfg = OmegaConf.load(path)
    except (yaml.YAMLError, OmegaConfBaseException) as exc:  # malformed YAML or interpolation grammar
        raise RecipeError(f"{path}: not a readable YAML recipe: {exc}") from exc
    if not isinstance(cfg, DictConfig):
        raise RecipeError(f"{path}: a recipe must be a YAML mapping, got a {type(cfg).__name__}")
    parents = cfg.pop(_DEFAULTS_KEY, None)
    if parents is None:
        return cfg
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, (list, ListConfig)) or not all(isinstance(p, str) for p in parents):
        # Hydra's defaults *lists* of group entries are not NeMo-RL's inheritance; refuse instead of guessing.
        raise RecipeError(f"{path}: 'defaults' must be a path or a list of paths relative to the file, got {parents!r}")
    merged = OmegaConf.merge(*(_load_file(path.parent / p, (*seen, path)) for p in parents), cfg)
    assert isinstance(merged, DictConfig)
    return merged


def load_yaml(source: Source, overrides: Sequence[str] = ()) -> DictConfig:
    """An OmegaConf config from a YAML path or a mapping, with ``defaults`` merged and ``overrides`` applied.

    Interpolations are left unresolved (see :func:`loss_section`).
    """
    if isinstance(source, DictConfig):
        cfg = copy.deepcopy(source)  # overrides must not touch the caller's config
    elif isinstance(source, Mapping):
        cfg = OmegaConf.create(dict(source))
    elif isinstance(source, (str, os.PathLike)):
        cfg = _load_file(Path(source))
    else:
        raise RecipeError(f"a recipe is a YAML path or a mapping, got {type(source).__name__}")
    for item in overrides:
        apply_override(cfg, item)
    return cfg


def apply_override(cfg: DictConfig, item: str) -> None:
    """Apply one Hydra-style override (``key=value``, ``+key=value``, ``++key=value``, ``~key``) to ``cfg`` in place."""
    text = item.strip()
    if text.startswith("~"):
        key = text[1:].split("=", 1)[0]
        parent_key, _, leaf = key.rpartition(".")
        parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
        if not isinstance(parent, DictConfig) or leaf not in parent:
            raise RecipeError(f"override {item!r}: cannot delete {key!r}, it does not exist")
        del parent[leaf]
        return
    mode = "++" if text.startswith("++") else "+" if text.startswith("+") else ""
    body = text[len(mode) :]
    if "=" not in body:
        raise RecipeError(f"override {item!r} is not of the form key=value")
    key, raw = body.split("=", 1)
    key = key.strip()
    exists = OmegaConf.select(cfg, key, default=_MISSING, throw_on_resolution_failure=False) is not _MISSING
    # A loss key the file leaves at its default is still a known key: the schema, not the file, says what exists.
    known_leaf = key.rpartition(".")[2] in set(ClippedPGLossConfig.model_fields) | {NAME_KEY}
    if mode == "" and not exists and not known_leaf:
        raise RecipeError(f"override {item!r}: key {key!r} is not in the config{_hint(cfg, key)}; "
                          f"use +{key}=... to add it")
    if mode == "+" and exists:
        raise RecipeError(f"override {item!r}: key {key!r} already exists; use {key}=... or ++{key}=... to change it")
    value = OmegaConf.from_dotlist([f"v={raw}"])["v"]  # parse the value exactly as OmegaConf's CLI does
    OmegaConf.update(cfg, key, value, merge=False, force_add=True)


_MISSING = object()


def _hint(cfg: DictConfig, key: str) -> str:
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    if isinstance(parent, DictConfig):
        candidates = {str(k) for k in parent.keys()} | set(ClippedPGLossConfig.model_fields)
        near = difflib.get_close_matches(leaf, sorted(candidates), n=1, cutoff=0.6)
        if near:
            return f" (did you mean {(parent_key + '.' if parent_key else '') + near[0]!r}?)"
    return ""


# ----------------------------------------------------------------------------------------------- sections


def _looks_like_loss_section(cfg: DictConfig) -> bool:
    keys = {str(k) for k in cfg.keys()}  # an empty mapping is an empty section: every default
    return keys <= set(ClippedPGLossConfig.model_fields) | {NAME_KEY}


def loss_section(cfg: DictConfig, section: str = DEFAULT_SECTION) -> dict[str, Any]:
    """The ``section`` (dotted path) of ``cfg`` as a plain dict with its interpolations resolved.

    A config that is itself a bare loss section (only loss keys, plus ``name``) is accepted as is.
    """
    node = OmegaConf.select(cfg, section, default=_MISSING, throw_on_missing=True)
    if node is _MISSING:
        if _looks_like_loss_section(cfg):
            node = cfg
        else:
            top = ", ".join(sorted(str(k) for k in cfg.keys())) or "(empty)"
            raise RecipeError(f"no {section!r} section in the config (top-level keys: {top})")
    if node is None:  # `loss_fn:` with nothing under it: every default
        return {}
    if not isinstance(node, DictConfig):
        raise RecipeError(f"{section!r} must be a mapping, got {node!r}")
    try:
        resolved = OmegaConf.to_container(node, resolve=True, throw_on_missing=True)
    except Exception as exc:  # omegaconf's InterpolationResolutionError / MissingMandatoryValue
        raise RecipeError(f"cannot resolve {section!r}: {exc}") from exc
    assert isinstance(resolved, dict)
    return {str(k): v for k, v in resolved.items()}


def load_loss_spec(source: Source, overrides: Sequence[str] = (), section: str = DEFAULT_SECTION,
                   default_name: str = DEFAULT_LOSS_NAME) -> LossSpec:
    """Read ``section`` of a recipe (YAML path, mapping or DictConfig) into a :class:`LossSpec`."""
    cfg = load_yaml(source, overrides)
    name, values = split_name(loss_section(cfg, section), default_name)
    where = f"{source}" if isinstance(source, (str, os.PathLike)) else "config"
    try:
        config = ClippedPGLossConfig(**values)
    except (ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
        raise RecipeError(f"{where}: invalid {section!r} section: {exc}") from exc
    return LossSpec(name=name, config=config)


def load_loss_config(source: Source, overrides: Sequence[str] = (), section: str = DEFAULT_SECTION
                     ) -> ClippedPGLossConfig:
    """The validated loss config of a recipe; ``name`` is ignored (see :func:`load_loss_spec`)."""
    return load_loss_spec(source, overrides, section).config


def to_loss_mapping(source: Optional[Source], overrides: Sequence[str] = (), section: str = DEFAULT_SECTION
                    ) -> dict[str, Any]:
    """A plain ``loss_fn`` mapping (``name`` kept) from a recipe, for hosts that validate it themselves."""
    if source is None:
        return {}
    return loss_section(load_yaml(source, overrides), section)
