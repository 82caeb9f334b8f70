"""ClippedPGLossConfig: NeMo-RL compatibility, derived levels, and every contradiction rejected with a fix."""

from pathlib import Path

import pydantic
import pytest
from omegaconf import OmegaConf

from nemo_is_plugin.config import STRICT_KEYS_ENV, ConfigError, ConfigValidationError, UnknownConfigKeyWarning
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig, load_loss_config

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))

NEMO_RL_DEFAULTS = {
    "reference_policy_kl_penalty": 0.01,
    "reference_policy_kl_type": "k3",
    "kl_input_clamp_value": 20.0,
    "kl_output_clamp_value": 10.0,
    "ratio_clip_min": 0.2,
    "ratio_clip_max": 0.2,
    "ratio_clip_c": None,
    "use_on_policy_kl_approximation": False,
    "use_importance_sampling_correction": False,
    "truncated_importance_sampling_type": None,
    "truncated_importance_sampling_ratio": None,
    "truncated_importance_sampling_ratio_min": None,
    "token_level_loss": True,
    "sequence_level_importance_ratios": False,
    "force_on_policy_ratio": False,
    "use_kl_in_reward": False,
    "disable_ppo_ratio": False,
    "use_cispo": False,
    "positive_example_nll_weight": 0.0,
}


def test_nemo_rl_keys_and_defaults():
    cfg = ClippedPGLossConfig()
    assert {k: getattr(cfg, k) for k in NEMO_RL_DEFAULTS} == NEMO_RL_DEFAULTS
    assert ClippedPGLossConfig(**NEMO_RL_DEFAULTS).effective_ratio_level == "token"


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_recipes_validate(path):
    section = OmegaConf.to_container(OmegaConf.load(path)["loss_fn"], resolve=True)
    ClippedPGLossConfig(**section)


def test_derived_levels_follow_nemo_rl():
    gspo = ClippedPGLossConfig(sequence_level_importance_ratios=True, token_level_loss=False)
    assert (gspo.effective_ratio_level, gspo.effective_is_level) == ("sequence", "sequence")
    assert gspo.effective_loss_aggregation == "seq-mean-token-mean"
    decoupled = ClippedPGLossConfig(
        sequence_level_importance_ratios=True,
        token_level_loss=False,
        is_correction_level="sequence_mean",
        use_importance_sampling_correction=True,
    )
    assert (decoupled.effective_ratio_level, decoupled.effective_is_level) == ("sequence", "sequence_mean")
    assert ClippedPGLossConfig(use_kl_in_reward=True).effective_kl_penalty == 0.0


def test_unknown_key_warns_naming_nearest_and_is_ignored():
    """NeMo-RL's config model allows extra keys: an unknown key warns (naming the nearest field) and is dropped."""
    with pytest.warns(UnknownConfigKeyWarning, match=r"'is_corection_level' \(did you mean 'is_correction_level'\?\)"):
        cfg = ClippedPGLossConfig(is_corection_level="token", ratio_clip_max=0.3)
    assert cfg == ClippedPGLossConfig(ratio_clip_max=0.3)


def test_unknown_key_is_an_error_in_strict_mode(monkeypatch):
    with pytest.raises(ConfigValidationError, match="did you mean 'is_correction_level'"):
        load_loss_config({"is_corection_level": "token"}, strict=True)
    with pytest.raises(ConfigValidationError, match=r"unknown loss_fn key\(s\): 'foo'"):
        ClippedPGLossConfig.model_validate({"foo": 1}, context={"strict_keys": True})
    monkeypatch.setenv(STRICT_KEYS_ENV, "1")
    with pytest.raises(ConfigValidationError, match="'foo'"):
        ClippedPGLossConfig(foo=1)
    with pytest.warns(UnknownConfigKeyWarning):  # an explicit strict=False wins over the environment
        load_loss_config({"foo": 1}, strict=False)


def test_unknown_key_in_a_mapping_of_any_kind_follows_the_same_policy():
    """A DictConfig handed to model_validate warns about an unknown key like a dict (strict: refuses it)."""
    section = OmegaConf.create({"ratio_clip_max": 0.3, "is_corection_level": "token"})
    with pytest.warns(UnknownConfigKeyWarning, match="did you mean 'is_correction_level'"):
        assert ClippedPGLossConfig.model_validate(section) == ClippedPGLossConfig(ratio_clip_max=0.3)
    with pytest.raises(ConfigValidationError, match="did you mean 'is_correction_level'"):
        ClippedPGLossConfig.model_validate(section, context={"strict_keys": True})


def test_assigning_an_unknown_key_is_refused_naming_the_nearest():
    cfg = ClippedPGLossConfig()
    with pytest.raises(ConfigValidationError, match=r"'ratio_clip_mn' \(did you mean 'ratio_clip_min'\?\)") as err:
        cfg.ratio_clip_mn = 0.1
    assert err.value.errors()[0]["loc"] == ("ratio_clip_mn",)
    assert cfg == ClippedPGLossConfig() and not hasattr(cfg, "ratio_clip_mn")


def test_config_errors_are_validation_value_and_assertion_errors():
    """One exception type: pydantic's ValidationError (field-naming message), a ValueError / ConfigError, and the
    AssertionError NeMo-RL raises for invalid combinations; from the model, load_loss_config and assignment."""
    bad = {"use_cispo": True, "disable_ppo_ratio": True}
    for make in (
        lambda: ClippedPGLossConfig(**bad),
        lambda: load_loss_config(bad),
        lambda: setattr(ClippedPGLossConfig(), "ratio_clip_c", 0.5),
    ):
        with pytest.raises(AssertionError) as err:
            make()
        assert isinstance(err.value, (ConfigValidationError, pydantic.ValidationError, ValueError, ConfigError))
        assert err.value.errors() and ("use_cispo" in str(err.value) or "ratio_clip_c" in str(err.value))


@pytest.mark.parametrize(
    "kwargs, fields",
    [
        ({"log_ratio_clip_low": 0.02}, ["log_ratio_clip_low", "log_ratio_clip_high"]),
        ({"clip_position_power": 0.5}, ["clip_position_power", "log_ratio_clip_low"]),
        ({"log_ratio_clip_low": 0.02, "log_ratio_clip_high": 0.05, "ratio_clip_c": 3.0}, ["ratio_clip_c"]),
        ({"log_ratio_clip_c": 0.05}, ["log_ratio_clip_c"]),
        ({"is_correction_level": "sequence_mean"}, ["use_importance_sampling_correction"]),
        ({"importance_sampling_batch_normalize": True}, ["importance_sampling_batch_normalize"]),
        ({"loss_aggregation": "seq-mean-token-sum-norm"}, ["loss_aggregation_norm"]),
        ({"loss_aggregation_norm": 100.0}, ["loss_aggregation_norm"]),
        ({"loss_aggregation": "seq-mean-token-mean", "token_level_loss": True}, ["token_level_loss"]),
        ({"reference_policy_kl_gradient": "k2", "reference_policy_kl_penalty": 0.0}, ["reference_policy_kl_penalty"]),
        ({"use_cispo": True, "ratio_level": "cumulative"}, ["ratio_level"]),
        ({"disable_ppo_ratio": True, "ratio_level": "sequence"}, ["ratio_level"]),
        (
            {"truncated_importance_sampling_type": "geo-rs", "truncated_importance_sampling_ratio": 1.001},
            ["truncated_importance_sampling_ratio_min"],
        ),
        (
            {
                "use_importance_sampling_correction": True,
                "is_correction_level": "cumulative",
                "truncated_importance_sampling_type": "seq-mask-tis",
                "truncated_importance_sampling_ratio": 2.0,
                "truncated_importance_sampling_ratio_min": 0.5,
            },
            ["is_correction_level"],
        ),
        ({"importance_sampling_veto_threshold": 1.5}, ["importance_sampling_veto_threshold"]),
        (
            {"importance_sampling_rejection": "geo-rs", "importance_sampling_rejection_max": 1.001},
            ["importance_sampling_rejection_min"],
        ),
        (
            {"importance_sampling_rejection_min": 0.5, "importance_sampling_rejection_max": 2.0},
            ["importance_sampling_rejection"],
        ),
        (
            {
                "importance_sampling_rejection": "seq-mis",
                "importance_sampling_rejection_min": 2.0,
                "importance_sampling_rejection_max": 0.5,
            },
            ["importance_sampling_rejection_min"],
        ),
        (
            {
                "importance_sampling_rejection": "bogus",
                "importance_sampling_rejection_min": 0.5,
                "importance_sampling_rejection_max": 2.0,
            },
            ["importance_sampling_rejection"],
        ),
        (
            {
                "importance_sampling_rejection": "geo-rs",
                "importance_sampling_rejection_min": 0.999,
                "importance_sampling_rejection_max": 1.001,
                "truncated_importance_sampling_type": "seq-mis",
                "truncated_importance_sampling_ratio": 2.0,
                "truncated_importance_sampling_ratio_min": 0.5,
            },
            ["truncated_importance_sampling_type", "importance_sampling_rejection"],
        ),
        ({"log_ratio_clip_low": -0.1, "log_ratio_clip_high": 0.05}, ["log_ratio_clip_low"]),
        ({"truncated_importance_sampling_ratio": 2.0}, ["truncated_importance_sampling_type"]),  # NeMo-RL: at call
    ],
)
def test_contradictions_rejected_naming_fields(kwargs, fields):
    with pytest.raises(pydantic.ValidationError) as err:
        ClippedPGLossConfig(**kwargs)
    for field in fields:
        assert field in str(err.value)


def test_rejection_types_run_without_is_weights():
    cfg = ClippedPGLossConfig(
        truncated_importance_sampling_type="geo-rs",
        truncated_importance_sampling_ratio_min=0.999,
        truncated_importance_sampling_ratio=1.001,
    )
    assert not cfg.use_importance_sampling_correction


def test_rejection_field_combines_with_token_truncation_and_runs_without_is_weights():
    tis_geo = ClippedPGLossConfig(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="tis",
        truncated_importance_sampling_ratio=2.0,
        importance_sampling_rejection="geo-rs",
        importance_sampling_rejection_min=0.999,
        importance_sampling_rejection_max=1.001,
    )
    assert tis_geo.importance_sampling_rejection == "geo-rs"
    alone = ClippedPGLossConfig(
        importance_sampling_rejection="seq-mis",
        importance_sampling_rejection_min=0.5,
        importance_sampling_rejection_max=2.0,
        is_correction_level="token",
    )
    assert not alone.use_importance_sampling_correction


def test_lone_truncation_min_is_ignored_with_a_warning_as_nemo_rl_ignores_it():
    with pytest.warns(UserWarning, match="truncated_importance_sampling_ratio_min is ignored"):
        cfg = ClippedPGLossConfig(truncated_importance_sampling_ratio_min=0.5)
    assert cfg.truncated_importance_sampling_type is None
