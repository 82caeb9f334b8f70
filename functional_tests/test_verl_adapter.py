"""The plugin's loss inside verl: registered in verl's own policy-loss registry, fetched by name through verl's lookup,
called with verl's signature and verl's ActorConfig, and checked against verl's ``vanilla`` and the plugin's direct
call. Needs verl (the ``verl`` extra; CI installs it, see docs/verl.md); skipped only if verl does not import."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

core_algos = pytest.importorskip(
    "verl.trainer.ppo.core_algos",
    reason="verl is not importable: pip install 'nemo-is-plugin[verl]' (see docs/verl.md)",
)
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights  # noqa: E402
from verl.workers.config.actor import ActorConfig  # noqa: E402

from nemo_is_plugin.adapters.verl import (  # noqa: E402
    CONFIG_ENV,
    METRIC_PREFIX,
    VERL_AGG_MODES,
    VERL_LOSS_NAME,
    register_verl_loss,
)
from nemo_is_plugin.loss import ClippedPGLoss  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
B, T = 6, 11


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(7)
    old = -torch.rand(B, T, generator=g) * 2 - 1.0
    rollout = old + 0.05 * torch.randn(B, T, generator=g)
    # large enough for clipping and the dual clip; kept < 0 (log-probs)
    log_prob = (old + 0.6 * torch.randn(B, T, generator=g)).clamp(max=-0.01)
    adv = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    mask = torch.rand(B, T, generator=g) > 0.2
    mask[1, 6:] = False
    mask[4] = False  # an empty response
    return {"old": old, "rollout": rollout, "log_prob": log_prob, "adv": adv, "mask": mask}


def _actor(agg: str, **info) -> ActorConfig:
    cfg = ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        loss_agg_mode=agg,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=2.0,
    )
    # what verl's ppo_loss writes before calling the policy loss
    cfg.global_batch_info.update(
        dp_size=info.get("dp_size", 1),
        batch_num_tokens=info.get("batch_num_tokens"),
        global_batch_size=info.get("global_batch_size"),
        loss_scale_factor=None,
    )
    return cfg


def _call_like_verl(name, batch, cfg, weights=None, **extra):
    """verl's ppo_loss call: the loss is fetched by name from verl's registry, all arguments by keyword."""
    fn = core_algos.get_policy_loss_fn(name)
    log_prob = batch["log_prob"].clone().requires_grad_(True)
    loss, metrics = fn(
        old_log_prob=batch["old"],
        log_prob=log_prob,
        advantages=batch["adv"],
        response_mask=batch["mask"],
        loss_agg_mode=cfg.loss_agg_mode,
        config=cfg,
        rollout_is_weights=weights,
        **extra,
    )
    loss.backward()
    return loss.detach(), log_prob.grad, metrics


@pytest.fixture(scope="module")
def registered():
    fn = register_verl_loss(config={})  # an explicit empty plugin config: verl's settings only
    yield fn
    core_algos.POLICY_LOSS_REGISTRY.pop(VERL_LOSS_NAME, None)


def test_verl_lookup_finds_the_plugin_by_name(registered):
    assert core_algos.get_policy_loss_fn(VERL_LOSS_NAME) is registered
    with pytest.raises(ValueError, match=r"Supported modes are: .*'nemo_is\.clipped_pg'"):
        core_algos.get_policy_loss_fn("nemo_is.nope")


@pytest.mark.parametrize("agg", VERL_AGG_MODES)
@pytest.mark.parametrize("with_weights", [False, True], ids=["no_is", "verl_weights"])
@pytest.mark.parametrize("dp", [1, 2])
def test_no_plugin_keys_is_verls_vanilla(registered, batch, agg, with_weights, dp):
    """Same loss, gradient and verl metrics as verl's own vanilla loss, with and without verl's rollout weights."""
    m = batch["mask"]
    info = {} if dp == 1 else {"dp_size": 2, "batch_num_tokens": 2 * int(m.sum()) + 3, "global_batch_size": 2 * B + 1}
    cfg = _actor(agg, **info)
    weights = None
    if with_weights:
        weights, _ = compute_rollout_correction_weights(batch["old"] - batch["rollout"], m.float(), "token", 1.05)
    ours, ours_grad, ours_m = _call_like_verl(VERL_LOSS_NAME, batch, cfg, weights)
    theirs, theirs_grad, theirs_m = _call_like_verl("vanilla", batch, cfg, weights)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours_grad, theirs_grad, rtol=1e-6, atol=1e-8)
    for key in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
        assert ours_m[key] == pytest.approx(theirs_m[key], rel=1e-5, abs=1e-7), key
    assert ours_m["actor/pg_clipfrac_lower"] > 0  # the dual clip is exercised
    assert f"{METRIC_PREFIX}is_weight_mean" in ours_m


def _direct(cfg_dict, batch, n_tok, n_seq, gen):
    """The plugin called directly, NeMo-RL style: [B, T+1] data whose column 0 is dropped by the loss."""
    pad = lambda t: torch.cat([torch.zeros(B, 1, dtype=t.dtype), t], 1)  # noqa: E731
    data = {
        "token_mask": pad(batch["mask"].float()),
        "sample_mask": torch.ones(B),
        "advantages": pad(batch["adv"]),
        "prev_logprobs": pad(batch["old"]),
        "generation_logprobs": pad(gen),
    }
    x = batch["log_prob"].clone().requires_grad_(True)
    loss, metrics = ClippedPGLoss(cfg_dict)(
        next_token_logprobs=x, data=data, global_valid_seqs=n_seq, global_valid_toks=n_tok
    )
    loss.backward()
    return loss.detach(), x.grad, metrics


PLUGIN_KEYS = {
    "reference_policy_kl_penalty": 0.0,
    "use_importance_sampling_correction": True,
    "is_correction_level": "sequence_mean",
    "truncated_importance_sampling_type": "tis",
    "truncated_importance_sampling_ratio": 1.003,
    "sequence_level_importance_ratios": True,
    "token_level_loss": False,
}


def test_plugin_owned_is_from_verls_raw_token_ratios_equals_direct_call(batch):
    """verl rollout_is=token with a huge threshold gives raw ratios; the plugin rebuilds log mu and applies its own
    sequence_mean + TIS correction (GSPO ratio, seq-mean-token-mean): equal to the plugin called with the true mu."""
    register_verl_loss("nemo_is.tests.gspo_seqmean", PLUGIN_KEYS)
    try:
        m = batch["mask"]
        raw, _ = compute_rollout_correction_weights(batch["old"] - batch["rollout"], m.float(), "token", 1e9)
        cfg = _actor("seq-mean-token-mean", dp_size=2, batch_num_tokens=100, global_batch_size=14)
        loss, grad, metrics = _call_like_verl("nemo_is.tests.gspo_seqmean", batch, cfg, raw)
        via_logprobs = _call_like_verl(
            "nemo_is.tests.gspo_seqmean", batch, cfg, None, rollout_log_probs=batch["rollout"]
        )
        ref_cfg = dict(
            PLUGIN_KEYS, ratio_clip_min=0.2, ratio_clip_max=0.28, ratio_clip_c=2.0, token_log_ratio_clamp=20.0
        )
        ref_loss, ref_grad, ref_metrics = _direct(ref_cfg, batch, 50.0, 7.0, batch["rollout"])
        for got_loss, got_grad in ((loss, grad), via_logprobs[:2]):
            torch.testing.assert_close(got_loss, ref_loss, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(got_grad, ref_grad, rtol=1e-5, atol=1e-7)
        # metrics come back per micro-batch: token metrics renormalised from 50 tokens to the local count
        local_toks = float(m.sum())
        assert metrics[f"{METRIC_PREFIX}is_weight_mean"] == pytest.approx(
            ref_metrics["is_weight_mean"] * 50.0 / local_toks, rel=1e-5
        )
        assert 0 < metrics[f"{METRIC_PREFIX}is_truncated_fraction"] < 1  # TIS at 1.003 really truncates
    finally:
        core_algos.POLICY_LOSS_REGISTRY.pop("nemo_is.tests.gspo_seqmean", None)


def test_plugin_owned_is_refuses_truncated_or_missing_weights(batch):
    fn = register_verl_loss(
        "nemo_is.tests.owned", {"reference_policy_kl_penalty": 0.0, "use_importance_sampling_correction": True}
    )
    try:
        cfg = _actor("token-mean")
        icepop, _ = compute_rollout_correction_weights(
            batch["old"] - batch["rollout"], batch["mask"].float(), "token", "0.99_1.01"
        )
        with pytest.raises(ValueError, match="raw token ratios"):
            _call_like_verl("nemo_is.tests.owned", batch, cfg, icepop)
        with pytest.raises(ValueError, match="needs the rollout log-probs"):
            _call_like_verl("nemo_is.tests.owned", batch, cfg, None)
        assert fn.user_keys["use_importance_sampling_correction"] is True
    finally:
        core_algos.POLICY_LOSS_REGISTRY.pop("nemo_is.tests.owned", None)


def test_verl_plugin_entry_point_registers_on_import_verl(tmp_path: Path):
    """verl imports every `verl.plugins` entry point at `import verl`; with the plugin's entry point (here from a
    throw-away dist-info on sys.path) the loss is in verl's registry without any code, configured by a recipe file."""
    dist = tmp_path / "nemo_is_verl_probe-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: nemo-is-verl-probe\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text("[verl.plugins]\nnemo_is = nemo_is_plugin.adapters.verl.plugin\n")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("trainer: {x: 1}\nloss_fn:\n  reference_policy_kl_penalty: 0.0\n  ratio_clip_max: 0.5\n")
    script = textwrap.dedent(f"""
        import verl
        from verl.trainer.ppo.core_algos import get_policy_loss_fn
        fn = get_policy_loss_fn({VERL_LOSS_NAME!r})
        assert type(fn).__name__ == "VerlPolicyLoss", fn
        assert fn.user_keys == {{"reference_policy_kl_penalty": 0.0, "ratio_clip_max": 0.5}}, fn.user_keys
        print("ok")
    """)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        CONFIG_ENV: str(recipe),
        "OMP_NUM_THREADS": "1",
        "VERL_USE_EXTERNAL_PLUGINS": "auto",
    }
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_docs_verl_recipe_configures_the_loss():
    fn = register_verl_loss(
        "nemo_is.tests.docs",
        ROOT / "configs" / "examples" / "verl_ctpo_seqmean.yaml",
        section="actor_rollout_ref.actor.policy_loss.nemo_is",  # the plugin section of the verl Hydra example
    )
    try:
        assert fn.user_keys["is_correction_level"] == "sequence_mean"
        cfg = fn.resolve(_actor("token-mean"), "token-mean", T).config
        assert cfg.ratio_clip_c is None and cfg.uses_log_space_clip  # CTPO's log-space clip replaces verl's dual clip
    finally:
        core_algos.POLICY_LOSS_REGISTRY.pop("nemo_is.tests.docs", None)


def test_docs_verl_recipe_through_the_environment(monkeypatch):
    """docs/verl.md: NEMO_IS_LOSS_CONFIG=<the example> with NEMO_IS_LOSS_SECTION=<its plugin section>."""
    from nemo_is_plugin.adapters.verl import SECTION_ENV, VerlPolicyLoss

    monkeypatch.setenv(CONFIG_ENV, str(ROOT / "configs" / "examples" / "verl_ctpo_seqmean.yaml"))
    monkeypatch.setenv(SECTION_ENV, "actor_rollout_ref.actor.policy_loss.nemo_is")
    keys = VerlPolicyLoss().user_keys
    assert keys["ratio_level"] == "cumulative" and keys["truncated_importance_sampling_ratio"] == 5.0
