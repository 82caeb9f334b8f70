"""CUDA tier, golden suites: every golden case of every suite under tests/data/golden, its tensors moved to a CUDA
device and called through ``build_loss_fn`` (NeMo-RL format), ``ClippedPGLoss.compute`` (CTPO, verl) or the slime
adapter's entry points as slime calls them (slime/policy: the full loss; slime/tis: the TIS function), forward and
backward (helpers/golden_calls.py). Marked ``gpu``: skipped without CUDA, run by ``make test`` on a machine with one.
See docs/testing.md.

Tolerances and why:

- fp32 inputs: the golden values themselves, with the CPU suites' tolerances (loss and gradients rtol 1e-4 / atol 1e-6,
  metrics as the NeMo-RL golden README: rtol 1e-4, KL-type metrics 1e-3, extrema / exact counts 1e-6; CTPO rtol 1e-5,
  1e-4 at T = 2048; slime as its README: loss and metrics rtol 1e-5, logit gradients 1e-4, TIS outputs 1 ulp (3 on CUDA,
  whose expf is accurate to 2 ulp: helpers/golden_runners.SLIME_TIS_RTOL), masks
  exact). verl's golden values are weights and masks, not a loss call's outputs: those calls are compared with the
  same call on the CPU (loss / gradient rtol 1e-5, atol 1e-6; metrics rtol 1e-4, atol 1e-6).
- bf16 log-prob inputs (current, prev, generation, reference log-probs cast to bf16; slime: the logits and the batch's
  or TIS call's log-probs; verl score centering: the logits, whose label and head log-probs the loss takes in
  fp32; masks, advantages, counts as stored): compared with the same bf16 inputs on the CPU, not
  with the fp32 golden values. The loss upcasts bf16 log-probs to fp32 before any arithmetic, so both devices run the
  same fp32 math on the same (exactly representable) values and differ only by fp32 rounding (op order, exp / log
  implementations): loss rtol 1e-4 / atol 1e-6 and metrics rtol 1e-4 / atol 1e-6 as for fp32. The gradient comes back
  in bf16 (the input's dtype), and autograd adds the contributions of the log-prob's several uses (surrogate, KL,
  ratio) into the bf16 leaf in bf16, each rounded: one fp32 rounding difference per contribution moves the sum by up
  to one bf16 step each (2^-8 to 2^-7 relative, by the value's place between powers of two). Gradients rtol 2^-6 (two
  steps at the coarsest spacing; an H100 run of SAPO differed by 1.3e-2 = two steps of 2^-12 at 0.039), atol 1e-6.
  (slime's TIS function keeps its weights in the log-probs' dtype:
  a bf16 exp, the same on both devices unless their fp32 exp straddles a bf16 rounding boundary.)
  Against the fp32 golden values a bf16 run is off by the bf16 rounding of the inputs themselves (2^-9 relative per
  log-prob, compounding in sequence sums over thousands of tokens), which is a property of bf16, not of the device.
"""

from __future__ import annotations

import pytest
import torch
from helpers.golden_calls import golden_calls
from helpers.golden_outcome import PluginCall, assert_same_outcome, no_guard

CALLS = golden_calls()
_IDS = [c.id for c in CALLS]

FP32_VS_CPU = dict(rtol=1e-5, atol=1e-6, metric_rtol=1e-4)
BF16_VS_CPU = dict(rtol=1e-4, atol=1e-6, grad_rtol=2**-6, metric_rtol=1e-4)


def check_fp32(call: PluginCall, device: str) -> None:
    """The call on ``device`` reproduces the golden values (or, for suites without loss-level goldens, the CPU)."""
    got = call.run(device, None, no_guard).cpu()
    assert got.loss.device.type == "cpu" and all(g.dtype == torch.float32 for g in got.grads.values())
    if call.check_golden is not None:
        call.check_golden(got)
    else:
        assert_same_outcome(got, call.run("cpu", None, no_guard), **FP32_VS_CPU)


def check_bf16(call: PluginCall, device: str) -> None:
    """bf16 log-probs on ``device`` equal the same bf16 inputs on the CPU (see the module docstring)."""
    want = call.run("cpu", torch.bfloat16, no_guard)
    got = call.run(device, torch.bfloat16, no_guard)
    assert all(g.dtype == torch.bfloat16 for g in got.grads.values() if g.dtype.is_floating_point)
    assert_same_outcome(got, want, **BF16_VS_CPU)


@pytest.mark.gpu
@pytest.mark.parametrize("call", CALLS, ids=_IDS)
def test_golden_case_fp32_on_cuda(call):
    check_fp32(call, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("call", CALLS, ids=_IDS)
def test_golden_case_bf16_logprobs_on_cuda(call):
    check_bf16(call, "cuda")


def test_cuda_tier_checks_run_on_the_cpu():
    """The CUDA tier's own checks, exercised in CPU CI on a few calls of every suite (device 'cpu'), so that they
    cannot rot unseen between GPU runs."""
    by_suite: dict[str, list[PluginCall]] = {}
    for call in CALLS:
        by_suite.setdefault(call.suite, []).append(call)
    for calls in by_suite.values():
        for call in calls[:2]:
            check_fp32(call, "cpu")
            check_bf16(call, "cpu")


def test_make_test_runs_the_gpu_tier():
    """`make test` (= .ci/run) selects the gpu-marked tests; only the missing device skips them (tests/conftest.py)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    recipe = root.joinpath("Makefile").read_text().split("\ntest:", 1)[1].split("\n\n", 1)[0]
    pytest_args = recipe.split("pytest", 1)[1]  # what follows `python -m pytest`
    assert " -m " not in pytest_args and "not gpu" not in pytest_args
    assert "not gpu" not in root.joinpath("pyproject.toml").read_text()
