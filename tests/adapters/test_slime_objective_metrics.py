"""The policy objectives' own metrics in slime's metric dictionary (``adapters/slime/metrics.py``), on slime's call
model (``slime_host``) and a golden case's batch: M2PO's second moment and bounds against a float64 reference written
here from the batch, reduced as slime's ``sum_of_sample_mean`` reduces every metric; slime's --eps-clip flags left out
under another objective."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.golden_utils import GOLDEN

from adapters.slime_host import loss_function, namespace
from nemo_is_plugin.adapters.slime import SlimePolicyLoss
from nemo_is_plugin.adapters.slime.config import policy_config
from nemo_is_plugin.adapters.slime.metrics import SlimeObjectiveBook
from nemo_is_plugin.loss.layout import TokenLayout

CASE = torch.load(sorted((GOLDEN / "slime" / "policy").glob("case_*.pt"))[0], weights_only=True)
M2PO_NAMES = ("harmful_fraction", "harmful_log_ratio_sq", "capped_log_ratio_sq", "clip_low_mean", "clip_high_mean")
M2PO_NAMES += ("m2", "m2_after")


def _call(nemo_is: dict) -> dict[str, float]:
    args = namespace(CASE["args"], nemo_is=nemo_is, eps_clip_high=0.28)
    logits = CASE["logits"].clone().double().requires_grad_(True)
    _, _, metrics = loss_function(
        SlimePolicyLoss(), args, CASE["batch"], logits, num_microbatches=1, step_global_batch_size=4
    )
    return {k: float(v) for k, v in metrics.items()}


def _reference() -> tuple[float, float]:
    """(M2 of the batch's harmful tokens, the factor slime's reducer gives a per-call constant: sum_i n_i / d_i)."""
    batch, logits = CASE["batch"], CASE["logits"][0].double()
    offset, deltas, factor = 0, [], 0.0
    for i, (total, response) in enumerate(zip(batch["total_lengths"], batch["response_lengths"], strict=True)):
        prompt = total - response
        rows = logits[offset + prompt - 1 : offset + total - 1].log_softmax(-1)
        c = rows.gather(1, batch["unconcat_tokens"][i][prompt:total].long().unsqueeze(1))[:, 0]
        mask = batch["loss_masks"][i].bool()
        delta = batch["log_probs"][i].double() - c
        adv = batch["advantages"][i].double()
        first = float(adv[mask][0]) if mask.any() else 0.0
        ratio = torch.exp(-delta)
        harmful = mask & (((first > 1e-12) & (ratio > 1 + 1e-12)) | ((first < -1e-12) & (ratio < 1 - 1e-12)))
        deltas.append(delta[harmful])
        factor += float(mask.sum()) / max(float(batch["rollout_mask_sums"][i]), 1.0)
        offset += total
    d2 = torch.cat(deltas).square()
    return float(d2.mean()), factor


def test_m2po_metrics_reach_slime_with_the_calls_statistic():
    m2, factor = _reference()
    assert m2 > 0 and factor > 0
    unbounded = _call({"policy_objective": "m2po", "m2po_budget": 1e9})
    for name in M2PO_NAMES:
        assert f"nemo_is/m2po_{name}" in unbounded and math.isfinite(unbounded[f"nemo_is/m2po_{name}"]), name
    # a per-call value v reaches slime as sum_i v n_i / d_i (slime then divides by the step's samples)
    assert unbounded["nemo_is/m2po_m2"] == pytest.approx(m2 * factor, rel=1e-6)
    assert unbounded["nemo_is/m2po_m2_after"] == pytest.approx(m2 * factor, rel=1e-6)  # nothing capped
    assert unbounded["nemo_is/m2po_clip_high_mean"] == pytest.approx(99999.0 * factor, rel=1e-6)
    bounded = _call({"policy_objective": "m2po", "m2po_budget": m2 / 4})
    assert bounded["nemo_is/m2po_m2"] == pytest.approx(m2 * factor, rel=1e-6)
    assert bounded["nemo_is/m2po_m2_after"] < bounded["nemo_is/m2po_m2"]
    assert 0 < bounded["nemo_is/m2po_clip_high_mean"] < factor  # eps_high = e^tau - 1 < 1 here
    assert list(bounded) == list(unbounded)  # the same names in the same order on every call (slime adds by position)


def test_ppo_clip_adds_no_objective_metric():
    assert not [k for k in _call({}) if k.startswith("nemo_is/m2po") or k.startswith("nemo_is/cppo")]


def test_another_objective_leaves_slimes_clip_flags_out():
    args = namespace(CASE["args"], eps_clip=0.1, eps_clip_high=0.28, eps_clip_c=3.0)
    cfg = policy_config(args, {"policy_objective": "m2po"})
    assert cfg.policy_objective == "m2po"
    assert (cfg.ratio_clip_min, cfg.ratio_clip_max, cfg.ratio_clip_c) == (0.2, 0.2, None)  # the loss's defaults
    assert policy_config(args, {}).ratio_clip_max == 0.28  # PPO's clip keeps slime's flags


def test_extrema_over_tokens_have_no_slime_reduction():
    layout = TokenLayout.packed([0, 3])
    book = SlimeObjectiveBook(layout, torch.ones(3), lambda x: x.sum(), "nemo_is/")
    with pytest.raises(NotImplementedError, match="no slime reduction"):
        book.extrema("x", torch.arange(3.0), torch.ones(3, dtype=torch.bool))


def test_cppo_metrics_reach_slime():
    got = _call({"policy_objective": "cppo"})
    names = ("bound_fraction", "exhausted_seq_fraction", "rate_mean", "exhausted_position_fraction")
    for name in names:
        assert math.isfinite(got[f"nemo_is/cppo_budget_{name}"]), name
    # per-sample fractions reduced with slime's per-sample means: within [0, sum_i n_i / d_i]
    _, factor = _reference()
    assert 0 <= got["nemo_is/cppo_budget_exhausted_position_fraction"] <= factor + 1e-9
