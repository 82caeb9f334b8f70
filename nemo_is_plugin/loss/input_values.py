"""The value half of the loss's input checks: the reductions that reveal a bad value, read in one host synchronisation,
and the errors that name the tensor and its first bad element (``loss/input_validation.py`` checks keys, types and
shapes without a host read and hands the tensors here; the rules are its module docstring's).

A check is ``(name, tensor restricted to what the loss reads, kind)``; kind ``logprob`` refuses NaN, +-inf and values
above :data:`POSITIVE_LOGPROB_TOLERANCE`, ``finite`` NaN and +-inf, ``mask`` anything but 0 / 1, ``count`` a negative
or non-finite global count, ``compared`` warns once for NaN / inf (NeMo-RL only compares rewards with 0). A caller's
own checks (:class:`DeferredCheck`, e.g. score centering's head values) ride along in the same synchronisation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from nemo_is_plugin.common.once import warn_once

# How far above 0 a log-prob may be before it counts as positive (an error in strict mode), per dtype. log_softmax
# rounds: in float32 a near-certain token can come out at +1e-6; half-precision log-probs computed from
# half-precision logits err by up to one ulp of the logit (bf16 spacing is 0.0625 at |logit| in [8, 16)).
POSITIVE_LOGPROB_TOLERANCE: dict[torch.dtype, float] = {
    torch.float64: 1e-4,
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 1e-1,
}


class DeferredCheck(NamedTuple):
    """A caller's own value check: a 0-d device ``scalar`` read with the inputs' reductions, and ``raise_if_bad``,
    called with its value (a float) once the inputs' own checks have passed, which raises when it is bad."""

    scalar: torch.Tensor
    raise_if_bad: Callable[[float], None]


@dataclass
class PendingInputChecks:
    """The value checks of ``input_validation.loss_input_checks``, not yet read: ``add`` more, then ``run`` (one host
    read)."""

    checks: list[tuple[str, torch.Tensor, str]]
    deferred: list[DeferredCheck] = field(default_factory=list)

    def add(self, checks: list[DeferredCheck]) -> None:
        self.deferred.extend(checks)

    def run(self) -> None:
        """Read every reduction in one host synchronisation; raise for the first bad input (the inputs' own checks
        first, then the deferred ones in order)."""
        _check_values(self.checks, self.deferred)

    def scalars(self) -> list[torch.Tensor]:
        """The 0-d device reductions that :meth:`raise_if_bad` reads, in its order (no host read): a caller reads
        them with values of its own (the compiled epilogue: with the metrics) and passes their values back."""
        return [s for _, t, kind in self.checks for s in _reductions(t, kind)] + [d.scalar for d in self.deferred]

    def raise_if_bad(self, values: list[float]) -> None:
        """Raise for the first bad input, given the values of :meth:`scalars` (read by the caller)."""
        spans, start = [], 0
        for _, t, kind in self.checks:
            n = _reduction_count(t, kind)
            spans.append((start, n))
            start += n
        _raise_for_bad_values(self.checks, spans, values)
        for d, value in zip(self.deferred, values[start:]):
            d.raise_if_bad(value)


def _reductions(t: torch.Tensor, kind: str) -> list[torch.Tensor]:
    """Scalars, still on device, that reveal every bad value of ``t`` (empty tensors have none)."""
    if t.numel() == 0:
        return []
    if kind == "count":
        return [t.reshape(())]
    if kind == "mask":
        if t.dtype == torch.bool:
            return []
        return [((t != 0) & (t != 1)).any()]  # NaN != 0 and NaN != 1, so NaN is caught here too
    # NaN propagates through max; +inf shows as max; -inf as min.
    return [t.max(), t.min()]


def _reduction_count(t: torch.Tensor, kind: str) -> int:
    """How many scalars :func:`_reductions` gives for ``t`` (computed from its shape and dtype: no device work)."""
    if t.numel() == 0 or (kind == "mask" and t.dtype == torch.bool):
        return 0
    return 2 if kind not in ("count", "mask") else 1


def _check_values(checks: list[tuple[str, torch.Tensor, str]], deferred: list[DeferredCheck]) -> None:
    scalars: list[torch.Tensor] = []
    spans: list[tuple[int, int]] = []
    for _, t, kind in checks:
        red = _reductions(t, kind)
        spans.append((len(scalars), len(red)))
        scalars.extend(red)
    scalars.extend(d.scalar.reshape(()) for d in deferred)
    if not scalars:
        return
    dev = scalars[0].device
    values = torch.stack([s.detach().to(device=dev, dtype=torch.float64) for s in scalars]).tolist()  # one sync
    _raise_for_bad_values(checks, spans, values)
    for d, value in zip(deferred, values[len(values) - len(deferred) :]):
        d.raise_if_bad(value)


def _raise_for_bad_values(checks: list[tuple[str, torch.Tensor, str]], spans: list[tuple[int, int]], values: list):
    for (name, t, kind), (start, n) in zip(checks, spans):
        if n == 0:
            continue
        v = values[start : start + n]
        if kind == "count":
            if not (v[0] == v[0] and abs(v[0]) != float("inf")):
                raise ValueError(f"{name} = {v[0]} is not finite")
            if v[0] < 0:
                raise ValueError(f"{name} = {v[0]} is negative; it counts valid sequences/tokens over all DP ranks")
            continue
        if kind == "mask":
            if v[0]:
                raise ValueError(f"{name} must hold only 0 and 1; {_first_bad(name, t, (t != 0) & (t != 1))}")
            continue
        mx, mn = v
        if kind == "compared":
            if mx != mx or mx == float("inf") or mn == float("-inf"):
                warn_once(
                    f"nonfinite {name}",
                    f"{name} holds NaN or inf; only 'reward > 0' is read from it (NaN "
                    "is not positive), as in NeMo-RL (set strict_input_checks: true to make this an error)",
                )
            continue
        if mx != mx or mx == float("inf") or mn == float("-inf"):
            nonfinite = ~torch.isfinite(t)
            hint = " (masked positions included: NaN * 0 is NaN in masked sums, so fill padding with 0)"
            raise ValueError(f"{name} contains NaN or inf; {_first_bad(name, t, nonfinite)}{hint}")
        if kind == "logprob":
            tol = POSITIVE_LOGPROB_TOLERANCE[t.dtype]
            if mx > tol:
                raise ValueError(
                    f"{name} holds positive log-probs (max {mx:.6g} > tolerance {tol:g} for {t.dtype}); "
                    f"log-probs must be <= 0: {_first_bad(name, t, t > tol)}"
                )


_ALIGNED = "data['curr_logprobs_unfiltered']"  # a data tensor already [B, S-1] (checked whole, not as [:, 1:])


def _first_bad(name: str, t: torch.Tensor, bad: torch.Tensor) -> str:
    """Human description of the bad entries; only called on the error path.

    ``data[...]`` [B, S] tensors are checked as their ``[:, 1:]`` view; the index is given in [B, S] coordinates.
    """
    idx = bad.nonzero()
    count = int(idx.shape[0])
    first = [int(i) for i in idx[0]] if count else []
    value = t[tuple(first)].item() if count else None
    if name.startswith("data[") and not name.startswith(_ALIGNED) and len(first) == 2:
        first[1] += 1
    where = "[" + ", ".join(map(str, first)) + "]"
    return f"{count} bad element(s), first at {where} = {value!r}"


__all__ = ["POSITIVE_LOGPROB_TOLERANCE", "DeferredCheck", "PendingInputChecks"]
