"""What a verl user's dashboards read, against verl 0.9 itself: every ``rollout_corr/`` metric verl's
``compute_rollout_correction_and_rejection_mask`` logs and every ``actor/`` metric of verl's ``vanilla`` policy loss,
from the plugin's verl adapter on the same inputs (ragged masks with an empty and a one-token row, log-ratios beyond
+-20); the ``rollout_corr/`` extrema under ``<name>_micro_batch_mean``, what verl's step makes of a policy loss's
metric. Skipped where verl does not import (the Python 3.13 tier has no verl)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

rollout_corr_helper = pytest.importorskip(
    "verl.trainer.ppo.rollout_corr_helper", reason="verl is not importable (pip install 'nemo-is-plugin[verl]')"
)
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.workers.config.actor import ActorConfig  # noqa: E402

from nemo_is_plugin.adapters.verl import VerlPolicyLoss  # noqa: E402
from nemo_is_plugin.adapters.verl.config import rollout_correction_keys  # noqa: E402
from nemo_is_plugin.adapters.verl.metrics import PREFIX, for_verl_step, verl_step_name  # noqa: E402

B, T = 8, 9
# verl's algorithm.rollout_correction settings; the plugin gets their mapping (verl_config.rollout_correction_keys)
SETTINGS = {
    "token_tis": {"rollout_is": "token", "rollout_is_threshold": 2.0},
    "sequence_tis": {"rollout_is": "sequence", "rollout_is_threshold": 2.0},
    "token_icepop": {"rollout_is": "token", "rollout_is_threshold": "0.5_2.0"},
    "sequence_icepop_normalized": {
        "rollout_is": "sequence",
        "rollout_is_threshold": "0.5_5.0",
        "rollout_is_batch_normalize": True,
    },
    "token_tis_normalized_four_rs": {
        "rollout_is": "token",
        "rollout_is_threshold": 2.0,
        "rollout_is_batch_normalize": True,
        "rollout_rs": "token_k1,seq_sum_k3,seq_mean_k2,seq_max_k3",
        "rollout_rs_threshold": "0.6_1.5,2.0,0.1,1.0",
    },
    "rs_only": {"rollout_is": None, "rollout_rs": "seq_mean_k1,token_k2", "rollout_rs_threshold": "0.8_1.25,0.3"},
}


def _batch(beyond_20: bool) -> dict[str, torch.Tensor]:
    """float64 log-probs; a ragged mask with a full, an empty and a one-token row; with ``beyond_20``, valid tokens
    whose log pi_old - log mu and log pi - log pi_old lie beyond +-20 (verl's clamp)."""
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 0.5
    rollout = old - 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    log_prob = old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[1] = True
    mask[4] = False
    mask[6] = False
    mask[6, 0] = True
    if beyond_20:
        for (row, col), shift in {(0, 2): 25.0, (2, 1): -23.0, (7, 3): 21.0}.items():
            rollout[row, col] = old[row, col] - shift
            mask[row, col] = True
        for (row, col), shift in {(3, 0): 24.0, (5, 2): -26.0}.items():
            log_prob[row, col] = old[row, col] + shift
            mask[row, col] = True
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    return {"old": old, "rollout": rollout, "log_prob": log_prob, "adv": adv, "mask": mask}


def _actor(agg: str = "token-mean") -> ActorConfig:
    cfg = ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        loss_agg_mode=agg,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
    )
    cfg.global_batch_info.update(dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None)
    return cfg


def _plugin(keys: dict, batch: dict, agg: str = "token-mean", rows: slice = slice(None)) -> dict[str, float]:
    fn = VerlPolicyLoss(dict(keys))
    with warnings.catch_warnings():  # the +-20 shifts make some log-probs positive: the loss's input warning
        warnings.simplefilter("ignore", UserWarning)
        _, metrics = fn(
            old_log_prob=batch["old"][rows],
            log_prob=batch["log_prob"][rows].clone().requires_grad_(True),
            advantages=batch["adv"][rows],
            response_mask=batch["mask"][rows],
            loss_agg_mode=agg,
            config=_actor(agg),
            rollout_log_probs=batch["rollout"][rows],
        )
    return metrics


def _verl(settings: dict, batch: dict, rows: slice = slice(None)) -> dict[str, float]:
    _, _, metrics = rollout_corr_helper.compute_rollout_correction_and_rejection_mask(
        batch["old"][rows], batch["rollout"][rows], batch["mask"][rows].double(), **settings
    )
    return metrics


def _chi2_unclamped(batch: dict) -> dict[str, float]:
    """The plugin's documented chi-square (verl clamps x at +-20 first): E_tok[e^2x] - 1, mean_rows e^2S - 1."""
    x, m = batch["old"] - batch["rollout"], batch["mask"].double()
    s = (x * m).sum(-1)
    return {
        "chi2_token": float((torch.exp(2 * x) * m).sum() / m.sum()) - 1,
        "chi2_seq": float(torch.exp(2 * s).mean()) - 1,
    }


@pytest.mark.parametrize("beyond_20", [False, True], ids=["within_20", "beyond_20"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_every_rollout_corr_metric_is_verls(name, beyond_20):
    """The adapter reports every rollout_corr/ metric verl logs, each at verl's value on the call's batch, under verl's
    name or, for an extremum, ``<name>_micro_batch_mean``; the one documented difference is chi-square with log-ratios
    beyond 20 (verl clamps them; the plugin's value is the unclamped formula)."""
    settings, batch = SETTINGS[name], _batch(beyond_20)
    want = for_verl_step(_verl(settings, batch))
    got = {k: v for k, v in _plugin(rollout_correction_keys(settings), batch).items() if k.startswith(PREFIX)}
    assert sorted(got) == sorted(want)
    unclamped = _chi2_unclamped(batch)
    bad = {}
    for key, value in want.items():
        short = key[len(PREFIX) :]
        if beyond_20 and short in unclamped:
            assert not math.isclose(value, unclamped[short], rel_tol=1e-3)  # the clamp matters here
            value = unclamped[short]
        if not math.isclose(got[key], value, rel_tol=1e-6, abs_tol=1e-9):
            bad[key] = (got[key], value)
    assert not bad, bad
    if settings["rollout_is"] is not None:  # the statistics the brief's verl user missed are among them
        names = ("mean", "std", "min_micro_batch_mean", "max_micro_batch_mean", "eff_sample_size")
        assert {f"{PREFIX}rollout_is_{s}" for s in names} <= set(got)
    names = ("training_ppl", "rollout_ppl", "ppl_ratio", "log_ppl_diff_max_micro_batch_mean")
    assert {f"{PREFIX}{s}" for s in names} <= set(got)
    # no name promises an extremum: verl's ppo_loss averages every policy-loss metric over micro-batches
    assert not [k for k in got if k.endswith(("_max", "_min", "_max_deviation"))]


def test_inputs_reach_the_edges_they_are_meant_to():
    """The ragged mask has an empty row and a one-token row, and the shifted log-ratios are valid tokens."""
    batch = _batch(beyond_20=True)
    counts = batch["mask"].sum(-1)
    assert 0 in counts.tolist() and 1 in counts.tolist() and T in counts.tolist()
    x = (batch["old"] - batch["rollout"])[batch["mask"]]
    r = (batch["log_prob"] - batch["old"])[batch["mask"]]
    assert x.max() > 20 and x.min() < -20 and r.max() > 20 and r.min() < -20


@pytest.mark.parametrize("beyond_20", [False, True], ids=["within_20", "beyond_20"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("owned", [False, True], ids=["verl_settings", "plugin_owned"])
def test_actor_metrics_are_verls_vanilla(agg, owned, beyond_20):
    """actor/pg_clipfrac, actor/ppo_kl (log pi - log pi_old clamped to +-20 before the mean, as verl) and
    actor/pg_clipfrac_lower: verl's vanilla loss's values, with or without the plugin owning the correction."""
    batch = _batch(beyond_20)
    _, want = core_algos.compute_policy_loss_vanilla(
        old_log_prob=batch["old"],
        log_prob=batch["log_prob"],
        advantages=batch["adv"],
        response_mask=batch["mask"],
        loss_agg_mode=agg,
        config=_actor(agg),
    )
    keys = rollout_correction_keys(SETTINGS["token_tis"]) if owned else {}
    got = _plugin(keys, batch, agg)
    actor = {k for k in got if k.startswith("actor/") and not k.startswith("actor/nemo_is/")}
    assert actor == set(want)
    for key, value in want.items():
        assert math.isclose(got[key], value, rel_tol=1e-6, abs_tol=1e-9), (key, got[key], value)


@pytest.mark.parametrize("metric", ["training_ppl", "rollout_ppl", "ppl_ratio", "training_log_ppl", "log_ppl_diff"])
def test_row_means_average_to_the_batch_value_over_equal_micro_batches(metric):
    """The documented scope: verl averages the policy loss's metrics over micro-batches; for a mean over rows, two
    micro-batches of equal row counts average to verl's whole-batch value (one driver call)."""
    batch, settings = _batch(beyond_20=True), SETTINGS["token_tis"]
    keys = rollout_correction_keys(settings)
    halves = [_plugin(keys, batch, rows=rows)[PREFIX + metric] for rows in (slice(0, B // 2), slice(B // 2, B))]
    assert math.isclose(sum(halves) / 2, _verl(settings, batch)[PREFIX + metric], rel_tol=1e-7)


def test_a_rule_verl_has_no_option_for_reports_under_the_plugins_names_only():
    """prob_diff (no rollout_rs option in verl) beside verl's own rules: its metrics are the plugin's
    actor/nemo_is/is_rejection_token_prob_diff_*; verl's rules keep their rollout_corr/ names and values; the combined
    rollout_rs_masked_fraction / _seq_masked_fraction are left out (verl's would not count the prob_diff rule)."""
    settings, batch = SETTINGS["rs_only"], _batch(beyond_20=False)
    keys = rollout_correction_keys(settings)
    keys["importance_sampling_rejection_rules"] = [
        *keys["importance_sampling_rejection_rules"],
        {"statistic": "prob_diff", "aggregation": "token", "max": 0.15},
    ]
    metrics = _plugin(keys, batch)
    combined = {f"{PREFIX}rollout_rs_masked_fraction", f"{PREFIX}rollout_rs_seq_masked_fraction"}
    want = {k: v for k, v in for_verl_step(_verl(settings, batch)).items() if k not in combined}
    got = {k: v for k, v in metrics.items() if k.startswith(PREFIX)}
    assert sorted(got) == sorted(want)
    assert all(math.isclose(got[k], v, rel_tol=1e-6, abs_tol=1e-9) for k, v in want.items())
    ours = "actor/nemo_is/is_rejection_token_prob_diff_"
    names = ("mean", "min_micro_batch_mean", "max_micro_batch_mean", "rejected_fraction", "rejected_seq_fraction")
    assert {ours + s for s in names} <= set(metrics)
    assert 0 < metrics[ours + "rejected_fraction"] < 1
    # verl's two rules reject nothing on this batch (their rollout_rs_*_masked_fraction above are verl's 0), so the
    # plugin's combined fraction is the prob_diff rule's, which verl's combined fraction would have missed
    assert metrics["actor/nemo_is/is_rejection_rejected_fraction"] == metrics[ours + "rejected_fraction"]
    assert {want[f"{PREFIX}rollout_rs_{o}_masked_fraction"] for o in ("seq_mean_k1", "token_k2")} == {0.0}


def test_m2po_reaches_verl_with_its_derived_metrics_and_extrema_named_for_verls_mean():
    """verl averages every policy-loss metric over micro-batches and DP ranks: the plugin's extrema reach it as
    ``<name>_micro_batch_mean`` (never under a name that promises an extremum), and M2PO's derived M2 / M2_after
    (the mean squared log-ratio over the harmful tokens, before and after the cap) are there, computed from the same
    call's sums."""
    batch = _batch(beyond_20=False)
    metrics = _plugin({"policy_objective": "m2po", "m2po_budget": 0.04, "reference_policy_kl_penalty": 0.0}, batch)
    ours = "actor/nemo_is/"
    assert not [k for k in metrics if k.startswith(ours) and k.endswith(("_min", "_max"))]
    assert {ours + f"m2po_clip_{s}_micro_batch_mean" for s in ("low_min", "low_max", "high_min", "high_max")} <= set(
        metrics
    )
    fraction = metrics[ours + "m2po_harmful_fraction"]
    assert 0 < fraction < 1
    m2 = metrics[ours + "m2po_harmful_log_ratio_sq"] / fraction
    assert math.isclose(metrics[ours + "m2po_m2"], m2, rel_tol=1e-12)
    # the budget binds on this batch: the capped moment is within it, below the uncapped one
    assert metrics[ours + "m2po_m2_after"] <= 0.04 + 1e-12 < m2
    # and by hand: the harmful tokens' mean squared log-ratio (A of the row's first valid token, r = pi / pi_old)
    delta = batch["old"] - batch["log_prob"]
    first = batch["mask"].double().argmax(-1)
    adv0 = batch["adv"].gather(1, first[:, None]).expand_as(delta)
    ratio = (-delta).exp()
    harmful = batch["mask"] & (((adv0 > 1e-12) & (ratio > 1 + 1e-12)) | ((adv0 < -1e-12) & (ratio < 1 - 1e-12)))
    assert math.isclose(metrics[ours + "m2po_m2"], (delta[harmful] ** 2).mean().item(), rel_tol=1e-9)


def test_rollout_corr_extrema_are_named_for_the_mean_verl_makes_of_them():
    """Each rollout_corr/ extremum (verl's ``_max`` / ``_min`` / ``_max_deviation`` of the IS weights, the log-ppl
    difference and each rejection statistic) is the call's extremum, reported as ``<name>_micro_batch_mean``: verl's
    ppo_loss averages it over micro-batches and DP ranks, so over two equal micro-batches verl logs the mean of their
    maxima, which is not the batch's maximum (verl's driver value on the whole batch) under a name claiming one."""
    settings, batch = SETTINGS["token_tis_normalized_four_rs"], _batch(beyond_20=False)
    keys = rollout_correction_keys(settings)
    verl_names = set(_verl(settings, batch))
    extrema = {k for k in verl_names if k.endswith(("_max", "_min", "_max_deviation"))}
    options = ("token_k1", "seq_sum_k3", "seq_mean_k2", "seq_max_k3")
    by_hand = {"rollout_is_max", "rollout_is_min", "rollout_is_seq_max", "rollout_is_seq_min"}
    by_hand |= {"rollout_is_seq_max_deviation", "log_ppl_diff_max", "log_ppl_diff_min"}
    by_hand |= {f"rollout_rs_{o}_{s}" for o in options for s in ("max", "min", "seq_max", "seq_min")}
    by_hand |= {f"rollout_rs_{o}_seq_max_deviation" for o in options}
    assert extrema == {PREFIX + k for k in by_hand}
    assert {verl_step_name(k) for k in extrema} == {PREFIX + k + "_micro_batch_mean" for k in by_hand}
    assert verl_step_name(PREFIX + "rollout_rs_seq_max_k3_mean") == PREFIX + "rollout_rs_seq_max_k3_mean"
    assert verl_step_name("actor/nemo_is/is_weight_max") == "actor/nemo_is/is_weight_max"  # outside rollout_corr/
    parts = (slice(0, B // 2), slice(B // 2, B))
    name = PREFIX + "rollout_is_max"
    per_call = [_plugin(keys, batch, rows=rows)[verl_step_name(name)] for rows in parts]
    assert per_call == pytest.approx([_verl(settings, batch, rows)[name] for rows in parts])
    whole = _verl(settings, batch)[name]
    assert max(per_call) == pytest.approx(whole)  # the batch's max is the larger call's ...
    assert sum(per_call) / 2 < whole - 1e-3  # ... and the mean verl logs is below it
