"""Fuzzing the config parser: any mapping either validates or raises a pydantic ValidationError that names a field
it was given; a valid config survives a dump/reload; malformed YAML recipes give the recipe module's error."""

from __future__ import annotations

import math
import re
import string
from pathlib import Path
from typing import Any

import pytest
from helpers.config_cases import ACTIVATING_KEYS, BUILTIN_FIELDS
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from nemo_is_plugin.config import ConfigError, UnknownConfigKeyWarning
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig, load_loss_config

FIELDS = sorted(BUILTIN_FIELDS)  # this package's keys (an installed objective's are its own tests')
_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])

# values a YAML file can hold, biased towards the ones that mean something to the config
_LITERALS = [
    "token",
    "sequence",
    "sequence_mean",
    "cumulative",
    "sequence_token",
    "cumulative_mean",
    "tis",
    "icepop",
    "seq-mask-tis",
    "seq-mis",
    "geo-rs",
    "k1",
    "k2",
    "k3",
    "k4",
    "estimator",
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "",
]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.sampled_from([0.0, 1e-4, 0.2, 0.5, 0.999, 1.0, 1.001, 2.0, 5.0, 10.0, -0.2, 1e30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(_LITERALS),
    st.text(max_size=8),
)
values = st.one_of(scalars, st.lists(scalars, max_size=3), st.dictionaries(st.text(max_size=4), scalars, max_size=2))
configs = st.dictionaries(st.sampled_from(FIELDS), values, max_size=8)


def _provided_key_named(exc: ValidationError, given: dict[str, Any]) -> bool:
    """Every error of ``exc`` names at least one key the caller gave (in its location or its message)."""
    for err in exc.errors():
        loc = {str(part) for part in err["loc"]}
        if not (loc & set(given) or any(k in err["msg"] for k in given)):
            return False
    return True


@settings(max_examples=1500, **_SETTINGS)
@given(raw=configs)
def test_any_mapping_validates_or_names_a_given_field(raw):
    try:
        cfg = ClippedPGLossConfig(**raw)
    except ValidationError as exc:
        assert _provided_key_named(exc, raw), (raw, exc.errors())
        return
    # a valid config answers its derived questions and reloads from its non-default keys
    assert cfg.effective_ratio_level and cfg.effective_is_level and cfg.effective_loss_aggregation
    assert ClippedPGLossConfig(**cfg.model_dump(exclude_defaults=True)) == cfg


@settings(max_examples=300, **_SETTINGS)
@given(raw=configs, bad=st.text(alphabet=string.ascii_lowercase + "_", min_size=1, max_size=30))
def test_unknown_keys_are_named(raw, bad):
    """Strict mode refuses an unknown key by name; the default warns by name and validates the rest unchanged."""
    if bad in FIELDS:
        return
    with pytest.raises(ValidationError) as err:
        ClippedPGLossConfig.model_validate({**raw, bad: 1}, context={"strict_keys": True})
    assert f"'{bad}'" in str(err.value)
    try:
        want = ClippedPGLossConfig(**raw)
    except ValidationError:
        return
    with pytest.warns(UnknownConfigKeyWarning, match=f"'{bad}'"):
        assert ClippedPGLossConfig(**{**raw, bad: 1}) == want


def test_unknown_key_suggests_the_near_field():
    with pytest.raises(ValidationError, match=r"'is_correction_levl' \(did you mean 'is_correction_level'\?\)"):
        load_loss_config({"is_correction_levl": "token"}, strict=True)
    with pytest.warns(UnknownConfigKeyWarning, match=r"'is_correction_levl' \(did you mean 'is_correction_level'\?\)"):
        ClippedPGLossConfig(is_correction_levl="token")


@pytest.mark.parametrize("bad", [None, 3, "loss_fn", [("ratio_clip_min", 0.1), 7]])
def test_load_loss_config_rejects_non_mappings(bad):
    with pytest.raises((ConfigError, ValidationError)):
        load_loss_config(bad)


# ------------------------------------------------------------------------------------ non-finite hyper-parameters


def test_every_numeric_field_is_covered():
    fields = ClippedPGLossConfig.model_fields
    numeric = {n for n in BUILTIN_FIELDS if re.search(r"\b(float|int)\b", str(fields[n].annotation))}
    assert numeric == set(ACTIVATING_KEYS)


@pytest.mark.parametrize(
    "field",
    sorted(ACTIVATING_KEYS),
)
def test_nan_hyper_parameters_are_rejected_naming_the_field(field):
    with pytest.raises(ValidationError) as err:
        ClippedPGLossConfig(**ACTIVATING_KEYS[field], **{field: math.nan})
    assert field in str(err.value)


def test_full_dump_reloads():
    cfg = ClippedPGLossConfig(loss_aggregation="seq-mean-token-mean")
    assert ClippedPGLossConfig(**cfg.model_dump()) == cfg


# ------------------------------------------------------------------------------------------------ YAML recipes
_YAML_CHARS = string.ascii_letters + string.digits + " :-_.,[]{}#'\"\n\t$&*!|>%@`?="


@settings(max_examples=300, **_SETTINGS)
@given(text=st.text(alphabet=_YAML_CHARS, max_size=80))
@example(text="ratio_clip_min: [1, 2\n")  # the concrete reproduction: yaml.parser.ParserError escapes
def test_malformed_yaml_recipe_gives_a_recipe_error(tmp_path_factory, text):
    from nemo_is_plugin.adapters.recipes import load_recipe_config as load_recipe

    path: Path = tmp_path_factory.mktemp("recipe") / "r.yaml"
    path.write_text("loss_fn:\n  " + text)
    try:
        load_recipe(path)
    except (ConfigError, ValidationError):  # RecipeError is a ConfigError; both are ValueErrors naming the problem
        pass
