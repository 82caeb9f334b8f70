"""tools/golden/verl_score_centering.py without a verl checkout: ``--init``'s case list (build_cases) redraws the
committed suite's configs and inputs exactly, and ``redraw`` (``--fresh``) keeps a case's config, mask layout and
head shape while drawing new values that are a function of the seed."""

from __future__ import annotations

import math

import torch

from tools.golden import common, verl_score_centering

COMMITTED = {p.stem: common.load_case(p) for p in common.case_paths(common.GOLDEN / "verl_score_centering")}


def test_build_cases_is_the_committed_suite_minus_the_reference_outputs():
    built = verl_score_centering.build_cases()
    assert [c["id"] for c in built] == sorted(COMMITTED)
    for case in built:
        want = {k: v for k, v in COMMITTED[case["id"]].items() if k != "expected"}
        assert not common.diff_values(case, want, (), lambda _: (0.0, 0.0)), case["id"]


def test_inputs_are_a_sampler_head_over_the_response():
    for case in COMMITTED.values():
        inp, k = case["inputs"], case["params"]["topk_log_probs"]
        mask = inp["response_mask"].bool()
        q = inp["rollout_topk_log_probs"]
        assert inp["rollout_topk_ids"].dtype == torch.int32 and q.shape == (*mask.shape, k)
        finite = torch.where(torch.isfinite(q), q, torch.full_like(q, -math.inf))
        assert bool((finite.exp().sum(-1)[mask] <= 1 + 1e-5).all())  # full-vocabulary log-probs: a sub-distribution
        assert bool((inp["advantages"][~mask] == 0).all())
        dummy = torch.arange(k, dtype=torch.int32).expand(*mask.shape, k)
        assert torch.equal(inp["rollout_topk_ids"][~mask], dummy[~mask])  # verl's dummy head outside the response


def test_redraw_keeps_the_config_and_layout_and_follows_the_seed():
    template = COMMITTED["case_014"]  # an empty row and interior zeros

    def fresh(seed: int) -> dict:
        case = {k: v for k, v in template.items() if k != "expected"}
        case = {**case, "params": dict(case["params"]), "inputs": dict(case["inputs"])}
        return verl_score_centering.redraw(case, torch.Generator().manual_seed(seed), seed, "case_014")

    a, b, c = fresh(3), fresh(3), fresh(4)
    assert torch.equal(a["inputs"]["logits"], b["inputs"]["logits"])
    assert not torch.equal(a["inputs"]["logits"], c["inputs"]["logits"])
    assert torch.equal(a["inputs"]["response_mask"], template["inputs"]["response_mask"])
    assert a["params"]["rollout_correction"] == template["params"]["rollout_correction"]
    assert a["params"]["global_batch_info"]["batch_num_tokens"] == int(template["inputs"]["response_mask"].sum())
    assert a["params"]["seed"] == 3 and "fresh inputs (seed 3)" in a["description"]
