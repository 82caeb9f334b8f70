"""verl's policy losses (``loss_mode``) against the plugin's compositions, live: fresh batches (ragged rows, an empty
row, advantages of both signs, ratios far beyond every threshold) through verl's own
``get_policy_loss_fn(mode)`` and through tests/helpers/golden_objectives.py give the same loss, gradient and metrics.
The committed golden cases (tests/data/golden/verl_loss_modes) pin the same comparison without verl installed.
Needs verl (the ``verl`` extra); skipped only if verl does not import.
"""

from __future__ import annotations

import math

import pytest
import torch

core_algos = pytest.importorskip(
    "verl.trainer.ppo.core_algos",
    reason="verl is not importable: pip install 'nemo-is-plugin[verl]' (see docs/verl.md)",
)
from helpers.golden_objectives import plugin_loss  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402

B, T = 6, 40
MODES = {
    "vanilla": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0},
    "gspo": {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4},
    "cispo": {"clip_ratio_low": 0.5, "clip_ratio_high": 2.0},
    "dppo_tv": {"clip_ratio_low": 0.1, "clip_ratio_high": 0.15, "clip_ratio_c": 5.0},
    "dppo_kl": {"clip_ratio_low": 0.03, "clip_ratio_high": 0.05, "clip_ratio_c": 20.0},
    "sapo": {"tau_pos": 1.0, "tau_neg": 1.05},
    "geo_mean": {"clip_ratio_low": 0.4, "clip_ratio_high": 0.4},
    "gpg": {},
    "dro": {"dro_beta": 0.05},
}
AGGREGATIONS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def _batch(seed: int, empty_row: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    if empty_row:
        lengths[-1] = 0
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()
    mask[0, 3] = 0.0
    old = torch.log(0.01 + 0.98 * torch.rand(B, T, generator=g))
    curr = torch.minimum(old + 0.8 * torch.randn(B, T, generator=g), torch.full_like(old, -1e-3))
    adv = torch.randn(B, 1, generator=g).expand(B, T) if seed % 2 else torch.randn(B, T, generator=g)
    return {"old_log_prob": old, "log_prob": curr, "advantages": adv * mask, "response_mask": mask}


def _actor(mode: str, policy_loss) -> ActorConfig:
    """verl's ActorConfig with ``MODES[mode]``'s settings; ``policy_loss(dro_beta)`` builds its policy-loss section
    (verl's own, or the plugin's with the mode under ``nemo_is``)."""
    fields = dict(MODES[mode])
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_gpu=1,
        policy_loss=policy_loss(fields.pop("dro_beta", None)),
        **fields,
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_plugin_composition_equals_verl(mode, agg, seed):
    cfg = _actor(mode, lambda dro_beta: PolicyLossConfig(loss_mode=mode, dro_beta=dro_beta))
    # verl's geo_mean averages over every row; this composition divides by the rows with tokens (the adapter divides
    # as verl does when no global count is given: the next test): no empty row here.
    inputs = _batch(seed, empty_row=mode != "geo_mean")
    log_prob = inputs["log_prob"].clone().requires_grad_(True)
    loss, metrics = core_algos.get_policy_loss_fn(mode)(
        old_log_prob=inputs["old_log_prob"],
        log_prob=log_prob,
        advantages=inputs["advantages"],
        response_mask=inputs["response_mask"],
        loss_agg_mode=agg,
        config=cfg,
    )
    (grad,) = torch.autograd.grad(loss, log_prob)
    case = {
        "mode": mode,
        "loss_agg_mode": agg,
        "inputs": inputs,
        "config": {
            "clip_ratio_low": cfg.clip_ratio_low,
            "clip_ratio_high": cfg.clip_ratio_high,
            "clip_ratio_c": cfg.clip_ratio_c,
            "tau_pos": cfg.tau_pos,
            "tau_neg": cfg.tau_neg,
            "dro_beta": cfg.policy_loss.dro_beta,
        },
    }
    ours, our_grad, our_metrics = plugin_loss(case)
    torch.testing.assert_close(ours, loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(our_grad, grad, rtol=1e-5, atol=1e-7)
    assert set(our_metrics) == set(metrics)
    for name, value in metrics.items():
        assert math.isclose(our_metrics[name], float(value), rel_tol=1e-5, abs_tol=1e-7), name


@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_verl_adapter_with_loss_mode_equals_verl(mode, agg, seed, with_weights):
    """The registered plugin loss, told verl's mode by ``policy_loss.nemo_is.loss_mode`` and reading verl's own
    ActorConfig, against verl's ``get_policy_loss_fn(mode)`` on the same config."""
    from nemo_is_plugin.adapters.verl import VerlPolicyLoss
    from nemo_is_plugin.adapters.verl.config import VerlConfigError
    from nemo_is_plugin.adapters.verl.hydra import PolicyLossConfig as PluginPolicyLossConfig
    from nemo_is_plugin.adapters.verl.loss_modes import FORCED_AGGREGATION

    agg = FORCED_AGGREGATION.get(mode, agg)  # verl forces it; the adapter refuses any other (tests/adapters)
    cfg = _actor(mode, lambda dro_beta: PluginPolicyLossConfig(dro_beta=dro_beta, nemo_is={"loss_mode": mode}))
    inputs = _batch(seed, empty_row=True)  # no global_batch_info: geo_mean divides by every row, as verl's
    args = dict(
        old_log_prob=inputs["old_log_prob"],
        advantages=inputs["advantages"],
        response_mask=inputs["response_mask"],
        loss_agg_mode=agg,
        config=cfg,
    )
    if with_weights:  # verl's rollout IS weights (verl owns the correction): they multiply each mode's loss as verl's
        g = torch.Generator().manual_seed(50 + seed)
        args["rollout_is_weights"] = 0.5 + torch.rand(inputs["log_prob"].shape, generator=g)
    if mode == "cispo" and not agg.startswith("token"):
        with pytest.raises(VerlConfigError, match="CISPO is token-level"):
            VerlPolicyLoss()(log_prob=inputs["log_prob"], **args)
        return
    results = []
    for fn in (core_algos.get_policy_loss_fn(mode), VerlPolicyLoss()):
        log_prob = inputs["log_prob"].clone().requires_grad_(True)
        loss, metrics = fn(log_prob=log_prob, **args)
        (grad,) = torch.autograd.grad(loss, log_prob)
        results.append((loss.detach(), grad, metrics))
    (theirs, their_grad, their_metrics), (ours, our_grad, our_metrics) = results
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(our_grad, their_grad, rtol=1e-5, atol=1e-7)
    for name, value in their_metrics.items():
        assert math.isclose(float(our_metrics[name]), float(value), rel_tol=1e-5, abs_tol=1e-7), name


@pytest.mark.parametrize("mode", sorted(MODES))
def test_verl_metrics_at_a_log_ratio_beyond_20(mode):
    """log pi - log pi_old = -30 on every token: verl's vanilla, cispo, dppo_* and sapo clamp it to -20 in ppo_kl,
    gspo, geo_mean and dro do not, gpg returns no metric; the plugin returns the same names and values per mode."""
    from nemo_is_plugin.adapters.verl import VerlPolicyLoss
    from nemo_is_plugin.adapters.verl.hydra import PolicyLossConfig as PluginPolicyLossConfig

    agg = "token-mean" if mode == "cispo" else "seq-mean-token-mean"
    old = torch.full((3, 5), -1.0)
    mask = torch.ones(3, 5)
    mask[2] = 0.0  # an empty row too
    args = dict(old_log_prob=old, advantages=torch.ones(3, 5) * mask, response_mask=mask, loss_agg_mode=agg)
    theirs = core_algos.get_policy_loss_fn(mode)(
        log_prob=old - 30.0, config=_actor(mode, lambda b: PolicyLossConfig(loss_mode=mode, dro_beta=b)), **args
    )
    plugin_cfg = _actor(mode, lambda b: PluginPolicyLossConfig(dro_beta=b, nemo_is={"loss_mode": mode}))
    ours = VerlPolicyLoss()(log_prob=old - 30.0, config=plugin_cfg, **args)
    verl_named = {k: float(v) for k, v in ours[1].items() if k.startswith("actor/") and "/nemo_is/" not in k}
    assert verl_named.keys() == theirs[1].keys()
    for name, value in theirs[1].items():
        assert math.isclose(verl_named[name], float(value), rel_tol=1e-6, abs_tol=1e-7), name
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-6, atol=1e-12)


def test_boolean_rollout_is_threshold_is_a_type_error_not_a_boolean_as_verls():
    """verl's tests/trainer/ppo/test_rollout_corr.py expects TypeError matching "not a boolean"; so does the mapping."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    from nemo_is_plugin.adapters.verl.config import rollout_correction_keys

    zeros = torch.zeros(1, 2)
    with pytest.raises(TypeError, match="not a boolean"):
        compute_rollout_correction_and_rejection_mask(
            old_log_prob=zeros,
            rollout_log_prob=zeros,
            response_mask=torch.ones(1, 2),
            rollout_is="token",
            rollout_is_threshold=True,
            rollout_rs=None,
        )
    with pytest.raises(TypeError, match="not a boolean"):
        rollout_correction_keys({"rollout_is": "token", "rollout_is_threshold": True})
