"""verl's ``loss_mode`` names through the verl adapter (``policy_loss.nemo_is.loss_mode``) against verl's own numbers:
the golden cases of tests/data/golden/verl_loss_modes (written by verl 0.9.1) give the same loss, gradient and metrics
through ``VerlPolicyLoss`` as through verl. The live comparison with the installed verl is
functional_tests/test_verl_loss_modes.py."""

from __future__ import annotations

import pytest
import torch
from helpers.golden_objectives import FORCED_AGGREGATION, load_cases

from nemo_is_plugin.adapters.verl import VerlPolicyLoss, verl_config
from nemo_is_plugin.adapters.verl.config import VerlConfigError, actor_keys
from nemo_is_plugin.adapters.verl.loss_modes import VERL_LOSS_MODES, verl_loss_mode_of

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
    cispo = verl_config({"loss_mode": "cispo"}, ACTOR, "token-mean", 8, False)
    assert cispo.policy_objective == "cispo" and not cispo.use_cispo  # the plugin's key, not NeMo-RL's switch


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


# verl 0.9.1 (core_algos.py): vanilla, cispo, dppo_* and sapo clamp the token log-ratio to +-20 in ppo_kl; gspo,
# geo_mean and dro average the raw log-ratio; gpg returns no metric at all, dro only ppo_kl.
PPO_KL_AT_MINUS_30 = {
    "vanilla": 20.0,
    "cispo": 20.0,
    "dppo_tv": 20.0,
    "dppo_kl": 20.0,
    "sapo": 20.0,
    "gspo": 30.0,
    "geo_mean": 30.0,
    "dro": 30.0,
    "gpg": None,
}
VERL_NAMES = {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}


def _direct_call(mode: str, log_prob, old, adv, mask, info: dict | None = None, **actor):
    """A direct call with verl's keyword arguments, the mode in the plugin section, as verl's own tests call a loss."""
    agg = "token-mean" if mode == "cispo" else FORCED_AGGREGATION.get(mode, "seq-mean-token-mean")
    dro_beta = 0.1 if mode == "dro" else None
    cfg = {**ACTOR, "policy_loss": {"dro_beta": dro_beta, "nemo_is": {"loss_mode": mode}}, **actor}
    cfg["global_batch_info"] = dict(info or {})
    return VerlPolicyLoss()(
        old_log_prob=old, log_prob=log_prob, advantages=adv, response_mask=mask, loss_agg_mode=agg, config=cfg
    )


@pytest.mark.parametrize("mode", sorted(PPO_KL_AT_MINUS_30))
def test_ppo_kl_and_metric_names_follow_each_verl_mode_beyond_20(mode):
    old = torch.full((2, 4), -1.0, dtype=torch.float64)
    mask = torch.ones(2, 4, dtype=torch.float64)
    _, metrics = _direct_call(mode, old - 30.0, old, torch.ones_like(old), mask)
    verl_named = {k for k in metrics if k.startswith("actor/") and "/nemo_is/" not in k}
    expected = PPO_KL_AT_MINUS_30[mode]
    if expected is None:
        assert verl_named == set()
        return
    assert verl_named == ({"actor/ppo_kl"} if mode == "dro" else VERL_NAMES)
    assert float(metrics["actor/ppo_kl"]) == pytest.approx(expected, rel=1e-7)


def test_geo_mean_without_a_global_count_divides_by_every_row_as_verl():
    """verl's geo_mean: torch.mean over the micro-batch's rows, an empty row included. log r = 0 (ratio 1, no clip):
    the loss is -(A_0 + A_1 + 0) / 3 and d loss / d log pi_t = -A_i / (n_i * 3); with a global_batch_size of 5 the
    divisor is 5 (the plugin's rule, docs/verl.md), and at DP 2 without a count it is still every row."""
    old = torch.full((3, 4), -1.0, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.float64)
    adv = torch.tensor([[0.6], [-1.5], [0.0]], dtype=torch.float64).expand(3, 4) * mask
    for info, rows in (({}, 3.0), ({"dp_size": 2}, 3.0), ({"global_batch_size": 5}, 5.0)):
        log_prob = old.clone().requires_grad_(True)
        loss, _ = _direct_call("geo_mean", log_prob, old, adv, mask, info)
        (grad,) = torch.autograd.grad(loss, log_prob)
        # rel 1e-7: GMPO's row means divide by n + 1e-8, as verl's
        assert float(loss.detach()) == pytest.approx(-(0.6 - 1.5) / rows, rel=1e-7)
        expected = -adv / mask.sum(-1, keepdim=True).clamp(min=1) / rows
        torch.testing.assert_close(grad, expected * mask, rtol=1e-7, atol=1e-15)


def test_seq_mean_token_sum_norm_reads_the_factor_verl_passes_in_global_batch_info():
    """verl's ppo_loss copies actor.loss_scale_factor into global_batch_info, which its losses read (a None there
    means the response length, whatever the actor says); without that key the actor's factor is used."""
    old = torch.full((2, 4), -1.0, dtype=torch.float64)
    mask = torch.ones(2, 4, dtype=torch.float64)
    adv = torch.tensor([[1.0], [2.0]], dtype=torch.float64).expand(2, 4)

    def loss(info, **actor):
        agg = {"policy_loss": {"nemo_is": {}}, "global_batch_info": info, **actor}
        return float(VerlPolicyLoss()(old, old, adv, mask, "seq-mean-token-sum-norm", {**ACTOR, **agg})[0])

    per_row_sum = -(4 * 1.0 + 4 * 2.0) / 2  # vanilla at ratio 1: -A per token, summed per row, mean over rows
    assert loss({"loss_scale_factor": 8.0}) == pytest.approx(per_row_sum / 8.0)
    assert loss({"loss_scale_factor": None}, loss_scale_factor=16.0) == pytest.approx(per_row_sum / 4)  # horizon 4
    assert loss({}, loss_scale_factor=16.0) == pytest.approx(per_row_sum / 16.0)


def test_the_plugin_s_objective_names_keep_the_clip_settings_they_read():
    """``policy_objective: cispo`` is verl's cispo mode (verl's clip ratios are its band, its dual clip is left out);
    ``reinforce`` / ``on_policy`` keep only verl's dual clip (``objectives/base.py: unread_clip_keys``)."""
    cispo = verl_config({"policy_objective": "cispo"}, ACTOR, "token-mean", 8, False)
    assert (cispo.ratio_clip_min, cispo.ratio_clip_max, cispo.ratio_clip_c) == (0.2, 0.28, None)
    assert cispo.effective_objective == "cispo" and verl_loss_mode_of(cispo) == "cispo"
    assert verl_loss_mode_of(verl_config({"loss_mode": "cispo"}, ACTOR, "token-mean", 8, False)) == "cispo"
    for name in ("reinforce", "on_policy"):
        cfg = verl_config({"policy_objective": name}, ACTOR, "token-mean", 8, False)
        assert (cfg.ratio_clip_min, cfg.ratio_clip_max, cfg.ratio_clip_c) == (0.2, 0.2, 3.0)
        assert verl_loss_mode_of(cfg) is None  # no verl mode computes it: its metrics follow vanilla
