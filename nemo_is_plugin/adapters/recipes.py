"""YAML recipes -> :class:`~nemo_is_plugin.ClippedPGLossConfig`, through OmegaConf.

A *recipe* is any YAML a host trainer reads: a bare ``loss_fn`` mapping, or a host's whole master config (NeMo-RL's
``grpo_*.yaml``, verl's ``ppo_trainer.yaml``) from which only one section -- ``loss_fn`` by default, any dotted path
otherwise -- is read. What is supported, in the order it is applied:

1. ``defaults:`` inheritance as NeMo-RL's ``load_config`` does it: a path (or list of paths, relative to the file) whose
   configs are merged first, the file's own keys on top;
2. CLI-style dotted overrides, Hydra syntax, parsed and merged by OmegaConf (``merge_with_dotlist``):
   ``loss_fn.is_correction_level=sequence_mean`` (the key must exist in the file or be a loss config key of the
   section), ``+grpo.new_key=1`` (the key must not exist), ``++key=value`` (either), ``~key`` (delete). Values are
   parsed as YAML (``null``, ``true``, ``0.5``, ``[1, 2]``). An override that matches nothing -- a misspelt key, a
   loss key without its ``loss_fn.`` prefix, a key inside the loss section that is no loss key -- is an error naming
   the nearest valid key;
3. interpolations (``${grpo.max_len}``, ``${oc.env:VAR,default}``) resolved *inside the section only*, against the
   whole config, so an unresolvable interpolation elsewhere in a master config does not matter;
4. validation by the pydantic config, whose errors name the offending keys.

The section may carry ``name: <registered loss>`` (see :mod:`nemo_is_plugin.loss.registry`); it is checked against the
registry and split off before validation.
"""

from __future__ import annotations

import copy
import difflib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from nemo_is_plugin.adapters.host_vocabulary import applied_other_hosts_keys
from nemo_is_plugin.config import ConfigError
from nemo_is_plugin.config.unknown_keys import ADAPTER_TRANSLATED_KEYS
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
from nemo_is_plugin.loss.registry import DEFAULT_LOSS_NAME, NAME_KEY, UnknownLossError, check_loss_name, split_name

Source = Union[str, "os.PathLike[str]", Mapping[str, Any], DictConfig]
DEFAULT_SECTION = "loss_fn"
_DEFAULTS_KEY = "defaults"


class RecipeError(ConfigError):
    """A recipe that cannot be read: missing file or section, bad override, cyclic ``defaults``."""


@dataclass(frozen=True)
class LossSpec:
    """What a recipe asks for: the registered loss ``name`` and its validated ``config``.

    ``given``: the keys the section sets (``name`` excluded; empty = every key at its default). ``empty_source``: the
    whole recipe held no key at all (an empty file).
    """

    name: str
    config: ClippedPGLossConfig
    given: tuple[str, ...] = ()
    empty_source: bool = False


# ----------------------------------------------------------------------------------------------- loading


def _load_file(path: Path, seen: tuple[Path, ...] = ()) -> DictConfig:
    path = path.expanduser().resolve()
    if path in seen:
        raise RecipeError(f"cyclic 'defaults' chain: {' -> '.join(str(p) for p in (*seen, path))}")
    if path.is_dir():
        raise RecipeError(f"{path} is a directory; a recipe is a YAML file (e.g. configs/geo_rs_tis.yaml)")
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {path}")
    try:
        cfg = OmegaConf.load(path)
    except UnicodeDecodeError as exc:
        raise RecipeError(f"{path}: not a text file (byte {exc.start} is not UTF-8); a recipe is a YAML file") from None
    except (yaml.YAMLError, OmegaConfBaseException) as exc:  # malformed YAML or interpolation grammar
        raise RecipeError(f"{path}: not a readable YAML recipe: {exc}") from exc
    except OSError as exc:
        raise RecipeError(f"{path}: cannot read ({exc.strerror or exc})") from exc
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


def load_yaml(source: Source, overrides: Sequence[str] = (), section: str = DEFAULT_SECTION) -> DictConfig:
    """An OmegaConf config from a YAML path or a mapping, with ``defaults`` merged and ``overrides`` applied.

    ``section`` is the dotted path of the loss section: overrides inside it must name loss keys (see
    :func:`apply_override`). Interpolations are left unresolved (see :func:`loss_section`).
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
        apply_override(cfg, item, section)
    return cfg


def apply_override(cfg: DictConfig, item: str, section: str = DEFAULT_SECTION) -> None:
    """Apply one Hydra-style override (``key=value``, ``+key=value``, ``++key=value``, ``~key``) to ``cfg`` in place.

    Values are parsed and merged by OmegaConf itself (``merge_with_dotlist``, as its CLI does). An override is an
    explicit instruction, so one that matches nothing is an error naming the nearest valid key: ``key=value`` needs
    an existing key or a loss key of ``section``; inside ``section`` (or at the top of a bare loss-section file) a key
    the file does not hold must be a loss key or ``name``, whatever the prefix.
    """
    text = item.strip()
    mode = "~" if text.startswith("~") else "++" if text.startswith("++") else "+" if text.startswith("+") else ""
    body = text[len(mode) :]
    if mode != "~" and "=" not in body:
        raise RecipeError(f"override {item!r} is not of the form key=value")
    key, _, raw = body.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise RecipeError(f"override {item!r}: {key!r} is not a dotted key")
    key = _relative_to_bare_section(cfg, key, section)
    exists = OmegaConf.select(cfg, key, default=_MISSING, throw_on_resolution_failure=False) is not _MISSING
    loss_leaf = _loss_leaf(cfg, key, section)
    # a key the file already holds may be changed or deleted (a host's extra key); a new one must be a loss key
    if loss_leaf is not None and loss_leaf not in LOSS_KEYS and not exists:
        raise RecipeError(f"override {item!r}: {loss_leaf!r} is not a {section} key{_hint(cfg, key, section)}")
    if mode == "~":
        parent_key, _, leaf = key.rpartition(".")
        parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
        if not isinstance(parent, DictConfig) or leaf not in parent:
            raise RecipeError(f"override {item!r}: cannot delete {key!r}, it does not exist{_hint(cfg, key, section)}")
        del parent[leaf]
        return
    if mode == "" and not exists and loss_leaf is None:
        add = "" if key.rpartition(".")[2] in LOSS_KEYS else f"; use +{key}=... to add a new key"
        raise RecipeError(f"override {item!r} matches no key of the config{_hint(cfg, key, section)}{add}")
    if mode == "+" and exists:
        raise RecipeError(f"override {item!r}: key {key!r} already exists; use {key}=... or ++{key}=... to change it")
    try:
        cfg.merge_with_dotlist([f"{key}={raw}"])
    except OmegaConfBaseException as exc:  # e.g. a value that is not valid YAML / interpolation grammar
        raise RecipeError(f"override {item!r}: {exc}") from exc


_MISSING = object()
# A bare loss section's keys: the config's, its name, and the other hosts' keys every section translates
LOSS_KEYS = frozenset(ClippedPGLossConfig.model_fields) | {NAME_KEY} | set(ADAPTER_TRANSLATED_KEYS)


def _is_bare(cfg: DictConfig, section: str) -> bool:
    missing = OmegaConf.select(cfg, section, default=_MISSING, throw_on_resolution_failure=False) is _MISSING
    return missing and _looks_like_loss_section(cfg)


def _relative_to_bare_section(cfg: DictConfig, key: str, section: str) -> str:
    """In a bare loss-section file, ``loss_fn.ratio_clip_min`` means the top-level ``ratio_clip_min``."""
    if key.startswith(section + ".") and _is_bare(cfg, section):
        return key[len(section) + 1 :]
    return key


def _loss_leaf(cfg: DictConfig, key: str, section: str) -> str | None:
    """The part of ``key`` below the loss section (e.g. ``ratio_clip_min``), or None when ``key`` is outside it."""
    if key.startswith(section + "."):
        return key[len(section) + 1 :]
    if _is_bare(cfg, section):
        return key
    return None


def _leaf_paths(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        out = []
        for k, v in node.items():
            path = f"{prefix}{k}"
            out.append(path)
            out.extend(_leaf_paths(v, path + "."))
        return out
    return []


def _hint(cfg: DictConfig, key: str, section: str) -> str:
    """`` (did you mean 'loss_fn.ratio_clip_max'?)`` for the nearest existing or loss key, or ``""``."""
    root = "" if _is_bare(cfg, section) else section + "."
    leaf = key.rpartition(".")[2]
    inside = _loss_leaf(cfg, key, section)
    if inside is not None:  # only loss keys live in the loss section
        near = difflib.get_close_matches(inside, sorted(LOSS_KEYS), n=1, cutoff=0.6)
        return f" (did you mean {root + near[0]!r}?)" if near else " (the keys are listed in docs/config.md)"
    if leaf in LOSS_KEYS:  # the right key in the wrong place, e.g. without the section prefix
        return f" (did you mean {root + leaf!r}?)"
    ancestors = {key.rsplit(".", n)[0] for n in range(1, key.count(".") + 1)}
    existing = set(_leaf_paths(OmegaConf.to_container(cfg, resolve=False))) - ancestors
    candidates = sorted(existing | {root + k for k in LOSS_KEYS})
    near = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    if not near:  # compare the last component alone, e.g. a misspelt loss key under a deep section path
        by_leaf = {c.rpartition(".")[2]: c for c in candidates}
        leaf_near = difflib.get_close_matches(leaf, sorted(by_leaf), n=1, cutoff=0.6)
        near = [by_leaf[leaf_near[0]]] if leaf_near else []
    return f" (did you mean {near[0]!r}?)" if near else ""


# ----------------------------------------------------------------------------------------------- sections


def _looks_like_loss_section(cfg: DictConfig) -> bool:
    keys = {str(k) for k in cfg.keys()}  # an empty mapping is an empty section: every default
    return keys <= LOSS_KEYS


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


def load_loss_spec(
    source: Source, overrides: Sequence[str] = (), section: str = DEFAULT_SECTION, default_name: str = DEFAULT_LOSS_NAME
) -> LossSpec:
    """Read ``section`` of a recipe (YAML path, mapping or DictConfig) into a :class:`LossSpec`."""
    cfg = load_yaml(source, overrides, section)
    where = f"{source}" if isinstance(source, (str, os.PathLike)) else "config"
    try:
        name, values = split_name(loss_section(cfg, section), default_name)
        check_loss_name(name)
    except (TypeError, UnknownLossError) as exc:
        raise RecipeError(f"{where}: invalid {section!r} section: {exc}") from exc
    try:
        if name == DEFAULT_LOSS_NAME:  # verl's rollout_correction applied, as in every host's section
            values = applied_other_hosts_keys(values, "NeMo-RL")
        config = ClippedPGLossConfig(**values)
    except (ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
        raise RecipeError(f"{where}: invalid {section!r} section: {exc}") from exc
    return LossSpec(name=name, config=config, given=tuple(values), empty_source=len(cfg) == 0)


def load_recipe_config(
    source: Source, overrides: Sequence[str] = (), section: str = DEFAULT_SECTION
) -> ClippedPGLossConfig:
    """The validated loss config of a recipe (a YAML path, mapping or DictConfig); ``name`` is ignored (see
    :func:`load_loss_spec`). :func:`~nemo_is_plugin.loss.config_model.load_loss_config` validates a ``loss_fn``
    mapping alone."""
    return load_loss_spec(source, overrides, section).config


def to_loss_mapping(
    source: Source | None, overrides: Sequence[str] = (), section: str = DEFAULT_SECTION
) -> dict[str, Any]:
    """A plain ``loss_fn`` mapping (``name`` kept) from a recipe, for hosts that validate it themselves."""
    if source is None:
        return {}
    return loss_section(load_yaml(source, overrides, section), section)
