"""Backward compatibility: every NeMo-RL golden case (tests/data/golden/nemo_rl, produced by NeMo-RL's own
ClippedPGLossFn at commit 7ea279ab) is reproduced: loss, gradient w.r.t. the log-probs, every metric, rejections."""

from __future__ import annotations

import builtins
import re

import pydantic
import pytest
import torch
from helpers.golden_utils import case_ids, load_cases, metric_close

from nemo_is_plugin import build_loss_fn
from nemo_is_plugin.config import ConfigValidationError

CASES = load_cases("nemo_rl")
VALID = [c for c in CASES if "error" not in c["expected"]]
REJECTED = [c for c in CASES if "error" in c["expected"]]


@pytest.mark.parametrize("case", VALID, ids=case_ids(VALID))
def test_golden_case(case):
    x = case["inputs"]["next_token_logprobs"].clone().requires_grad_(True)
    data = {k: v for k, v in case["inputs"].items() if k != "next_token_logprobs"}
    loss_fn = build_loss_fn(case["config"])
    loss, metrics = loss_fn(
        next_token_logprobs=x,
        data=data,
        global_valid_seqs=case["global_valid_seqs"],
        global_valid_toks=case["global_valid_toks"],
    )
    want = case["expected"]
    torch.testing.assert_close(loss.detach(), want["loss"].to(loss.dtype), rtol=1e-4, atol=1e-6)
    if loss.requires_grad:
        (grad,) = torch.autograd.grad(loss, x, allow_unused=True)
        grad = torch.zeros_like(x) if grad is None else grad
    else:
        grad = torch.zeros_like(x)
    torch.testing.assert_close(grad, want["grad_next_token_logprobs"], rtol=1e-4, atol=1e-6)
    bad = {
        k: (metrics.get(k), v)
        for k, v in want["metrics"].items()
        if k not in metrics or not metric_close(k, metrics[k], v)
    }
    assert not bad, f"{case['id']} {case['description']}: metric mismatches (got, want): {bad}"


@pytest.mark.parametrize("case", REJECTED, ids=case_ids(REJECTED))
def test_rejected_config(case):
    """NeMo-RL rejects these (AssertionError / ValueError at init, or at the first call for ratio_clip_c <= 1 and
    kl type k4); the plugin rejects them all at construction with a ConfigValidationError naming the field, which is
    also pydantic's ValidationError and the exception type NeMo-RL raised, so NeMo-RL's ``pytest.raises`` match."""
    with pytest.raises(ConfigValidationError) as err:
        build_loss_fn(case["config"])
    assert isinstance(err.value, (pydantic.ValidationError, AssertionError, ValueError))
    assert isinstance(err.value, getattr(builtins, case["expected"]["error"]))
    message = str(err.value)
    named = [k for k, v in case["config"].items() if k in message]
    assert named, f"error message names no config field: {message}"


# NeMo-RL's messages the plugin's contain word for word (NeMo-RL's own tests match the first one with pytest.raises).
NEMO_RL_WORDING = {"case_100", "case_101", "case_097", "case_110", "case_112", "case_113"}


@pytest.mark.parametrize("case", [c for c in REJECTED if c["id"] in NEMO_RL_WORDING], ids=sorted(NEMO_RL_WORDING))
def test_nemo_rl_wording_kept(case):
    with pytest.raises(AssertionError, match=re.escape(case["expected"]["message"])):
        build_loss_fn(case["config"])
