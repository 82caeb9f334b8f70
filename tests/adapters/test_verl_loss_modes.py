"""verl's ``loss_mode`` names through the verl adapter (``policy_loss.nemo_is.loss_mode``) against verl's own numbers:
the golden cases of tests/data/golden/verl_loss_modes (written by verl 0.9.1) give the same loss, gradient and metrics
through ``VerlPolicyLoss`` as through verl. The live comparison with the installed verl is
functional_tests/test_verl_loss_modes.py."""

from __future__ import annotations

import pytest
import torch
from helpers.golden_objectives import FORCED_AGGREGATION, load_cases

from nemo_is_plugin.adapters.verl import VerlPolicyLoss, verl_config
from nemo_is_plugin.adapters.verl_config import VerlConfigError, actor_keys
from nemo_is_plugin.adapters.verl_loss_modes import VERL_LOSS_MODES

CASES = load_cases()


def actor_of(config: dict) -> dict:
    """verl's ActorConfig fields of a golden case's config, as a plain mapping."""
    return {
        "clip_ratio": config["clip_ratio"],
        "clip_ratio_low": config["clip_ratio_low"],
        "clip_ratio_high": config["clip_ratio_high"],
        "clip_ratio_c": config["clip_ratio_c"],
        "tau_pos": config["tau_pos"],
        "tau_neg": config["tau_neg"],
        "policy_loss": {"dro_beta": config["dro_beta"]},
        "global_batch_info": dict(config["global_batch_info"]),
        "loss_scale_factor": None,
    }


def through_adapter(case: dict, section: dict | None = None):
    inputs = case["inputs"]
    log_prob = inputs["log_prob"].clone().requires_grad_(True)
    agg = FORCED_AGGREGATION.get(case["mode"], case["loss_agg_mode"])
    actor = actor_of(case["config"])  # the plugin section of verl's Hydra config: policy_loss.nemo_is
    actor["policy_loss"]["nemo_is"] = section if section is not None else {"loss_mode": case["mode"]}
    loss, metrics = VerlPolicyLoss()(
        old_log_prob=inputs["old_log_prob"],
        log_prob=log_prob,
        advantages=inputs["advantages"],
        response_mask=inputs["response_mask"],
        loss_agg_mode=agg,
        config=actor,
    )
    (grad,) = torch.autograd.grad(loss, log_prob)
    return loss.detach(), grad, metrics


@pytest.mark.parametrize("case", CASES, ids=[f"{i:03d}-{c['mode']}" for i, c in enumerate(CASES)])
def test_adapter_reproduces_verl_loss_gradient_and_metrics(case):
    if case["mode"] == "cispo" and not case["loss_agg_mode"].startswith("token"):
        with pytest.raises(VerlConfigError, match="CISPO is token-level"):  # NeMo-RL's rule, kept
            through_adapter(case)
        return
    loss, grad, metrics = through_adapter(case)
    expected = case["expected"]
    torch.testing.assert_close(loss, expected["loss"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, expected["grad_log_prob"], rtol=1e-5, atol=1e-7)
    for name, value in expected["metrics"].items():
        assert float(metrics[name]) == pytest.approx(value, rel=1e-5, abs=1e-7), name


def test_every_mapped_mode_has_golden_cases():
    assert set(VERL_LOSS_MODES) == {
        "vanilla",
        "gspo",
        "cispo",
        "dppo_tv",
        "dppo_kl",
        "sapo",
        "geo_mean",
        "gpg",
        "dro",
    }
    assert {c["mode"] for c in CASES} == set(VERL_LOSS_MODES)


def test_the_plugin_vocabulary_gives_the_same_loss():
    """policy_objective: dppo_tv with the thresholds spelled out == loss_mode: dppo_tv reading verl's clip ratios."""
    case = next(c for c in CASES if c["mode"] == "dppo_tv")
    cfg = case["config"]
    section = {
        "policy_objective": "dppo_tv",
        "dppo_delta_low": cfg["clip_ratio_low"],
        "dppo_delta_high": cfg["clip_ratio_high"],
        "dppo_ratio_cap": cfg["clip_ratio_c"],
    }
    a, b = through_adapter(case, section), through_adapter(case)
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)


ACTOR = {"clip_ratio": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}


def test_mode_keys_read_verl_settings():
    dppo = verl_config({"loss_mode": "dppo_kl"}, ACTOR, "token-mean", 8, False)
    assert (dppo.dppo_delta_low, dppo.dppo_delta_high, dppo.dppo_ratio_cap) == (0.2, 0.28, 3.0)
    assert dppo.ratio_clip_c is None and dppo.policy_objective == "dppo_kl"
    plain = verl_config({"loss_mode": "dppo_tv"}, {"clip_ratio": 0.1}, "token-mean", 8, False)
    assert plain.dppo_ratio_cap == 20.0  # verl: config.get("clip_ratio_c", 20.0) without an ActorConfig
    sapo = verl_config({"loss_mode": "sapo"}, {"tau_pos": 1.5, "tau_neg": 2.0}, "seq-mean-token-mean", 8, False)
    assert (sapo.sapo_tau_pos, sapo.sapo_tau_neg) == (1.5, 2.0)
    gmpo = verl_config({"loss_mode": "geo_mean"}, ACTOR, "seq-mean-token-mean", 8, True)
    assert (gmpo.gmpo_clip_low, gmpo.gmpo_clip_high) == (0.2, 0.28)
    assert gmpo.is_correction_level == "sequence_mean"  # verl's weights enter as their per-sequence geometric mean
    dro = verl_config({"loss_mode": "dro"}, {"policy_loss": {"dro_beta": 0.3}}, "token-mean", 8, False)
    assert dro.dro_beta == 0.3
    gspo = verl_config({"loss_mode": "gspo"}, ACTOR, "seq-mean-token-mean", 8, False)
    assert gspo.ratio_level == "sequence_token" and gspo.max_log_ratio == 10.0 and gspo.token_log_ratio_clamp is None
    assert verl_config({"loss_mode": "cispo"}, ACTOR, "token-mean", 8, False).use_cispo


@pytest.mark.parametrize(
    "section, actor, agg, match",
    [
        ({"loss_mode": "clip_cov"}, ACTOR, "token-mean", "loss_mode='clip_cov' is refused: .*micro-batch"),
        ({"loss_mode": "kl_cov"}, ACTOR, "token-mean", "loss_mode='kl_cov' is refused"),
        ({"loss_mode": "ppo"}, ACTOR, "token-mean", "not one of verl's"),
        ({"loss_mode": "sapo"}, ACTOR, "token-mean", "set actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"),
        ({"loss_mode": "geo_mean"}, ACTOR, "seq-mean-token-sum", "loss_agg_mode=seq-mean-token-mean"),
        ({"loss_mode": "dro"}, ACTOR, "token-mean", "needs actor_rollout_ref.actor.policy_loss.dro_beta"),
        ({"loss_mode": "dppo_tv", "policy_objective": "sapo"}, ACTOR, "token-mean", "keep one"),
        ({"loss_mode": "vanilla"}, {**ACTOR, "tau_pos": 2.0}, "token-mean", "tau_pos=2.0 configures verl's 'sapo'"),
        ({"loss_mode": "sapo"}, {"policy_loss": {"dro_beta": 0.1}}, "seq-mean-token-mean", "dro_beta=0.1"),
    ],
)
def test_refusals(section, actor, agg, match):
    with pytest.raises((VerlConfigError, ValueError), match=match):
        verl_config(section, actor, agg, 8, False)


def test_actor_keys_default_mode_is_vanilla():
    assert actor_keys(ACTOR, "token-mean") == actor_keys(ACTOR, "token-mean", "vanilla")
    assert actor_keys(ACTOR, "token-mean")["ratio_clip_c"] == 3.0
