"""What a golden case's plugin call returns and how two of them are compared: :class:`Outcome` (loss, gradients,
metrics, further tensors), :class:`PluginCall` (one call made from a golden case, helpers/golden_calls.py) and
:func:`assert_same_outcome` (the device-guard and CUDA drivers' comparison with the same call on the CPU)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass, field

import torch

from tools.golden import common


@dataclass
class Outcome:
    """A loss call's results: the loss, d loss / d each differentiable input (zeros when unused), the metrics, and any
    further tensors the call returns (a slime TIS function's masks and per-token metrics; its ``loss`` is the
    per-token ``pg_loss``)."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    metrics: dict[str, float]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    device: str = ""  # the device type the call ran on (kept by ``cpu()``): some golden tolerances depend on it

    def __post_init__(self) -> None:
        self.device = self.device or self.loss.device.type

    def cpu(self) -> Outcome:
        return Outcome(
            self.loss.detach().cpu(),
            {k: g.cpu() for k, g in self.grads.items()},
            dict(self.metrics),
            {k: t.detach().cpu() for k, t in self.tensors.items()},
            self.device,
        )


Runner = Callable[[torch.device | str, torch.dtype | None, Callable[[], ContextManager]], Outcome]


@dataclass
class PluginCall:
    """One plugin call made from a golden case.

    ``run(device, dtype, guard)`` builds the inputs on ``device`` (log-prob tensors cast to ``dtype`` when given),
    then builds the loss, calls it and differentiates it inside ``guard()``. ``check_golden(outcome)`` asserts the
    golden values (None when the suite's golden values are not a loss call's outputs).
    """

    suite: str
    label: str
    run: Runner
    check_golden: Callable[[Outcome], None] | None = None
    fmt: str = "nemo_rl"  # the case format (case_format): "nemo_rl" calls go through ClippedPGLoss.__call__

    @property
    def id(self) -> str:
        return f"{self.suite}/{self.label}"


# ---------------------------------------------------------------------------------------------------- comparisons
def assert_same_outcome(
    got: Outcome,
    want: Outcome,
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
    grad_rtol: float | None = None,
    metric_rtol: float | None = None,
) -> None:
    """``got`` equals ``want`` (both moved to CPU) within the tolerances; NaN equals NaN, inf must match exactly."""
    got, want = got.cpu(), want.cpu()
    grad_rtol = rtol if grad_rtol is None else grad_rtol
    torch.testing.assert_close(got.loss, want.loss, rtol=rtol, atol=atol, equal_nan=True)
    assert got.grads.keys() == want.grads.keys()
    for key in want.grads:
        torch.testing.assert_close(
            got.grads[key],
            want.grads[key],
            rtol=grad_rtol,
            atol=atol,
            equal_nan=True,
            msg=lambda m, key=key: f"d loss / d {key}: {m}",
        )
    assert got.tensors.keys() == want.tensors.keys()
    for key in want.tensors:
        torch.testing.assert_close(
            got.tensors[key],
            want.tensors[key],
            rtol=rtol,
            atol=atol,
            equal_nan=True,
            msg=lambda m, key=key: f"{key}: {m}",
        )
    assert got.metrics.keys() == want.metrics.keys(), set(got.metrics) ^ set(want.metrics)
    m_rtol = rtol if metric_rtol is None else metric_rtol
    bad = {
        k: (got.metrics[k], v) for k, v in want.metrics.items() if not common.close(got.metrics[k], v, (m_rtol, atol))
    }
    assert not bad, f"metrics differ (got, want): {bad}"


def no_guard() -> ContextManager:
    return contextlib.nullcontext()
