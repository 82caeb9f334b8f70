"""Every ``policy_objective`` through fused_linear_pg_loss (hidden states and LM head, chunked) equals the naive path
(full logits -> log_softmax -> ClippedPGLoss): loss, every metric, dX and dW, composed with token / sequence-mean IS
weights and the KL term. The objectives whose per-token loss is local (DPPO TV / KL, prob_diff, SAPO, GPG, DRO) take
the single pass (the two-pass kernel is forbidden); GMPO and CPPO need whole sequences and take the two-pass schedule
(the single pass is forbidden, and refused when asked for). fp32 at 1e-5 as test_fused_linear_pg_loss; fp64 at 1e-10.
"""

from __future__ import annotations

import pytest
import torch

import nemo_is_plugin.distributed.entry_points.fused_linear_loss as fused_loss_module
import nemo_is_plugin.distributed.head.fused_linear as fused_linear_module
from nemo_is_plugin.apps.bench.paths import naive_logprobs

from ._fused_cases import LOCAL_OBJECTIVES as LOCAL
from ._fused_cases import SEQUENCE_OBJECTIVES as SEQUENCE
from ._fused_cases import assert_parity, forbid, fused, run
from ._fused_cases import objective_config as config
from ._fused_cases import pg_problem as problem


@pytest.mark.parametrize("single_pass", [None, True])
@pytest.mark.parametrize("name", LOCAL)
def test_local_objectives_take_the_single_pass(monkeypatch, name, single_pass):
    p, cfg = problem(), config(name)
    want = run(p, naive_logprobs, cfg)
    forbid(monkeypatch, fused_linear_module, "the two-pass fused_linear_logprobs")
    assert_parity(fused(p, cfg, single_pass=single_pass), want)


@pytest.mark.parametrize("name", SEQUENCE)
def test_sequence_objectives_take_the_two_pass_schedule(monkeypatch, name):
    p, cfg = problem(), config(name)
    want = run(p, naive_logprobs, cfg)
    forbid(monkeypatch, fused_loss_module, "the single pass")
    assert_parity(fused(p, cfg), want)


@pytest.mark.parametrize("name", SEQUENCE)
def test_single_pass_true_refuses_sequence_objectives(name):
    with pytest.raises(ValueError, match=f"policy_objective='{name}'"):
        fused(problem(), config(name), single_pass=True)


def naive_logprobs_fp64(hidden, weight, target):
    """naive_logprobs without its fp32 cast (it runs log_softmax in fp32 whatever the input)."""
    return torch.log_softmax(hidden @ weight.t(), dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("name", ["dppo_tv", "sapo", "gmpo"])
def test_fp64(name):
    p, cfg = problem(dtype=torch.float64), config(name)
    want = run(p, naive_logprobs_fp64, cfg)
    assert_parity(fused(p, cfg), want, rtol=1e-10, grad_rtol=1e-10, metric_atol=1e-13)


def test_trust_regions_bite():
    """Each masking objective drops some, not all, tokens here (else parity could not tell a mask from none)."""
    p = problem()
    for name in ("dppo_tv", "dppo_kl", "prob_diff", "cppo", "gmpo"):
        _, metrics, _, _ = run(p, naive_logprobs, config(name))
        assert 0 < metrics["clip_fraction"] < 1, (name, metrics["clip_fraction"])
        if name in ("dppo_kl", "prob_diff"):  # both advantage signs
            assert metrics["clip_fraction_high"] > 0 and metrics["clip_fraction_low"] > 0, name
    assert run(p, naive_logprobs, config("dppo_tv"))[1]["clip_fraction_dual"] > 0  # the ratio cap acts too
