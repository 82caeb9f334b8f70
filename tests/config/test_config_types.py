"""A setting of the wrong type (a boolean for a number, as verl's ``rollout_is_threshold: true``) is refused with an
error that is also a TypeError and names the key; wrong values stay plain ValueErrors; the lax conversions NeMo-RL
configs rely on (numeric strings, ints) still validate."""

from __future__ import annotations

import pydantic
import pytest
from helpers.config_cases import ACTIVATING_KEYS, BUILTIN_RANGES

from nemo_is_plugin.adapters.verl.config import VerlConfigError, plugin_section_keys, rollout_correction_keys
from nemo_is_plugin.config import ConfigError, ConfigValidationError, ConfigValidationTypeError
from nemo_is_plugin.loss.config_model import NUMERIC_RANGES, ClippedPGLossConfig


def _error(make) -> Exception:
    with pytest.raises(Exception) as err:  # noqa: PT011 -- the exact types are asserted below
        make()
    return err.value


def _is_config_type_error(exc: Exception) -> bool:
    """A TypeError that every existing handler of an invalid config still catches."""
    kinds = (ConfigValidationTypeError, TypeError, ValueError, AssertionError, pydantic.ValidationError, ConfigError)
    return all(isinstance(exc, kind) for kind in kinds)


@pytest.mark.parametrize("key", sorted(BUILTIN_RANGES))
@pytest.mark.parametrize("flag", [True, False])
def test_a_boolean_for_a_numeric_key_is_a_type_error_naming_the_key(key, flag):
    exc = _error(lambda: ClippedPGLossConfig(**ACTIVATING_KEYS[key], **{key: flag}))
    assert _is_config_type_error(exc), type(exc).__mro__
    (error,) = exc.errors()
    assert error["loc"] == (key,) and error["type"] == "number_type"
    text = str(exc)
    assert key in text and NUMERIC_RANGES[key].interval() in text and NUMERIC_RANGES[key].fix in text


def test_a_boolean_assigned_to_a_numeric_key_is_a_type_error():
    cfg = ClippedPGLossConfig()
    exc = _error(lambda: setattr(cfg, "ratio_clip_min", True))
    assert _is_config_type_error(exc) and "ratio_clip_min" in str(exc)
    assert cfg.ratio_clip_min == 0.2  # unchanged


def test_a_boolean_in_a_rejection_rule_is_a_type_error_naming_its_place():
    rule = {"statistic": "k3", "aggregation": "token", "max": True}
    exc = _error(lambda: ClippedPGLossConfig(importance_sampling_rejection_rules=[rule]))
    assert _is_config_type_error(exc)
    assert "importance_sampling_rejection_rules.0.max" in str(exc) and "not a boolean" in str(exc)
    exc = _error(lambda: ClippedPGLossConfig(importance_sampling_rejection_rules=["seq_mean_k1"]))
    assert _is_config_type_error(exc) and "has no bounds" in str(exc)  # a string where a mapping belongs


def test_one_type_error_among_value_errors_makes_the_whole_error_a_type_error():
    exc = _error(lambda: ClippedPGLossConfig(ratio_clip_min=True, ratio_clip_max=-1.0))
    assert _is_config_type_error(exc)
    assert {e["loc"] for e in exc.errors()} == {("ratio_clip_min",), ("ratio_clip_max",)}
    assert "ratio_clip_max=-1 is outside its valid range [0, inf)" in str(exc)


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"ratio_clip_min": 1.5}, "ratio_clip_min"),  # out of range
        ({"reference_policy_kl_type": "k4"}, "reference_policy_kl_type"),  # not a choice
        ({"truncated_importance_sampling_type": "clip"}, "truncated_importance_sampling_type"),
        ({"use_cispo": True, "disable_ppo_ratio": True}, "use_cispo"),  # a contradiction
    ],
)
def test_wrong_values_are_not_type_errors(kwargs, key):
    exc = _error(lambda: ClippedPGLossConfig(**kwargs))
    assert isinstance(exc, ConfigValidationError) and not isinstance(exc, TypeError)
    assert key in str(exc)


@pytest.mark.parametrize("text", ["abc", ""])
def test_an_unparseable_number_is_a_type_error(text):
    exc = _error(lambda: ClippedPGLossConfig(ratio_clip_max=text))
    assert _is_config_type_error(exc) and exc.errors()[0]["type"] == "float_parsing"


def test_lax_numbers_nemo_rl_configs_use_still_validate():
    """YAML 1.1 reads 1e-4 as a string and YAML ints stay ints: both are numbers here, as in NeMo-RL's pydantic."""
    cfg = ClippedPGLossConfig(ratio_clip_c=3, importance_sampling_veto_threshold="1e-4", ratio_clip_max="0.28")
    assert (cfg.ratio_clip_c, cfg.importance_sampling_veto_threshold, cfg.ratio_clip_max) == (3.0, 1e-4, 0.28)
    assert ClippedPGLossConfig(token_level_loss="false", loss_aggregation_norm=None).token_level_loss is False


@pytest.mark.parametrize(
    "make",
    [
        lambda: rollout_correction_keys({"rollout_is": "token", "rollout_is_threshold": True}),
        lambda: plugin_section_keys({"rollout_correction": {"rollout_is": "sequence", "rollout_is_threshold": False}}),
        lambda: rollout_correction_keys({"rollout_is": "token", "rollout_is_threshold": [2.0]}),
    ],
)
def test_verl_rollout_is_threshold_of_the_wrong_type_is_a_type_error(make):
    exc = _error(make)
    assert isinstance(exc, TypeError) and isinstance(exc, VerlConfigError) and isinstance(exc, ValueError)
    assert "rollout_is_threshold must be a number or a 'lower_upper' string" in str(exc)


def test_verl_rollout_rs_of_the_wrong_type_is_a_type_error():
    exc = _error(lambda: rollout_correction_keys({"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": True}))
    assert isinstance(exc, TypeError) and isinstance(exc, ConfigError) and "rollout_rs_threshold" in str(exc)
    exc = _error(lambda: rollout_correction_keys({"rollout_rs": 3, "rollout_rs_threshold": 1.0}))
    assert isinstance(exc, TypeError) and isinstance(exc, VerlConfigError) and "rollout_rs must be" in str(exc)


def test_verl_wrong_values_are_not_type_errors():
    exc = _error(lambda: rollout_correction_keys({"rollout_is": "token", "rollout_is_threshold": "2_1"}))
    assert isinstance(exc, VerlConfigError) and not isinstance(exc, TypeError)
