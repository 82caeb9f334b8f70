"""The host adapters under the CPU device guard (helpers/device_guard.py): NeMo-RL's loss function (LOGPROB and LOGIT
inputs) and verl's policy loss. A guarded call equals the plain call bit for bit, and the call reads the device back
once (the metrics, NeMo-RL's share of the valid sequences with them), plus NeMo-RL's input validation (one batched
check) and verl's check of the weights it inverts."""

from __future__ import annotations

import pytest
import torch
from distributed._loss_cases import LOSS_CONFIGS, global_counts, make_batch
from helpers.device_guard import assert_identical, count_host_syncs, run_guarded_and_plain

import nemo_is_plugin.adapters.verl.policy_loss as verl_module
from nemo_is_plugin.adapters.nemo_rl import NeMoRLLossFn
from nemo_is_plugin.adapters.nemo_rl.step_metrics import is_summed_extremum, micro_batch_mean_name
from nemo_is_plugin.adapters.verl import VerlPolicyLoss

ACTOR = {
    "clip_ratio": 0.2,
    "clip_ratio_low": None,
    "clip_ratio_high": 0.28,
    "clip_ratio_c": 3.0,
    "loss_scale_factor": None,
    "global_batch_info": {},
}


def _sync_files(syncs) -> list[str]:
    return sorted(r.where.split(":")[0] for r in syncs.records)


# NeMo-RL's LossType has no "divided by no count": its adapter refuses token-sum aggregation.
NEMO_RL_CONFIGS = sorted(k for k, v in LOSS_CONFIGS.items() if v.get("loss_aggregation") != "token-sum")


@pytest.mark.parametrize("name", NEMO_RL_CONFIGS)
def test_nemo_rl_logprob_input_is_device_clean(name):
    logits, data, _ = make_batch(21)
    lp0 = torch.log_softmax(logits, -1)[:, :-1].gather(-1, data["input_ids"][:, 1:, None]).squeeze(-1)
    fn = NeMoRLLossFn(LOSS_CONFIGS[name])

    def run():
        lp = lp0.clone().requires_grad_(True)
        with count_host_syncs() as syncs:
            loss, metrics = fn(lp, data, *global_counts(data))
        loss.backward()
        return (loss.detach(), metrics, lp.grad), _sync_files(syncs)

    (got, files), (want, _) = run_guarded_and_plain(run)
    assert_identical(got, want)
    assert files == ["nemo_is_plugin/loss/input_values.py", "nemo_is_plugin/loss/metrics.py"]


@pytest.mark.parametrize("name", ["nemo_rl_default", "gspo_nemo_rl", "ctpo_cumulative_is", "seq_mis_veto"])
def test_nemo_rl_logit_input_is_device_clean(name):
    logits, data, _ = make_batch(22)
    fn = NeMoRLLossFn(LOSS_CONFIGS[name], input_type="logit")

    def run():
        x = logits.clone().requires_grad_(True)
        with count_host_syncs() as syncs:
            loss, metrics = fn(logits=x, data=data, global_valid_seqs=3.0, global_valid_toks=17.0)
        loss.backward()
        return (loss.detach(), metrics, x.grad), _sync_files(syncs)

    (got, files), (want, _) = run_guarded_and_plain(run)
    assert_identical(got, want)
    assert files == ["nemo_is_plugin/loss/metrics.py"]


@pytest.mark.parametrize("name", ["ctpo_cumulative_is", "seq_mis_veto"])
def test_nemo_rl_logit_extrema_with_device_counts_read_the_device_back_once(name):
    """The LOGIT path with the plugin's extrema reported (``<stem>/{min,max}_mb_mean``, scaled by the call's share of
    the step's valid sequences) and NeMo-RL's counts as device tensors: the share is read with the metrics, so the
    call reads the device back once (it read ``global_valid_seqs`` a second time before). Each reported value is the
    call's extremum times its valid sequences over ``global_valid_seqs``, bit for bit."""
    logits, data, _ = make_batch(25)
    data = {**data, "sample_mask": data["sample_mask"].clone()}
    data["sample_mask"][0] = 0.0  # a masked sequence: the share is not 1
    fn = NeMoRLLossFn(LOSS_CONFIGS[name], input_type="logit")
    seqs, toks = torch.tensor(5.0), torch.tensor(17.0)

    def run():
        x = logits.clone().requires_grad_(True)
        with count_host_syncs() as syncs:
            loss, metrics = fn(logits=x, data=data, global_valid_seqs=seqs, global_valid_toks=toks)
        loss.backward()
        return (loss.detach(), metrics, x.grad), _sync_files(syncs)

    (got, files), (want, _) = run_guarded_and_plain(run)
    assert_identical(got, want)
    assert files == ["nemo_is_plugin/loss/metrics.py"]
    assert fn._logit_loss is not None
    _, raw = fn._logit_loss(logits, data, 5.0, 17.0)
    share = float(data["sample_mask"].sum()) / 5.0
    assert 0 < share < 1
    extrema = {k for k in raw if is_summed_extremum(k)}
    assert extrema  # the config reports the plugin's extrema
    for k in extrema:
        assert got[1][micro_batch_mean_name(k)] == raw[k] * share, k
    assert {k: v for k, v in got[1].items() if "_mb_mean" not in k} == {
        k: v for k, v in raw.items() if k not in extrema
    }


def _verl_batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    b, t = 3, 7
    old = -torch.rand(b, t, generator=g) * 2 - 0.05
    lp = old + 0.1 * torch.randn(b, t, generator=g)
    rollout = old - 0.05 * torch.randn(b, t, generator=g).abs()
    mask = torch.rand(b, t, generator=g) > 0.25
    mask[:, 0] = True
    adv = torch.randn(b, t, generator=g)
    return old, lp, adv, mask, rollout


OWNED = {
    "use_importance_sampling_correction": True,
    "is_correction_level": "sequence_mean",
    "truncated_importance_sampling_type": "tis",
    "truncated_importance_sampling_ratio": 2.0,
}


@pytest.mark.parametrize(
    ("user", "extra", "validates"),
    [
        ({}, {}, False),  # verl's vanilla loss
        ({}, {"weights": True}, False),  # verl owns the correction: its weights multiply the loss
        (OWNED, {"log_probs": True}, False),  # the plugin owns it, from the rollout log-probs
        (OWNED, {"weights": True}, True),  # ... from verl's raw token weights (checked: none may be 0)
        (
            {
                "importance_sampling_rejection": "geo-rs",
                "importance_sampling_rejection_min": 0.9,
                "importance_sampling_rejection_max": 1.1,
                "use_importance_sampling_correction": True,
                "truncated_importance_sampling_type": "tis",
                "truncated_importance_sampling_ratio": 2.0,
            },
            {"log_probs": True},
            False,
        ),
    ],
    ids=["vanilla", "verl_weights", "plugin_from_log_probs", "plugin_from_weights", "tis_geo_rs"],
)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_verl_policy_loss_is_device_clean(user, extra, validates, agg):
    old, lp0, adv, mask, rollout = _verl_batch(23)
    kwargs = {}
    if extra.get("weights"):
        kwargs["rollout_is_weights"] = torch.exp(old - rollout) * mask
    if extra.get("log_probs"):
        kwargs["rollout_log_probs"] = rollout
    fn = VerlPolicyLoss(user)

    def run():
        lp = lp0.clone().requires_grad_(True)
        with count_host_syncs() as syncs:
            loss, metrics = fn(old, lp, adv, mask, agg, ACTOR, **kwargs)
        loss.backward()
        return (loss.detach(), metrics, lp.grad), _sync_files(syncs)

    (got, files), (want, _) = run_guarded_and_plain(run)
    assert_identical(got, want)
    validation = ["nemo_is_plugin/adapters/verl/correction.py"] * validates  # the check that no valid weight is 0
    assert files == sorted(["nemo_is_plugin/loss/metrics.py"] + validation)
    assert got[1]["actor/ppo_kl"] == pytest.approx(float(((old - lp0) * mask).sum() / (mask.sum() + 1e-8)), rel=1e-6)


def test_verl_tuple_form_returns_tensors_on_the_inputs_device(monkeypatch):
    """verl <= 0.5 expects (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower) as tensors: on the inputs' device."""
    monkeypatch.setattr(verl_module, "_returns_tuple", lambda: True)
    old, lp0, adv, mask, _ = _verl_batch(24)
    fn = VerlPolicyLoss({})

    def run():
        return fn(old, lp0.clone().requires_grad_(True), adv, mask, "token-mean", ACTOR)

    got, want = run_guarded_and_plain(run)
    assert len(got) == 4 and all(t.device == lp0.device for t in got)
    assert_identical([t.detach() for t in got], [t.detach() for t in want])
