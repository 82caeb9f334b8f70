"""verl score-centering golden cases (tests/data/golden/verl_score_centering, produced by verl's own
``score_centering_logits_processor`` + bypass-mode REINFORCE at verl-project/verl c6236f51) through the verl adapter
with verl's own key names: the case's ``rollout_correction`` dict (``score_centering: true``, ``rollout_is``,
``rollout_is_threshold``, ``bypass_mode``, ``loss_type``) under ``policy_loss.nemo_is``, its ``global_batch_info`` and
``loss_agg_mode``, and verl's batch fields ``rollout_topk_ids`` / ``rollout_topk_log_probs``; the trainer's label and
head log-probs come from one log-softmax of the stored logits. Checked at the suite README's tolerances: the loss,
d loss / d logits, and every metric verl reports under its own name (``actor/ppo_kl``, ``actor/sc_correction``,
``rollout_corr/*``, and ``ppo_loss``'s ``actor/sc_*_head_mass``).

Where the plugin differs from verl (docs/verl.md, *Score centering*), the test pins the difference instead:
-inf head slots (an empty slot here, a zero-mass head member in verl: replacing -inf by a finite log-prob whose
probability is 0 in float32 reproduces verl exactly), score centering with a rejection rule (refused here), and
verl's two refusals (refused here too, for the plugin's reason).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.golden_utils import case_ids, load_named_cases
from helpers.golden_verl_sc import (
    ACTOR,
    ATOL,
    RTOL,
    adapter_call,
    assert_like_verl,
    neg_inf_slots,
    plugin_refuses,
)

from nemo_is_plugin.adapters.verl import VerlPolicyLoss
from nemo_is_plugin.config import ConfigError

CASES = load_named_cases("verl_score_centering")
ERRORS = [c for c in CASES if "error" in c["expected"]]
REJECTION = [c for c in CASES if plugin_refuses(c)]
NEG_INF = [c for c in CASES if "error" not in c["expected"] and neg_inf_slots(c)]
SAME = [c for c in CASES if "error" not in c["expected"] and c not in REJECTION and c not in NEG_INF]


def test_suite_shape():
    assert len(CASES) == 25 and [c["id"] for c in ERRORS] == ["case_023", "case_024"]
    assert [c["id"] for c in NEG_INF] == ["case_008", "case_009", "case_010"]
    assert [c["id"] for c in REJECTION] == ["case_020"] and len(SAME) == 19


@pytest.mark.parametrize("case", SAME, ids=case_ids(SAME))
def test_loss_gradient_and_metrics_match_verl(case):
    assert_like_verl(case, *adapter_call(case))


@pytest.mark.parametrize("case", NEG_INF, ids=case_ids(NEG_INF))
def test_neg_inf_slots_are_empty_here_and_zero_mass_head_members_in_verl(case):
    q = case["inputs"]["rollout_topk_log_probs"]
    empty = torch.isinf(q)
    assert empty.any()
    # verl's reading: the slot's id stays in the head with q = 0 (exp(-1e4) is 0 in float32)
    assert_like_verl(case, *adapter_call(case, head_log_probs=torch.where(empty, torch.full_like(q, -1e4), q)))
    # the plugin's: no mass, no gradient; the trainer mass at those ids moves to the modelled tail
    loss, grad, metrics = adapter_call(case)
    want = case["expected"]
    assert not torch.allclose(grad, want["grad_logits"], rtol=RTOL, atol=ATOL)
    assert metrics["actor/sc_train_head_mass"] < want["ppo_loss_metrics"]["actor/sc_train_head_mass"] - 1e-4
    assert metrics["actor/sc_sampler_head_mass"] == pytest.approx(
        want["ppo_loss_metrics"]["actor/sc_sampler_head_mass"], rel=RTOL, abs=ATOL
    )
    assert math.isfinite(float(loss))


@pytest.mark.parametrize("case", REJECTION, ids=case_ids(REJECTION))
def test_score_centering_with_rejection_is_refused_here(case):
    with pytest.raises(ConfigError, match=r"score_centering with importance_sampling_rejection_rules"):
        adapter_call(case)


@pytest.mark.parametrize(
    "case, match",
    [
        (ERRORS[0], r"is_correction_level='sequence'"),
        (ERRORS[1], r"old_policy_logprobs='generation'.*disable_ppo_ratio"),
    ],
    ids=["rollout_is_sequence", "bypass_ppo_clip"],
)
def test_verls_refusals_are_refusals_here(case, match):
    assert case["expected"]["error"]["raises"] == "ValueError"
    with pytest.raises(ConfigError, match=match):
        adapter_call(case)


def test_verls_own_term_and_a_head_without_score_centering_are_refused():
    case = SAME[0]
    with pytest.raises(ConfigError, match="sc_correction is verl's own centring term"):
        VerlPolicyLoss()(
            *(case["inputs"][k] for k in ("rollout_log_probs", "rollout_log_probs", "advantages", "response_mask")),
            "token-mean",
            {**ACTOR, "policy_loss": {"nemo_is": {"rollout_correction": dict(case["params"]["rollout_correction"])}}},
            sc_correction=torch.zeros(3, 7),
        )
    off = {**case["params"]["rollout_correction"], "score_centering": False}
    with pytest.raises(ConfigError, match="rollout_topk_ids given but score centering is off"):
        VerlPolicyLoss()(
            *(case["inputs"][k] for k in ("rollout_log_probs", "rollout_log_probs", "advantages", "response_mask")),
            "token-mean",
            {**ACTOR, "policy_loss": {"nemo_is": {"rollout_correction": off}}},
            rollout_topk_ids=case["inputs"]["rollout_topk_ids"],
        )


def test_verls_key_maps_to_the_plugins_and_composes_beyond_verls_bypass_mode():
    from nemo_is_plugin.adapters.verl import verl_config
    from nemo_is_plugin.adapters.verl.config import rollout_correction_keys

    rc = {"rollout_is": "token", "rollout_is_threshold": "0.5_5.0"}
    assert "score_centering" not in rollout_correction_keys(rc)
    keys = rollout_correction_keys({**rc, "score_centering": True})
    assert keys["score_centering"] is True and keys["truncated_importance_sampling_type"] == "icepop"
    # decoupled PPO (bypass_mode: false), which verl refuses with score centering: the plugin's PPO against pi_old
    cfg = verl_config(keys, ACTOR, "token-mean", horizon=7, weights_only=False)
    assert cfg.score_centering and cfg.policy_objective == "ppo_clip" and cfg.old_policy_logprobs == "prev"


def test_a_missing_head_tensor_is_named_in_verls_words():
    case = SAME[0]
    inputs = case["inputs"]
    with pytest.raises(ConfigError, match=r"got no topk_log_probs"):
        VerlPolicyLoss()(
            *(inputs[k] for k in ("rollout_log_probs", "rollout_log_probs", "advantages", "response_mask")),
            "token-mean",
            {**ACTOR, "policy_loss": {"nemo_is": {"rollout_correction": dict(case["params"]["rollout_correction"])}}},
            rollout_topk_ids=inputs["rollout_topk_ids"],
            rollout_topk_log_probs=inputs["rollout_topk_log_probs"],
        )
