"""verl's rollout-correction presets, its Hydra section and a worker without the plugin's config, against verl itself.

Per preset: verl's own ``RolloutCorrectionConfig.<preset>()`` run through verl's own functions, and the plugin's
resolution of the same name, give the same IS weights and rejection masks on one batch, and the same loss and gradient
end to end (decoupled presets: verl's vanilla loss with verl's weights and modified mask; bypass presets: verl's
``bypass_mode`` loss). Needs verl (the ``verl`` extra; CI installs it); skipped only if verl does not import.
"""

from __future__ import annotations

import pytest
import torch

core_algos = pytest.importorskip(
    "verl.trainer.ppo.core_algos",
    reason="verl is not importable: pip install 'nemo-is-plugin[verl]' (see docs/verl.md)",
)
from verl.trainer.config.algorithm import RolloutCorrectionConfig  # noqa: E402
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask  # noqa: E402
from verl.workers.config.actor import ActorConfig, PolicyLossConfig  # noqa: E402

from nemo_is_plugin.adapters.verl import (  # noqa: E402
    CONFIG_ENV,
    VERL_LOSS_NAME,
    MissingPluginConfigError,
    VerlPolicyLoss,
)
from nemo_is_plugin.adapters.verl.config import PRESETS, ROLLOUT_CORRECTION_KEYS, preset_keys, preset_settings  # noqa
from nemo_is_plugin.adapters.verl.hydra import PolicyLossConfig as NemoISPolicyLossConfig  # noqa: E402
from nemo_is_plugin.adapters.verl.metrics import verl_step_name  # noqa: E402
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig  # noqa: E402
from nemo_is_plugin.loss.correction import compute_is_correction  # noqa: E402
from nemo_is_plugin.loss.layout import TokenLayout  # noqa: E402
from nemo_is_plugin.loss.terms import is_correction_kwargs  # noqa: E402

B, T = 7, 24
# Per-row mismatch scales: rows from (nearly) on-policy to far off-policy, so that every preset's rejection keeps some
# rows and rejects others; row 6 is an empty response.
SCALES = [1e-5, 3e-4, 3e-3, 0.03, 0.2, 0.8, 1e-5]
VERL_PRESETS = sorted(n for n, v in vars(RolloutCorrectionConfig).items() if isinstance(v, classmethod))


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(11)
    old = -torch.rand(B, T, generator=g) * 2 - 0.5
    scale = torch.tensor(SCALES).unsqueeze(1)
    rollout = old - scale * torch.randn(B, T, generator=g) - 0.5 * scale**2
    # the current policy as far from pi_old as the rollout is: bypass presets reject on pi_theta / mu
    log_prob = (old + scale.flip(0) * torch.randn(B, T, generator=g)).clamp(max=-0.01)
    adv = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    mask = torch.rand(B, T, generator=g) > 0.15
    mask[2, 15:] = False
    mask[6] = False
    return {"old": old, "rollout": rollout, "log_prob": log_prob, "adv": adv, "mask": mask}


def _fields(cfg) -> dict:
    # the keys the installed verl has (score_centering came after 0.9.1: verl-project/verl PR #8010; no preset sets it)
    return {k: cfg[k] for k in ROLLOUT_CORRECTION_KEYS if hasattr(cfg, k)}


def _actor(policy_loss=None) -> ActorConfig:
    cfg = ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        loss_agg_mode="token-mean",
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        policy_loss=policy_loss if policy_loss is not None else PolicyLossConfig(),
    )
    cfg.global_batch_info.update(dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None)
    return cfg


def test_the_preset_table_is_verls():
    """Every RolloutCorrectionConfig classmethod is in the table, with verl's settings at its defaults and at other
    keyword values (so a preset verl adds or changes fails here)."""
    assert VERL_PRESETS == sorted(PRESETS)
    other = {"threshold": 3.0, "threshold_lower": 0.25, "is_threshold": 4.0}
    for name in VERL_PRESETS:
        assert preset_settings(name) == _fields(getattr(RolloutCorrectionConfig, name)()), name
        kwargs = {k: other.get(k) for k in PRESETS[name][0]}
        if "rs_threshold" in kwargs:  # a k1 option's band, or a k3 option's bound
            kwargs["rs_threshold"] = "0.9_1.2" if "_k1" in str(preset_settings(name)["rollout_rs"]) else 0.05
        assert preset_settings(name, **kwargs) == _fields(getattr(RolloutCorrectionConfig, name)(**kwargs)), name


@pytest.mark.parametrize("name", VERL_PRESETS)
def test_preset_weights_and_masks_equal_verls(batch, name):
    """verl's preset through verl's compute_rollout_correction_and_rejection_mask vs the plugin's preset through its
    IS correction, with the numerator verl uses: pi_old (decoupled) or the current policy (bypass)."""
    verl_cfg = getattr(RolloutCorrectionConfig, name)()
    m = batch["mask"].float()
    numerator = batch["log_prob"] if verl_cfg.bypass_mode else batch["old"]
    settings = {
        k: verl_cfg[k]
        for k in (
            "rollout_is",
            "rollout_is_threshold",
            "rollout_is_batch_normalize",
            "rollout_rs",
            "rollout_rs_threshold",
        )
    }
    weights, verl_mask, _ = compute_rollout_correction_and_rejection_mask(numerator, batch["rollout"], m, **settings)
    applies = weights is not None and not (verl_cfg.bypass_mode and verl_cfg.loss_type == "ppo_clip")
    want = verl_mask * (weights.batch["rollout_is_weights"] if applies else 1.0)

    cfg = ClippedPGLossConfig(reference_policy_kl_penalty=0.0, **preset_keys(name))
    assert cfg.bypasses_prev == verl_cfg.bypass_mode and (cfg.effective_objective == "reinforce") == (
        verl_cfg.loss_type == "reinforce" and verl_cfg.bypass_mode
    )
    assert cfg.policy_objective == cfg.effective_objective  # the adapter names it; no NeMo-RL switch
    corr = compute_is_correction(
        numerator, batch["rollout"], m, m, TokenLayout.padded(B, T), **is_correction_kwargs(cfg)
    )
    torch.testing.assert_close(corr.weights * m, want, rtol=1e-6, atol=1e-7)
    # verl's rejection edits the response mask; IcePop only zeroes weights (in the plugin: a truncation type)
    keep = torch.ones_like(m, dtype=torch.bool) if corr.rules_keep is None else corr.rules_keep
    torch.testing.assert_close(keep.float() * m, verl_mask, rtol=0, atol=0)
    if verl_cfg.rollout_rs is not None:  # the batch really exercises the rejection
        kept = verl_mask.amax(-1)[:6]
        assert 0 < kept.sum() < 6, kept


def _loss_and_grad(fn, batch, config, **kw):
    log_prob = batch["log_prob"].clone().requires_grad_(True)
    loss, metrics = fn(
        old_log_prob=kw.pop("old", batch["old"]),
        log_prob=log_prob,
        advantages=batch["adv"],
        response_mask=kw.pop("mask", batch["mask"]),
        loss_agg_mode="token-mean",
        config=config,
        **kw,
    )
    loss.backward()
    return loss.detach(), log_prob.grad, metrics


@pytest.mark.parametrize("name", VERL_PRESETS)
def test_preset_loss_and_gradient_equal_verls(batch, name):
    """End to end. Decoupled: the plugin owning the correction (from the rollout log-probs) equals verl's vanilla loss
    with verl's weights and modified mask. Bypass: the plugin, called as verl calls it in bypass mode (old_log_prob =
    rollout log-probs, no weights), equals verl's bypass_mode loss. Both normalise by the count of the original mask
    (global_batch_info), as verl's bypass mode does; see docs/verl.md for decoupled mode's counts."""
    verl_cfg = getattr(RolloutCorrectionConfig, name)()
    n_tok = int(batch["mask"].sum())
    plugin = VerlPolicyLoss()
    ours_actor = _actor(NemoISPolicyLossConfig(loss_mode=VERL_LOSS_NAME, nemo_is={"rollout_correction": name}))
    ours_actor.global_batch_info.update(batch_num_tokens=n_tok)
    if verl_cfg.bypass_mode:
        theirs_actor = _actor(PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=verl_cfg))
        theirs_actor.global_batch_info.update(batch_num_tokens=n_tok)
        theirs = _loss_and_grad(core_algos.get_policy_loss_fn("bypass_mode"), batch, theirs_actor, old=batch["rollout"])
        ours = _loss_and_grad(plugin, batch, ours_actor, old=batch["rollout"])
    else:
        settings = {
            k: verl_cfg[k]
            for k in (
                "rollout_is",
                "rollout_is_threshold",
                "rollout_is_batch_normalize",
                "rollout_rs",
                "rollout_rs_threshold",
            )
        }
        w, mask, _ = compute_rollout_correction_and_rejection_mask(
            batch["old"], batch["rollout"], batch["mask"].float(), **settings
        )
        theirs_actor = _actor()
        theirs_actor.global_batch_info.update(batch_num_tokens=n_tok)
        theirs = _loss_and_grad(
            core_algos.get_policy_loss_fn("vanilla"),
            batch,
            theirs_actor,
            mask=mask.bool(),
            rollout_is_weights=None if w is None else w.batch["rollout_is_weights"],
        )
        ours = _loss_and_grad(plugin, batch, ours_actor, rollout_log_probs=batch["rollout"])
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-6, atol=1e-8)
    if verl_cfg.rollout_rs is not None:
        # the rejection statistics under verl's names, as verl's bypass loss reports them
        option = verl_cfg.rollout_rs
        assert f"rollout_corr/rollout_rs_{option}_mean" in ours[2]
        if verl_cfg.bypass_mode:
            for key in (
                f"rollout_corr/rollout_rs_{option}_mean",
                f"rollout_corr/rollout_rs_{option}_max",
                "rollout_corr/rollout_rs_masked_fraction",
                "rollout_corr/kl",
                "rollout_corr/k3_kl",
            ):
                # an extremum under <name>_micro_batch_mean (verl averages a policy loss's metrics), at verl's value
                assert ours[2][verl_step_name(key)] == pytest.approx(theirs[2][key], rel=1e-5, abs=1e-7), key


def test_hydra_section_is_the_plugin_config(batch):
    """policy_loss._target_ = the plugin's PolicyLossConfig carries a nemo_is section (as Hydra instantiates it: the
    node's keys as keyword arguments); plugin keys in it win over its verl-vocabulary rollout_correction."""
    node = {
        "loss_mode": VERL_LOSS_NAME,
        "nemo_is": {
            "rollout_correction": {"preset": "decoupled_geo_rs_token_tis", "is_threshold": 3.0},
            "truncated_importance_sampling_ratio": 2.5,
        },
    }
    actor = _actor(NemoISPolicyLossConfig(**node))
    cfg = VerlPolicyLoss().resolve(actor, "token-mean", T).config
    assert cfg.truncated_importance_sampling_ratio == 2.5 and cfg.is_correction_level == "token"
    assert [r.verl_option for r in cfg.rejection_rules] == ["seq_mean_k1"]
    assert cfg.ratio_clip_max == 0.28  # verl's actor settings still give the defaults


def test_a_worker_without_the_plugin_config_raises(batch, monkeypatch):
    """The entry-point registration on a worker where neither the Hydra section nor $NEMO_IS_LOSS_CONFIG arrived:
    a clear error naming both, never verl's vanilla PPO in disguise."""
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    import importlib

    import nemo_is_plugin.adapters.verl.plugin as entry_point

    importlib.reload(entry_point)  # what `import verl` does on every worker
    fn = core_algos.get_policy_loss_fn(VERL_LOSS_NAME)
    with pytest.raises(MissingPluginConfigError, match=r"policy_loss\.nemo_is.*NEMO_IS_LOSS_CONFIG"):
        _loss_and_grad(fn, batch, _actor())
    with pytest.raises(MissingPluginConfigError):
        _loss_and_grad(fn, batch, _actor(NemoISPolicyLossConfig(loss_mode=VERL_LOSS_NAME)))  # section None
    loss, _, _ = _loss_and_grad(fn, batch, _actor(NemoISPolicyLossConfig(loss_mode=VERL_LOSS_NAME, nemo_is={})))
    assert torch.isfinite(loss)  # an explicit empty section: verl's settings only


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_icepop_with_batch_normalisation_equals_verls(batch, level):
    """verl's IcePop ("lo_hi" threshold) zeroes weights before its batch normalisation, so the zeros enter the mean;
    the mapped plugin config (icepop truncation type) does the same."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

    from nemo_is_plugin.adapters.verl.config import rollout_correction_keys

    m = batch["mask"].float()
    band = "0.9_1.1" if level == "token" else "0.5_1.5"
    want, metrics = compute_rollout_correction_weights(batch["old"] - batch["rollout"], m, level, band, True)
    cfg = ClippedPGLossConfig(
        reference_policy_kl_penalty=0.0,
        **rollout_correction_keys(
            {"rollout_is": level, "rollout_is_threshold": band, "rollout_is_batch_normalize": True}
        ),
    )
    corr = compute_is_correction(
        batch["old"], batch["rollout"], m, m, TokenLayout.padded(B, T), **is_correction_kwargs(cfg)
    )
    assert 0 < float((corr.weights[m > 0] == 0).float().mean()) < 1  # IcePop zeroes some weights, not all
    torch.testing.assert_close(corr.weights * m, want * m, rtol=1e-6, atol=1e-7)
    assert float(corr.batch_norm_factor) == pytest.approx(metrics["rollout_is_batch_norm_factor"], rel=1e-6)
