"""Cheap, up-front validation of the loss inputs, so that bad data fails with a message naming the tensor.

The loss is called with NeMo-RL's signature: ``next_token_logprobs [B, S-1]`` and ``data`` holding ``[B, S]`` tensors
that the loss slices ``[:, 1:]``. This module checks that contract before any math runs:

- missing keys -> ``MissingInputError`` (a ``KeyError``) naming the key and the config option that needs it;
- wrong container / dtype -> ``TypeError`` naming the tensor and the accepted dtypes;
- wrong shape or device -> ``ValueError`` giving the expected shape in terms of ``B`` and ``S``;
- bad values -> ``ValueError`` naming the tensor, how many elements are bad and the first one:
  NaN or +-inf anywhere in the current / prev / reference log-probs or advantages the loss reads (padding
  included: NeMo-RL multiplies by the mask and ``NaN * 0 = NaN``, so its loss would be NaN or inf and poison the
  weights), masks other than 0/1, negative or non-finite global counts.

What NeMo-RL computes finitely is computed the same way by default (``strict_input_checks: false``) and reported
instead of refused (:func:`~nemo_is_plugin.loss.output_checks.input_anomalies` -> the ``input_*_fraction`` metrics,
plus a one-time warning):

- NaN / +-inf in ``generation_logprobs``: NeMo-RL's ``nan_to_num`` zeroes that token's IS weight (vLLM can return
  ``-inf`` for a sampled token); its mismatch metrics become inf / NaN, as NeMo-RL's do;
- log-probs above 0 (NeMo-RL's own tests use ``log 3``; log_softmax rounding gives ``+1e-6``): used as given;
- ``positive_example_nll_weight > 0`` without ``rewards`` in the batch: NeMo-RL skips the NLL term; NaN / inf
  rewards: NeMo-RL only tests ``reward > 0`` (one-time warning, no metric).

With ``strict_input_checks: true`` each of these is an error instead: non-finite values anywhere and log-probs above
``POSITIVE_LOGPROB_TOLERANCE[dtype]`` (a genuinely positive log-prob is a bug of the log-prob computation, e.g. verl
issue #2656: fused log-probs with mean +59), a missing ``rewards`` key and non-finite rewards.

Non-finite *IS weights* are never an input error: an ``exp`` of finite log-probs that overflows is zeroed by the loss,
as NeMo-RL does (``nan_to_num(w, nan=0, posinf=0, neginf=0)``).

Cost: two reductions per float tensor (max, min; NaN propagates through max), one per non-bool mask, and a single
host synchronisation for all of them together. The per-element search for the offending entry only runs once an
error has been found. A caller's own value checks (:class:`DeferredCheck`, e.g. score centering's head values) ride
along in the same synchronisation: :func:`loss_input_checks` returns the checks unread, ``run()`` reads them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

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
FLOAT_DTYPES = tuple(POSITIVE_LOGPROB_TOLERANCE)
_DTYPE_NAMES = "float16, bfloat16, float32 or float64"

# data keys holding [B, S] log-probs, and the config option that makes the loss read them
_LOGPROB_KEYS = {
    "prev_logprobs": "needs_prev",
    "generation_logprobs": "needs_generation",
    "reference_policy_logprobs": "needs_reference",
}
_WHY = {
    "prev_logprobs": "the policy ratio / IS weight (every objective but on_policy, force_on_policy_ratio, reads it)",
    "generation_logprobs": "the IS weights and the mismatch metrics",
    "reference_policy_logprobs": "the KL penalty (reference_policy_kl_penalty != 0 and use_kl_in_reward=false)",
    "rewards": "positive_example_nll_weight > 0",
    "curr_logprobs_unfiltered": "the KL penalty under top-k / top-p filtering",
    "rollout_topk_ids": "score_centering (the sampler's top-k head ids)",
    "rollout_topk_logprobs": "score_centering (the sampler's log-probs at its top-k head)",
    "curr_topk_logprobs": "score_centering (the trainer's log-probs at the head ids, same log-softmax as the label's)",
    "token_mask": "every loss",
    "sample_mask": "every loss",
    "advantages": "every loss",
}


class MissingInputError(KeyError):
    """A required ``data`` key is absent. ``str()`` gives the plain message (``KeyError`` would quote it)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def required_input(t: torch.Tensor | None, key: str) -> torch.Tensor:
    """``t``, a loss input the config reads; absent (loss inputs built without the validating entry point), the
    :class:`MissingInputError` that :func:`validate_loss_inputs` raises for the missing data key."""
    if t is None:
        raise MissingInputError(f"the loss inputs lack '{key}' (needed by {_WHY[key]})")
    return t


class DeferredCheck(NamedTuple):
    """A caller's own value check: a 0-d device ``scalar`` read with the inputs' reductions, and ``raise_if_bad``,
    called with its value (a float) once the inputs' own checks have passed, which raises when it is bad."""

    scalar: torch.Tensor
    raise_if_bad: Callable[[float], None]


@dataclass
class PendingInputChecks:
    """The value checks of :func:`loss_input_checks`, not yet read: ``add`` more, then ``run`` (one host read)."""

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


def validate_loss_inputs(
    next_token_logprobs: Any, data: Any, global_valid_seqs: Any, global_valid_toks: Any, **kw: Any
) -> None:
    """:func:`loss_input_checks`, run at once (one host read): raises for a bad input, returns None."""
    loss_input_checks(next_token_logprobs, data, global_valid_seqs, global_valid_toks, **kw).run()


def loss_input_checks(
    next_token_logprobs: Any,
    data: Any,
    global_valid_seqs: Any,
    global_valid_toks: Any,
    *,
    num_seqs: int | None = None,
    needs_prev: bool,
    needs_generation: bool,
    needs_reference: bool,
    needs_rewards: bool,
    strict: bool = True,
    generation_is_old_policy: bool = False,
) -> PendingInputChecks:
    """Raise a clear error if the inputs of ``ClippedPGLoss.__call__`` break NeMo-RL's contract: shapes, dtypes and
    keys at once (no host read), values when the returned checks ``run()`` (one host read).

    Args:
        next_token_logprobs: Float[B, S-1] current-policy log-probs (fp16/bf16/fp32/fp64).
        data: mapping with ``token_mask [B, S]`` (bool/int/float 0-1), ``sample_mask [B]``, ``advantages [B, S]``
            float, and, when the matching ``needs_*`` flag is set, ``prev_logprobs``, ``generation_logprobs``,
            ``reference_policy_logprobs`` (Float[B, S]) and ``rewards [B]``; optional ``curr_logprobs_unfiltered``
            Float[B, S-1] (NeMo-RL's unfiltered current log-probs, read with the KL penalty). Column 0 of the
            ``[B, S]`` tensors is never read by the loss and is not checked.
        global_valid_seqs, global_valid_toks: 0-d tensors or numbers, finite and >= 0.
        num_seqs: length of the per-sequence tensors (``sample_mask``, ``rewards``) when the token layout is not one
            sequence per row (a packed ``[1, N]`` batch of several sequences); None = B.
        needs_*: whether the configured loss reads that tensor (unneeded keys are neither required nor checked).
            ``needs_rewards`` (positive_example_nll_weight > 0): ``rewards`` is checked when present; when absent it is
            an error if ``strict``, else NeMo-RL's behaviour (the NLL term is skipped) with a one-time warning.
        strict: refuse non-finite generation log-probs and positive log-probs (see the module docstring).
        generation_is_old_policy: the generation log-probs are pi_old of the policy ratio (``old_policy_logprobs:
            generation``): checked like ``prev_logprobs`` (non-finite values refused, padding included) in both modes.

    Returns:
        The value checks, unread. Raises ``TypeError``, ``ValueError`` or ``MissingInputError`` (a ``KeyError``), now
        or from ``run()``.
    """
    x = next_token_logprobs
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"next_token_logprobs must be a torch.Tensor [B, S-1], got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"next_token_logprobs has shape {_shape(x)}, expected 2-D [B, S-1]")
    _check_float_dtype("next_token_logprobs", x)
    if not isinstance(data, Mapping):
        raise TypeError(f"data must be a mapping of tensors (dict / BatchedDataDict), got {type(data).__name__}")

    batch, s_minus_1 = x.shape
    if batch == 0 or s_minus_1 == 0:
        raise ValueError(
            f"next_token_logprobs has shape {_shape(x)}: an empty batch; the loss needs B >= 1 sequences and S-1 >= 1 "
            "tokens (skip the loss call for an empty micro-batch)"
        )
    # every [B, S] data tensor as wide as the log-probs: the log-probs, not the data, are one column too wide
    token_shapes = {
        tuple(data[k].shape)
        for k in ("token_mask", "advantages", *_LOGPROB_KEYS)
        if isinstance(data.get(k), torch.Tensor)
    }
    if token_shapes == {(batch, s_minus_1)}:
        raise ValueError(
            f"next_token_logprobs has shape {_shape(x)}, the shape of the [B, S] data tensors; the log-probs must "
            f"be [B, S-1] = [{batch}, {s_minus_1 - 1}]: one per predicted token 1..S-1, from the logits at positions "
            "0..S-2 (drop the last position's logits, or the first token's log-prob)"
        )
    needed = {"token_mask", "sample_mask", "advantages"}
    flags = {"needs_prev": needs_prev, "needs_generation": needs_generation, "needs_reference": needs_reference}
    needed.update(k for k, flag in _LOGPROB_KEYS.items() if flags[flag])
    if needs_rewards and strict:
        needed.add("rewards")
    elif needs_rewards and "rewards" not in data:
        warn_once(
            "rewards",
            "positive_example_nll_weight > 0 but data has no 'rewards': the positive-example NLL term "
            "is skipped, as NeMo-RL does (set strict_input_checks: true to make this an error)",
        )
    read_rewards = needs_rewards and "rewards" in data
    missing = sorted(k for k in needed if k not in data)
    if missing:
        raise MissingInputError(
            "data is missing key(s) "
            + ", ".join(f"'{k}' (needed by {_WHY[k]})" for k in missing)
            + f"; present: {sorted(map(str, data.keys()))}"
        )

    # (name, tensor restricted to what the loss reads, kind) for the value checks below
    logprob = "logprob" if strict else "finite"
    checks: list[tuple[str, torch.Tensor, str]] = [("next_token_logprobs", x, logprob)]
    if needs_reference and "curr_logprobs_unfiltered" in data:
        t = _tensor("curr_logprobs_unfiltered", data["curr_logprobs_unfiltered"], x)
        if t.shape != x.shape:
            raise ValueError(
                f"data['curr_logprobs_unfiltered'] has shape {_shape(t)}, expected [B, S-1] = [{batch}, {s_minus_1}] "
                "like next_token_logprobs (it is already aligned with the next token, not sliced)"
            )
        _check_float_dtype("data['curr_logprobs_unfiltered']", t)
        checks.append(("data['curr_logprobs_unfiltered']", t, logprob))
    for key in ("token_mask", "advantages", *[k for k in _LOGPROB_KEYS if k in needed]):
        t = _tensor(key, data[key], x)
        if t.shape != (batch, s_minus_1 + 1):
            raise ValueError(
                f"data['{key}'] has shape {_shape(t)}, expected [B, S] = [{batch}, {s_minus_1 + 1}] "
                f"(next_token_logprobs is [B, S-1] = [{batch}, {s_minus_1}])"
            )
        if key == "token_mask":
            _check_mask_dtype(key, t)
            checks.append((f"data['{key}']", t[:, 1:], "mask"))
        else:
            _check_float_dtype(f"data['{key}']", t)
            name = f"data['{key}']"
            if key == "generation_logprobs" and generation_is_old_policy:
                name += " (pi_old: old_policy_logprobs is 'generation')"
            elif key == "generation_logprobs" and not strict:
                continue  # NeMo-RL zeroes the IS weight of a non-finite generation log-prob
            checks.append((name, t[:, 1:], logprob if key in _LOGPROB_KEYS else "finite"))
    for key in ("sample_mask", "rewards") if read_rewards else ("sample_mask",):
        t = _tensor(key, data[key], x)
        if num_seqs is not None and t.shape != (num_seqs,):
            raise ValueError(f"data['{key}'] has shape {_shape(t)}, expected [num_seqs] = [{num_seqs}] (the layout's)")
        if num_seqs is None and t.shape != (batch,):
            raise ValueError(
                f"data['{key}'] has shape {_shape(t)}, expected [B] = [{batch}] "
                f"(next_token_logprobs is [B, S-1] = [{batch}, {s_minus_1}])"
            )
        if key == "sample_mask":
            _check_mask_dtype(key, t)
            checks.append((f"data['{key}']", t, "mask"))
        else:
            if t.dtype == torch.bool or t.is_complex():
                raise TypeError(f"data['rewards'] has dtype {t.dtype}, expected a real number dtype")
            # NeMo-RL only compares rewards with 0 (NaN is not positive): tolerated, with a warning, by default
            checks.append((f"data['{key}']", t, "finite" if strict else "compared"))

    for name, count in (("global_valid_seqs", global_valid_seqs), ("global_valid_toks", global_valid_toks)):
        checks.append((name, _count_tensor(name, count, x.device), "count"))
    return PendingInputChecks(checks)


# ---------------------------------------------------------------------------------------------------- helpers
def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(d) for d in t.shape) + "]"


def _tensor(key: str, value: Any, ref: torch.Tensor) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"data['{key}'] must be a torch.Tensor, got {type(value).__name__}")
    if value.device != ref.device:
        raise ValueError(
            f"data['{key}'] is on {value.device} but next_token_logprobs is on {ref.device}; move them together"
        )
    return value


def _check_float_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}, expected {_DTYPE_NAMES}")


def _check_mask_dtype(name: str, t: torch.Tensor) -> None:
    if t.is_complex():
        raise TypeError(f"data['{name}'] has dtype {t.dtype}, expected bool, an integer dtype or a float dtype (0/1)")


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


def _count_tensor(name: str, count: Any, device: torch.device) -> torch.Tensor:
    """The global count as a 0-d tensor (checked for type here, for value with the other reductions)."""
    if isinstance(count, torch.Tensor):
        if count.numel() != 1:
            raise ValueError(f"{name} must be a scalar (0-d tensor or number), got shape {_shape(count)}")
        if count.is_complex() or count.dtype == torch.bool:
            raise TypeError(f"{name} has dtype {count.dtype}, expected a real number")
        return count.detach()
    if isinstance(count, (int, float)) and not isinstance(count, bool):
        return torch.tensor(float(count), dtype=torch.float64, device=device)
    raise TypeError(f"{name} must be a number or a 0-d tensor, got {type(count).__name__}")
