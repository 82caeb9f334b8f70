"""slime's flags -> plugin keys (mapped or refused, never ignored), the config sources, and loud failures on the worker
(a missing or invalid plugin config raises at the first call)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from helpers.golden_utils import GOLDEN

from adapters.slime_host import loss_function, namespace, tis_call
from nemo_is_plugin.adapters.slime import SlimeISCorrection, SlimePolicyLoss
from nemo_is_plugin.adapters.slime.config import (
    CONFIG_ENV,
    LOSS_FLAGS,
    MissingPluginConfigError,
    SlimeConfigError,
    policy_config,
    slime_kl,
    tis_config,
)
from nemo_is_plugin.config import ConfigError

CASE = torch.load(sorted((GOLDEN / "slime" / "policy").glob("case_*.pt"))[0], weights_only=True)
TIS_CASE = torch.load(sorted((GOLDEN / "slime" / "tis").glob("case_*.pt"))[0], weights_only=True)
DOCS = Path(__file__).resolve().parents[2] / "docs" / "slime.md"


def args(**flags) -> argparse.Namespace:
    return namespace(CASE["args"], **flags)


def call_policy(a: argparse.Namespace):
    return loss_function(
        SlimePolicyLoss(),
        a,
        CASE["batch"],
        CASE["logits"].clone().requires_grad_(True),
        num_microbatches=2,
        step_global_batch_size=8,
    )


def test_clip_flags_map_onto_the_ratio_clip():
    cfg = policy_config(args(eps_clip=0.1, eps_clip_high=0.3, eps_clip_c=2.5), {})
    assert (cfg.ratio_clip_min, cfg.ratio_clip_max, cfg.ratio_clip_c) == (0.1, 0.3, 2.5)
    assert cfg.effective_kl_penalty == 0 and cfg.effective_ratio_level == "token"
    assert not cfg.use_importance_sampling_correction


@pytest.mark.parametrize(
    ("flags", "field", "value"),
    [
        ({"advantage_estimator": "gspo"}, "ratio_level", "sequence"),
        ({"advantage_estimator": "cispo", "eps_clip": 1.0}, "policy_objective", "cispo"),
        ({"use_rollout_logprobs": True}, "old_policy_logprobs", "generation"),
        ({"use_tis": True, "tis_clip": 3.0}, "truncated_importance_sampling_ratio", 3.0),
        ({"get_mismatch_metrics": True}, "use_importance_sampling_correction", True),
        (
            {"use_tis": True, "custom_tis_function_path": "slime.backends.megatron_utils.loss.icepop_function"},
            "truncated_importance_sampling_type",
            "icepop",
        ),
    ],
)
def test_loss_flags_are_mapped(flags, field, value):
    assert getattr(policy_config(args(**flags), {}), field) == value


def test_cispo_ignores_the_dual_clip_as_slime_does_and_says_so():
    with pytest.warns(UserWarning, match="eps-clip-c"):
        cfg = policy_config(args(advantage_estimator="cispo", eps_clip=1.0, eps_clip_c=3.0), {})
    assert cfg.ratio_clip_c is None


def test_the_cispo_estimator_and_another_policy_objective_are_refused():
    """slime's --advantage-estimator cispo writes policy_objective: cispo; a user key naming another objective is not
    overridden silently either way."""
    with pytest.raises(SlimeConfigError, match="--advantage-estimator cispo and policy_objective='sapo'"):
        policy_config(args(advantage_estimator="cispo", eps_clip=1.0), {"policy_objective": "sapo"})
    cfg = policy_config(args(advantage_estimator="cispo", eps_clip=1.0), {"policy_objective": "cispo"})
    assert cfg.effective_objective == "cispo" and cfg.objective_switch is None


@pytest.mark.parametrize(
    ("name", "kept"),
    [("cispo", (0.1, 0.3, None)), ("reinforce", (0.2, 0.2, 2.5)), ("dro", (0.2, 0.2, None))],
)
def test_a_named_objective_keeps_the_clip_flags_it_reads(name, kept):
    """--eps-clip / --eps-clip-high are CISPO's band; --eps-clip-c is REINFORCE's dual clip; DRO reads none."""
    user = {"policy_objective": name, **({"dro_beta": 0.1} if name == "dro" else {})}
    cfg = policy_config(args(eps_clip=0.1, eps_clip_high=0.3, eps_clip_c=2.5), user)
    assert cfg.effective_objective == name
    assert (cfg.ratio_clip_min, cfg.ratio_clip_max, cfg.ratio_clip_c) == kept  # left out: the keys' defaults


def test_kl_flags():
    assert slime_kl(args()) is None
    kl = slime_kl(args(use_kl_loss=True, kl_loss_coef=0.3, kl_loss_type="low_var_kl", use_unbiased_kl=True))
    assert kl == {"coef": 0.3, "kl_type": "k3", "output_clamp": 10.0, "unbiased": True}


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        ({"use_opsm": True}, "--use-opsm"),
        ({"custom_pg_loss_reducer_function_path": "my.reducer"}, "--custom-pg-loss-reducer-function-path"),
        ({"allgather_cp": True}, "--allgather-cp"),
        ({"rollout_top_p": 0.9}, "--rollout-top-p"),
        ({"advantage_estimator": "sapo"}, "--advantage-estimator"),
        ({"kl_loss_type": "k4"}, "--kl-loss-type"),
        ({"use_tis": True, "custom_tis_function_path": "examples.mis.compute_mis_weights_with_cp"}, "custom-tis"),
    ],
)
def test_flags_the_plugin_cannot_honour_are_refused(flags, match):
    with pytest.raises(SlimeConfigError, match=match):
        policy_config(args(**flags), {})


@pytest.mark.parametrize(
    ("keys", "match"),
    [
        ({"loss_aggregation": "token-mean"}, "reducer"),
        ({"token_level_loss": False}, "reducer"),
        ({"positive_example_nll_weight": 0.1}, "rewards"),
        ({"use_kl_in_reward": True}, "kl-coef"),
    ],
)
def test_plugin_keys_slime_owns_are_refused(keys, match):
    with pytest.raises(SlimeConfigError, match=match):
        policy_config(args(), keys)


def test_two_kl_terms_are_refused():
    with pytest.raises(SlimeConfigError, match="two KL terms"):
        policy_config(args(use_kl_loss=True, kl_loss_coef=0.1), {"reference_policy_kl_penalty": 0.05})


def test_user_is_keys_overlay_slimes_tis_flags():
    cfg = policy_config(args(use_tis=True), {"is_correction_level": "cumulative"})
    assert cfg.is_correction_level == "cumulative" and cfg.truncated_importance_sampling_ratio == 2.0
    # a sequence-masking type does not inherit slime's tis bounds: its own band is required
    with pytest.raises(ConfigError, match="truncated_importance_sampling_ratio"):
        tis_config(args(), {"truncated_importance_sampling_type": "geo-rs"})
    cfg = tis_config(
        args(),
        {
            "truncated_importance_sampling_type": "geo-rs",
            "truncated_importance_sampling_ratio": 1.01,
            "truncated_importance_sampling_ratio_min": 0.99,
        },
    )
    assert cfg.truncated_importance_sampling_ratio_min == 0.99


def test_tis_function_refuses_keys_of_the_ppo_loss():
    with pytest.raises(SlimeConfigError, match="not IS-correction keys"):
        tis_config(args(), {"ratio_level": "sequence"})


def test_missing_plugin_config_fails_loudly_on_the_worker(monkeypatch):
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    no_config = argparse.Namespace(**{k: v for k, v in vars(args()).items() if k != "nemo_is"})
    with pytest.raises(MissingPluginConfigError, match=CONFIG_ENV):
        call_policy(no_config)
    with pytest.raises(MissingPluginConfigError, match="custom-config-path"):
        tis_call(SlimeISCorrection(), no_config, TIS_CASE["inputs"])


def test_invalid_plugin_config_fails_at_the_first_call(monkeypatch):
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    with pytest.raises(ConfigError, match="truncated_importance_sampling_ratio"):
        tis_call(SlimeISCorrection(), args(nemo_is={"truncated_importance_sampling_ratio": -1.0}), TIS_CASE["inputs"])
    with pytest.raises(ConfigError, match="is_correction_level"):
        call_policy(args(nemo_is={"is_correction_level": "per_token"}))


def test_config_from_the_environment_and_args(monkeypatch, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("loss_fn:\n  is_correction_level: sequence_mean\n  truncated_importance_sampling_ratio: 5.0\n")
    monkeypatch.setenv(CONFIG_ENV, str(recipe))
    no_args = argparse.Namespace(**{k: v for k, v in vars(args()).items() if k != "nemo_is"})
    entry = SlimeISCorrection()
    entry.settings(no_args)
    cfg = entry.settings(no_args)
    assert (cfg.is_correction_level, cfg.truncated_importance_sampling_ratio) == ("sequence_mean", 5.0)
    # args.nemo_is (slime's --custom-config-path YAML) overrides the recipe
    cfg = entry.settings(args(nemo_is={"truncated_importance_sampling_ratio": 3.0}))
    assert (cfg.is_correction_level, cfg.truncated_importance_sampling_ratio) == ("sequence_mean", 3.0)


def test_docs_table_lists_every_loss_flag():
    text = DOCS.read_text()
    for flag, (status, _) in LOSS_FLAGS.items():
        assert any(flag in line and status in line for line in text.splitlines()), flag
