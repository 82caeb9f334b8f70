"""The config's rejection rules, verl's rollout_rs forms as aliases, old_policy_logprobs and token-sum: what validates,
what is refused (naming the field and the fix), and what the shorthands resolve to."""

import math

import pydantic
import pytest

from nemo_is_plugin.config import VERL_RS_OPTIONS, RejectionRule, verl_rejection_rule
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig


def test_verl_options_are_the_eleven_of_verl():
    assert sorted(VERL_RS_OPTIONS) == sorted(
        [
            "token_k1",
            "token_k2",
            "token_k3",
            "seq_sum_k1",
            "seq_sum_k2",
            "seq_sum_k3",
            "seq_mean_k1",
            "seq_mean_k2",
            "seq_mean_k3",
            "seq_max_k2",
            "seq_max_k3",
        ]
    )


@pytest.mark.parametrize(
    "option, threshold, want",
    [
        (
            "seq_mean_k1",
            "0.999_1.001",
            dict(statistic="k1", aggregation="sequence_mean", min=math.log(0.999), max=math.log(1.001)),
        ),
        ("token_k1", 2.0, dict(statistic="k1", aggregation="token", min=math.log(0.5), max=math.log(2.0))),
        ("token_k1", "2", dict(statistic="k1", aggregation="token", min=math.log(0.5), max=math.log(2.0))),
        ("seq_max_k3", 0.3, dict(statistic="k3", aggregation="sequence_max", max=0.3)),
        ("seq_sum_k2", "0.5", dict(statistic="k2", aggregation="sequence_sum", max=0.5)),
    ],
)
def test_verl_form_parses_as_verl_does(option, threshold, want):
    assert verl_rejection_rule(option, threshold) == want
    rule = RejectionRule(option=option, threshold=threshold)
    assert rule.verl_option == option and rule.log_ratio_clamp == 20.0
    assert rule == RejectionRule(**want)


@pytest.mark.parametrize(
    "rule, match",
    [
        ({"option": "token_k2", "threshold": "0.5_2.0"}, "single upper bound without '_'"),
        ({"option": "seq_max_k1", "threshold": 2.0}, "not one of verl's"),
        ({"option": "seq_mean_k1", "threshold": "1.2_0.8"}, "lower <= upper"),
        ({"option": "seq_mean_k3", "threshold": None}, "needs a numeric rollout_rs_threshold"),
        ({"option": "seq_mean_k3", "threshold": -1}, "finite positive"),
        ({"statistic": "k2", "aggregation": "token", "min": 0.0, "max": 1.0}, "only max bounds it; unset min"),
        ({"statistic": "k3", "aggregation": "token"}, "needs max"),
        ({"statistic": "k1", "aggregation": "token", "min": 0.2, "max": 0.1}, "min=0.2 must be <= max=0.1"),
        ({"statistic": "k3", "aggregation": "token", "max": 0.0}, "must be > 0"),
        ({"statistic": "k4", "aggregation": "token", "max": 1.0}, "statistic"),
        ("seq_mean_k1", "has no bounds"),
    ],
)
def test_bad_rules_are_refused_naming_the_fix(rule, match):
    with pytest.raises(pydantic.ValidationError, match=match):
        ClippedPGLossConfig(importance_sampling_rejection_rules=[rule])


def test_plugin_only_rules_exist_but_have_no_verl_name():
    assert RejectionRule(statistic="k1", aggregation="sequence_max", max=0.5).verl_option is None  # no seq_max_k1
    assert RejectionRule(statistic="k3", aggregation="token", max=0.5, log_ratio_clamp=None).verl_option is None


def test_shorthand_resolves_to_a_k1_rule_first():
    cfg = ClippedPGLossConfig(
        importance_sampling_rejection="geo-rs",
        importance_sampling_rejection_min=0.999,
        importance_sampling_rejection_max=1.001,
        importance_sampling_rejection_rules=[{"option": "seq_max_k2", "threshold": 2.0}],
    )
    shorthand, listed = cfg.rejection_rules
    assert (shorthand.statistic, shorthand.aggregation, shorthand.log_ratio_clamp) == ("k1", "sequence_mean", None)
    assert (shorthand.min, shorthand.max) == (-math.log(1.001), -math.log(0.999))
    assert listed.verl_option == "seq_max_k2"
    assert ClippedPGLossConfig(**cfg.model_dump()) == cfg  # round trip


def test_duplicate_rules_and_conflicting_old_policies_are_refused():
    with pytest.raises(
        pydantic.ValidationError,
        match="two rejection rules on sequence_sum_k1 "
        r"\(importance_sampling_rejection is one\)",
    ):
        ClippedPGLossConfig(
            importance_sampling_rejection="seq-mis",
            importance_sampling_rejection_min=0.5,
            importance_sampling_rejection_max=2.0,
            importance_sampling_rejection_rules=[{"option": "seq_sum_k1", "threshold": 3.0}],
        )
    with pytest.raises(pydantic.ValidationError, match="both choose pi_old; keep one"):
        ClippedPGLossConfig(old_policy_logprobs="generation", force_on_policy_ratio=True)


def test_rules_run_without_is_weights_and_token_sum_is_token_level():
    cfg = ClippedPGLossConfig(
        importance_sampling_rejection_rules=[{"option": "token_k3", "threshold": 0.1}], is_correction_level="token"
    )
    assert not cfg.use_importance_sampling_correction and len(cfg.rejection_rules) == 1
    assert ClippedPGLossConfig(loss_aggregation="token-sum").token_level_loss
    with pytest.raises(pydantic.ValidationError, match="contradicts token_level_loss"):
        ClippedPGLossConfig(loss_aggregation="token-sum", token_level_loss=False)


def test_verl_aggregation_names_are_aliases():
    rule = RejectionRule(statistic="k3", aggregation="seq_mean", max=0.01)
    assert rule.aggregation == "sequence_mean" and rule.verl_option == "seq_mean_k3"
