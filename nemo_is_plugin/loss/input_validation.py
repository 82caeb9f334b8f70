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
host synchronisation for all of them together (``loss/input_values.py``: the value half of the checks). The
per-element search for the offending entry only runs once an error has been found. A caller's own value checks
(:class:`~nemo_is_plugin.loss.input_values.DeferredCheck`, e.g. score centering's head values) ride along in the same
synchronisation: :func:`loss_input_checks` returns the checks unread, ``run()`` reads them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import torch

from nemo_is_plugin.common.once import warn_once
from nemo_is_plugin.loss.input_values import POSITIVE_LOGPROB_TOLERANCE, PendingInputChecks

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


Required = TypeVar("Required")


def required_input(t: Required | None, key: str) -> Required:
    """``t``, a loss input the config reads; absent (loss inputs built without the validating entry point), the
    :class:`MissingInputError` that :func:`validate_loss_inputs` raises for the missing data key."""
    if t is None:
        raise MissingInputError(f"the loss inputs lack '{key}' (needed by {_WHY[key]})")
    return t


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
    _check_call_types(x, data)
    _refuse_unshifted_logprobs(x, data)
    flags = {"needs_prev": needs_prev, "needs_generation": needs_generation, "needs_reference": needs_reference}
    if needs_rewards and not strict and "rewards" not in data:  # here: the warning points at the loss's caller
        warn_once(
            "rewards",
            "positive_example_nll_weight > 0 but data has no 'rewards': the positive-example NLL term "
            "is skipped, as NeMo-RL does (set strict_input_checks: true to make this an error)",
        )
    needed = _needed_keys(data, flags, needs_rewards and strict)
    # (name, tensor restricted to what the loss reads, kind) for the value checks, read in one host sync by run()
    logprob = "logprob" if strict else "finite"
    checks: list[tuple[str, torch.Tensor, str]] = [("next_token_logprobs", x, logprob)]
    if needs_reference and "curr_logprobs_unfiltered" in data:
        checks.append(_unfiltered_check(data["curr_logprobs_unfiltered"], x, logprob))
    checks += _token_tensor_checks(data, x, needed, strict, generation_is_old_policy)
    checks += _sequence_tensor_checks(data, x, num_seqs, needs_rewards and "rewards" in data, strict)
    for name, count in (("global_valid_seqs", global_valid_seqs), ("global_valid_toks", global_valid_toks)):
        checks.append((name, _count_tensor(name, count, x.device), "count"))
    return PendingInputChecks(checks)


def _check_call_types(x: Any, data: Any) -> None:
    """The call's log-probs are a non-empty 2-D float tensor ``[B, S-1]``, its data a mapping."""
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


def _refuse_unshifted_logprobs(x: torch.Tensor, data: Mapping[str, Any]) -> None:
    """Every [B, S] data tensor as wide as the log-probs: the log-probs, not the data, are one column too wide."""
    batch, s_minus_1 = x.shape
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


def _needed_keys(data: Mapping[str, Any], flags: dict[str, bool], requires_rewards: bool) -> set[str]:
    """The data keys the configured loss requires (``flags``: the ``needs_*`` of :func:`loss_input_checks`;
    ``rewards`` in strict mode only); raises naming the missing ones."""
    needed = {"token_mask", "sample_mask", "advantages"}
    needed.update(k for k, flag in _LOGPROB_KEYS.items() if flags[flag])
    if requires_rewards:
        needed.add("rewards")
    missing = sorted(k for k in needed if k not in data)
    if missing:
        raise MissingInputError(
            "data is missing key(s) "
            + ", ".join(f"'{k}' (needed by {_WHY[k]})" for k in missing)
            + f"; present: {sorted(map(str, data.keys()))}"
        )
    return needed


def _unfiltered_check(value: Any, x: torch.Tensor, logprob: str) -> tuple[str, torch.Tensor, str]:
    """NeMo-RL's unfiltered current log-probs, already aligned with ``x`` ([B, S-1], not sliced)."""
    t = _tensor("curr_logprobs_unfiltered", value, x)
    if t.shape != x.shape:
        raise ValueError(
            f"data['curr_logprobs_unfiltered'] has shape {_shape(t)}, expected [B, S-1] = {_shape(x)} "
            "like next_token_logprobs (it is already aligned with the next token, not sliced)"
        )
    _check_float_dtype("data['curr_logprobs_unfiltered']", t)
    return ("data['curr_logprobs_unfiltered']", t, logprob)


def _token_tensor_checks(
    data: Mapping[str, Any], x: torch.Tensor, needed: set[str], strict: bool, generation_is_old_policy: bool
) -> list[tuple[str, torch.Tensor, str]]:
    """The [B, S] tensors' shapes and dtypes, and their value checks on the columns the loss reads (``[:, 1:]``)."""
    batch, s_minus_1 = x.shape
    logprob = "logprob" if strict else "finite"
    checks = []
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
            continue
        _check_float_dtype(f"data['{key}']", t)
        name = f"data['{key}']"
        if key == "generation_logprobs" and generation_is_old_policy:
            name += " (pi_old: old_policy_logprobs is 'generation')"
        elif key == "generation_logprobs" and not strict:
            continue  # NeMo-RL zeroes the IS weight of a non-finite generation log-prob
        checks.append((name, t[:, 1:], logprob if key in _LOGPROB_KEYS else "finite"))
    return checks


def _sequence_tensor_checks(
    data: Mapping[str, Any], x: torch.Tensor, num_seqs: int | None, read_rewards: bool, strict: bool
) -> list[tuple[str, torch.Tensor, str]]:
    """The per-sequence tensors' (``sample_mask``, ``rewards`` when read) shapes and dtypes, and their value checks."""
    batch, s_minus_1 = x.shape
    checks = []
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
            continue
        if t.dtype == torch.bool or t.is_complex():
            raise TypeError(f"data['rewards'] has dtype {t.dtype}, expected a real number dtype")
        # NeMo-RL only compares rewards with 0 (NaN is not positive): tolerated, with a warning, by default
        checks.append((f"data['{key}']", t, "finite" if strict else "compared"))
    return checks


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
