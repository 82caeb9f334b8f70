"""verl adapter logic that needs no verl: config mapping, weights -> log-probs, verl's normalisation, a float64
re-derivation of verl's vanilla loss. The comparison with verl itself is functional_tests/test_verl_adapter.py."""

from __future__ import annotations

import pytest
import torch

from nemo_is_plugin.adapters.verl import (
    CONFIG_ENV,
    VERL_LOG_RATIO_CLAMP,
    MissingPluginConfigError,
    VerlPolicyLoss,
    generation_logprobs,
    verl_config,
)
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig

ACTOR = {
    "clip_ratio": 0.2,
    "clip_ratio_low": None,
    "clip_ratio_high": 0.28,
    "clip_ratio_c": 3.0,
    "loss_scale_factor": None,
    "global_batch_info": {},
}


def test_verl_settings_become_the_defaults():
    cfg = verl_config({}, ACTOR, "token-mean", horizon=16, weights_only=False)
    assert (cfg.ratio_clip_min, cfg.ratio_clip_max, cfg.ratio_clip_c) == (0.2, 0.28, 3.0)
    assert cfg.token_log_ratio_clamp == VERL_LOG_RATIO_CLAMP and cfg.reference_policy_kl_penalty == 0.0
    assert cfg.effective_loss_aggregation == "token-mean" and not cfg.use_importance_sampling_correction
    norm = verl_config({}, ACTOR, "seq-mean-token-sum-norm", horizon=16, weights_only=False)
    assert norm.loss_aggregation_norm == 16.0  # verl: loss_scale_factor or the response length
    assert (
        verl_config(
            {}, {**ACTOR, "loss_scale_factor": 4096}, "seq-mean-token-sum-norm", 16, False
        ).loss_aggregation_norm
        == 4096.0
    )
    weights = verl_config({}, ACTOR, "seq-mean-token-mean", 16, weights_only=True)
    assert weights.use_importance_sampling_correction and weights.is_correction_level == "token"
    assert weights.truncated_importance_sampling_type is None


def test_explicit_plugin_keys_win_and_displace_conflicting_verl_defaults():
    ctpo = {"log_ratio_clip_low": 0.025, "log_ratio_clip_high": 0.05, "ratio_level": "cumulative"}
    cfg = verl_config(ctpo, ACTOR, "token-mean", 16, False)
    assert cfg.ratio_clip_c is None and cfg.uses_log_space_clip
    gspo = {"sequence_level_importance_ratios": True, "token_level_loss": False}
    assert verl_config(gspo, ACTOR, "token-mean", 16, False).effective_loss_aggregation == "seq-mean-token-mean"
    assert verl_config({"ratio_clip_min": 0.1}, ACTOR, "token-mean", 16, False).ratio_clip_min == 0.1
    assert verl_config({"use_cispo": True}, ACTOR, "token-mean", 16, False).ratio_clip_c is None


@pytest.mark.parametrize(
    "user,agg,match",
    [
        ({}, "seq-sum", "loss_agg_mode='seq-sum' is not one of verl's"),
        ({"reference_policy_kl_penalty": 0.01}, "token-mean", "verl adds the KL loss itself"),
        ({"positive_example_nll_weight": 0.1}, "token-mean", "needs per-sample rewards"),
    ],
)
def test_unsupported_settings_are_refused(user, agg, match):
    with pytest.raises(ValueError, match=match):
        verl_config(user, ACTOR, agg, 16, False)


def test_generation_logprobs_reproduce_the_weights():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, generator=g) - 0.5
    mask = torch.rand(3, 5, generator=g) > 0.3
    w = torch.exp(0.3 * torch.randn(3, 5, generator=g)) * mask
    w[0, 0] = 0.0
    mask[0, 0] = True  # a rejected (weight 0) valid token
    gen = generation_logprobs(old, mask, w)
    back = torch.exp(old.double() - gen.double())
    torch.testing.assert_close(back[mask], w.double()[mask], rtol=2e-6, atol=1e-37)
    assert back[0, 0] < 1e-37
    assert torch.equal(gen[~mask], old[~mask])  # masked tokens carry no mismatch


def _vanilla_reference(old, lp, adv, mask, agg, n_tok, n_seq, w=None, low=0.2, high=0.28, c=3.0):
    """float64 re-derivation of verl's compute_policy_loss_vanilla + agg_loss (verl 0.9.1)."""
    old, lp, adv, m = old.double(), lp.double(), adv.double(), mask.double()
    ratio = torch.exp((lp - old).clamp(-20, 20))
    l1, l2 = -adv * ratio, -adv * ratio.clamp(1 - low, 1 + high)
    clipped = torch.maximum(l1, l2)
    loss = torch.where(adv < 0, torch.minimum(clipped, -adv * c), clipped)
    if w is not None:
        loss = loss * w.double()
    if agg == "token-mean":
        return (loss * m).sum() / n_tok
    per_seq = (loss * m).sum(-1) / (m.sum(-1) + 1e-8)
    return per_seq.sum() / n_seq


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("dp", [1, 4])
def test_loss_matches_a_float64_rederivation_of_verl_vanilla(agg, dp):
    g = torch.Generator().manual_seed(1)
    b, t = 5, 8
    old = -torch.rand(b, t, generator=g) * 2 - 1
    lp = (old + 0.7 * torch.randn(b, t, generator=g)).clamp(max=-0.01).requires_grad_(True)
    adv = torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) > 0.3
    w = torch.exp(0.1 * torch.randn(b, t, generator=g)) * mask
    info = {"dp_size": dp, "batch_num_tokens": 4 * int(mask.sum()), "global_batch_size": 4 * b} if dp > 1 else {}
    actor = {**ACTOR, "global_batch_info": info}
    loss, metrics = VerlPolicyLoss({})(old, lp, adv, mask, agg, actor, rollout_is_weights=w)
    n_tok = info["batch_num_tokens"] / dp if dp > 1 else float(mask.sum())
    n_seq = info["global_batch_size"] / dp if dp > 1 else float((mask.sum(-1) > 0).sum())
    ref = _vanilla_reference(old, lp, adv, mask, agg, n_tok, n_seq, w)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)  # float32 sums of O(1) terms
    kl = float(((old - lp.detach()) * mask).sum() / mask.sum())
    assert metrics["actor/ppo_kl"] == pytest.approx(kl, rel=1e-5)
    assert 0 < metrics["actor/pg_clipfrac"] < 1


def test_ppo_kl_clamps_each_log_ratio_at_20_like_verl():
    """Hand-computed: log pi - log pi_old = +25, -0.5, -30 on the valid tokens (a masked one at +1.5 does not count).
    verl clamps before averaging: ppo_kl = -(20 - 0.5 - 20) / 3 = 0.5 / 3 (unclamped it would be 5.5 / 3)."""
    old = torch.tensor([[-40.0, -1.0, -35.0, -2.0]], dtype=torch.float64)
    lp = torch.tensor([[-15.0, -1.5, -65.0, -0.5]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, True, True, False]])
    adv = torch.ones(1, 4, dtype=torch.float64)
    _, metrics = VerlPolicyLoss({})(old, lp, adv, mask, "token-mean", ACTOR)
    assert metrics["actor/ppo_kl"] == pytest.approx(0.5 / 3, rel=1e-8)  # verl divides by count + 1e-8


def test_dp_without_global_counts_is_refused_like_verl():
    x = -torch.ones(2, 3)
    with pytest.raises(ValueError, match="batch_num_tokens is required when dp_size > 1"):
        VerlPolicyLoss({})(x, x, x, x > -2, "token-mean", {**ACTOR, "global_batch_info": {"dp_size": 2}})
    with pytest.raises(ValueError, match="global_batch_size is required when dp_size > 1"):
        VerlPolicyLoss({})(x, x, x, x > -2, "seq-mean-token-mean", {**ACTOR, "global_batch_info": {"dp_size": 2}})


def test_config_sources(tmp_path, monkeypatch):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer: {a: 1}\nloss_fn:\n  name: nemo_is.clipped_pg\n  ratio_clip_min: 0.05\n")
    assert VerlPolicyLoss(recipe).user_keys == {"ratio_clip_min": 0.05}
    assert VerlPolicyLoss({"loss_fn": {"ratio_clip_min": 0.07}}).user_keys == {"ratio_clip_min": 0.07}
    assert VerlPolicyLoss(ClippedPGLossConfig(ratio_clip_max=0.3)).user_keys == {"ratio_clip_max": 0.3}
    monkeypatch.setenv(CONFIG_ENV, str(recipe))
    assert VerlPolicyLoss().user_keys == {"ratio_clip_min": 0.05}  # read lazily, in the worker
    monkeypatch.delenv(CONFIG_ENV)
    with pytest.raises(MissingPluginConfigError, match="no plugin config on this worker"):
        VerlPolicyLoss().user_keys


def test_verl_owned_weights_win_over_rollout_log_probs():
    """With the plugin's IS off, verl's (truncated) weights are what multiplies the loss, even when the caller also
    passes rollout log-probs (those are only read when the plugin owns the correction)."""
    g = torch.Generator().manual_seed(4)
    old = -torch.rand(3, 5, generator=g) - 0.5
    lp = old + 0.1 * torch.randn(3, 5, generator=g)
    adv = torch.randn(3, 5, generator=g)
    mask = torch.ones(3, 5, dtype=torch.bool)
    w = torch.full((3, 5), 0.5)
    fn = VerlPolicyLoss({})
    with_weights, _ = fn(old, lp, adv, mask, "token-mean", ACTOR, rollout_is_weights=w)
    both, _ = fn(old, lp, adv, mask, "token-mean", ACTOR, rollout_is_weights=w, rollout_log_probs=old - 3.0)
    assert both.item() == with_weights.item()
    assert both.item() != fn(old, lp, adv, mask, "token-mean", ACTOR)[0].item()
