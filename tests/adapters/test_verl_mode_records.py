"""verl's loss modes as one record each (adapters/verl/loss_modes.VerlMode): the tables read elsewhere are derived
from the records and equal what verl 0.9.1's losses do (pinned here as written before the records), the reverse map
finds every mode from its resolved config, and the policy loss's cache key comes from the records: a new field of a
mode reaches it without touching policy_loss.py, so resolve never serves a loss built from a stale setting."""

from __future__ import annotations

import dataclasses

import pytest

from nemo_is_plugin.adapters.verl import VerlPolicyLoss, loss_modes, verl_config
from nemo_is_plugin.adapters.verl.loss_modes import (
    FORCED_AGGREGATION,
    MODE_READS,
    VERL_ALL_ROWS_OBJECTIVES,
    VERL_CLIPFRAC_METRICS,
    VERL_METRIC_NAMES,
    VERL_MODE_METRICS,
    VERL_MODES,
    loss_mode_keys,
    verl_loss_mode_of,
    verl_mode_settings,
)


def _actor(mode: str = "vanilla", **fields) -> dict:
    return {
        "clip_ratio": 0.2,
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.28,
        "clip_ratio_c": 3.0,
        "policy_loss": {"dro_beta": 0.5 if mode == "dro" else None, "nemo_is": {"loss_mode": mode}},
        **fields,
    }


def test_the_derived_tables_are_verls():
    assert tuple(VERL_MODES) == ("vanilla", "gspo", "cispo", "dppo_tv", "dppo_kl", "sapo", "geo_mean", "gpg", "dro")
    assert FORCED_AGGREGATION == {"sapo": "seq-mean-token-mean", "geo_mean": "seq-mean-token-mean"}
    assert MODE_READS["sapo"] == ("tau_pos", "tau_neg") and MODE_READS["dro"] == ("dro_beta",)
    clamped = {"vanilla", "cispo", "dppo_tv", "dppo_kl", "sapo"}  # verl's ppo_kl of the clamped log-ratio
    want = {m: (VERL_METRIC_NAMES, m in clamped) for m in ("vanilla", "cispo", "dppo_tv", "dppo_kl", "sapo")}
    want |= {"gspo": (VERL_METRIC_NAMES, False), "geo_mean": (VERL_METRIC_NAMES, False)}
    want |= {"dro": (("actor/ppo_kl",), False), "gpg": ((), False)}
    assert VERL_MODE_METRICS == want
    assert VERL_CLIPFRAC_METRICS == {"gmpo": ("clip_fraction_high", "clip_fraction_low")}
    assert VERL_ALL_ROWS_OBJECTIVES == ("gmpo",)
    assert loss_mode_keys(_actor(), "dppo_tv")["dppo_ratio_cap"] == 3.0  # the actor's clip_ratio_c
    assert loss_mode_keys({}, "dppo_tv")["dppo_ratio_cap"] == 20.0  # verl's DPPO default, not vanilla's 3.0
    assert loss_mode_keys({}, "vanilla")["ratio_clip_c"] == 3.0


@pytest.mark.parametrize("mode", list(VERL_MODES))
def test_each_mode_is_found_again_from_its_resolved_config(mode):
    agg = FORCED_AGGREGATION.get(mode, "token-mean")
    config = verl_config({"loss_mode": mode}, _actor(mode), agg, 8, False)
    assert verl_loss_mode_of(config) == mode


def test_the_cache_key_reads_every_field_the_modes_read():
    paths = [path for path, _ in verl_mode_settings(_actor())]
    assert set(paths) == {
        "clip_ratio",
        "clip_ratio_low",
        "clip_ratio_high",
        "clip_ratio_c",
        "tau_pos",
        "tau_neg",
        "policy_loss.dro_beta",
    }
    assert dict(verl_mode_settings(_actor("dro")))["policy_loss.dro_beta"] == 0.5


def test_a_new_field_of_a_mode_changes_the_cache_key_without_touching_policy_loss(monkeypatch):
    """A mode that reads a new verl field (here sapo, ``sapo_scale``): two actors differing only in it resolve to two
    losses, each built from its own value; before the field is declared they share one (the field is not read)."""
    fn = VerlPolicyLoss()
    agg = "seq-mean-token-mean"
    a, b = _actor("sapo", sapo_scale=1.0), _actor("sapo", sapo_scale=2.0)
    assert fn.resolve(a, agg, 8) is fn.resolve(b, agg, 8)
    sapo = VERL_MODES["sapo"]

    def keys(low, high, reads):
        return {**sapo.keys(low, high, reads), "sapo_tau_pos": reads["tau_pos"] * reads["sapo_scale"]}

    scaled = dataclasses.replace(sapo, keys=keys, reads={**sapo.reads, "sapo_scale": 1.0})
    monkeypatch.setitem(loss_modes.VERL_MODES, "sapo", scaled)
    fn = VerlPolicyLoss()
    got_a, got_b = fn.resolve(a, agg, 8), fn.resolve(b, agg, 8)
    assert got_a is not got_b
    assert got_a.config.sapo_tau_pos == 1.0 and got_b.config.sapo_tau_pos == 2.0
    assert fn.resolve(_actor("sapo", sapo_scale=2.0), agg, 8) is got_b  # an equal setting still shares its loss
