"""NeMo-RL's fused log-prob path on the plugin's head: the replacement, the patch, and the switch that applies it.

With ``policy.megatron_cfg.use_fused_linear_logprobs: true``, NeMo-RL's Megatron policy worker patches
``GPTModel.forward`` (``patch_gpt_model_forward_for_linear_ce_fusion``); the patched forward
(``_gpt_forward_with_linear_ce_fusion``) runs the decoder and then looks up and calls the module function
``from_parallel_hidden_states_to_logprobs`` of ``nemo_rl/distributed/model_utils.py`` (NVIDIA-NeMo/RL @7ea279ab) for
every log-prob pass: the training pass and the no-grad passes (previous and reference log-probs,
``inference_only``). That function runs NeMo-RL's ``ChunkedDistributedHiddenStatesToLogprobs``: 256 sequence positions
per chunk, fp32 logits, a backward that recomputes them and forms dX and dW with fp32 GEMMs.

:func:`from_parallel_hidden_states_to_logprobs` here takes the same arguments and returns the same thing, computed
by the plugin's chunked head (:mod:`~nemo_is_plugin.distributed.head.sequence_head`):

- sequence-first hidden states ``[S/TP, B, H]``; with ``TP > 1`` they are all-gathered over TP (NeMo-RL always does:
  its fused path runs with sequence parallelism) and dX is reduce-scattered back; dW is this rank's ``[V/TP, H]``;
- ``target`` = the input ids ``[B, S]``, rolled left by one; the result is ``[B, S - 1]`` fp32 log-probs;
- ``vocab_start_index`` / ``vocab_end_index``: the rows of this rank (checked against the weight shard: Megatron pads
  the vocabulary so every rank holds ``V/TP`` rows); a target no rank owns gives 0 with the gradient of ``-lse``, as
  in NeMo-RL;
- ``inference_only``: no autograd graph (nothing saved);
- ``chunk_size`` (NeMo-RL's ``fused_linear_logprobs_chunk_size``) is not used: the plugin's chunks are sized by
  bytes per device (thousands of tokens on a GPU); ``runtime_gather_output`` is unused, as in NeMo-RL.

Beyond NeMo-RL's function (keyword-only, for the upstream changes docs/nemo_rl.md describes): context parallelism
(``cp_group`` of any size, Megatron's load-balanced or the contiguous order, CP-sharded or full labels; NeMo-RL
asserts a CP size of 1), packed sequences (``cu_seqlens_padded``: rolled per sequence, returned packed ``[1, T]`` or,
with ``unpacked_seqlen``, unpacked as ``[B, unpacked_seqlen - 1]``), ``temperature``, and NeMo-RL's top-k / top-p
training filter (``top_k``, ``top_p``: the filtered and the unfiltered log-probs,
:mod:`~nemo_is_plugin.distributed.head.filtered_head`).

The switch: ``NEMO_IS_NEMO_RL_HEAD=1`` in the environment that starts NeMo-RL's driver. NeMo-RL copies the driver's
environment into every worker's Ray runtime environment, and the plugin's startup hook (a ``sitecustomize`` that
Python runs at start-up from a ``PYTHONPATH`` directory: the repository root, or
``nemo_is_plugin/adapters/nemo_rl/startup`` of an installed plugin) registers :func:`patch_nemo_rl` to run the moment
``nemo_rl.distributed.model_utils`` is imported in that process: before NeMo-RL's worker builds its model, so before the
first log-prob pass. :func:`patch_nemo_rl` refuses (raises :class:`HostPatchError`, which fails that import) a NeMo-RL
whose function is missing, has another signature, or is no longer looked up by name by its caller: the plugin never
silently leaves NeMo-RL's own head running.
"""

from __future__ import annotations

import contextlib
import dis
import inspect
import os
from types import ModuleType
from typing import Any

import torch

from nemo_is_plugin.adapters.import_hooks import HostPatchError
from nemo_is_plugin.distributed.head.sequence_head import (
    SequenceLayout,
    next_token_logprobs,
    unpack_next_token_logprobs,
)
from nemo_is_plugin.distributed.parallel.cp_sharding import CPOrder
from nemo_is_plugin.distributed.parallel.groups import ProcessGroup, effective, group_rank, group_size

SWITCH_ENV = "NEMO_IS_NEMO_RL_HEAD"
TARGET_MODULE = "nemo_rl.distributed.model_utils"
TARGET = "from_parallel_hidden_states_to_logprobs"
CALLER = "_gpt_forward_with_linear_ce_fusion"
ORIGINAL_ATTR = "_nemo_is_original_" + TARGET
HOOK_KEY = "nemo_is.nemo_is_nemo_rl_head"  # the start-up hook registers the same key: one patch, not two
NEMO_RL_COMMIT = "7ea279ab"  # NVIDIA-NeMo/RL commit the signature below was read from
PARAMS = (
    ("tensor_parallel_hidden_states", inspect.Parameter.empty),
    ("output_weight_layer", inspect.Parameter.empty),
    ("runtime_gather_output", inspect.Parameter.empty),
    ("target", inspect.Parameter.empty),
    ("vocab_start_index", inspect.Parameter.empty),
    ("vocab_end_index", inspect.Parameter.empty),
    ("tp_group", inspect.Parameter.empty),
    ("inference_only", False),
    ("cp_group", None),
    ("chunk_size", None),
)


def switch_on() -> bool:
    """True when ``NEMO_IS_NEMO_RL_HEAD=1``; False when unset or ``0``; anything else is an error."""
    value = os.environ.get(SWITCH_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(
            f"{SWITCH_ENV} must be 1 (NeMo-RL's fused log-prob path on the plugin's head) or 0 / unset, got {value!r}"
        )
    return value == "1"


def from_parallel_hidden_states_to_logprobs(
    tensor_parallel_hidden_states: torch.Tensor,
    output_weight_layer: torch.Tensor,
    runtime_gather_output: Any,
    target: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group: ProcessGroup | None,
    inference_only: bool = False,
    cp_group: ProcessGroup | None = None,
    chunk_size: int | None = None,
    *,
    cu_seqlens_padded: torch.Tensor | list[int] | None = None,
    unpacked_seqlen: int | None = None,
    cp_order: CPOrder = "load_balanced",
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """NeMo-RL's ``from_parallel_hidden_states_to_logprobs`` on the plugin's head (see the module docstring).

    Returns ``[B, S - 1]`` fp32 log-probs of ``target[:, 1:]`` (fp64 for fp64 inputs); packed:
    ``[B, unpacked_seqlen - 1]``, zeros past each sequence, or without ``unpacked_seqlen`` the packed ``[1, T]``
    (each sequence's last position scores its own first label: a caller slicing per sequence drops it). Under CP
    every CP rank gets the whole sequence. With a top-k / top-p filter (NeMo-RL's training sampling parameters):
    ``(filtered, unfiltered)``, each as above (a filtered-out target: ``-inf``, as NeMo-RL's filtered log-probs)."""
    del runtime_gather_output, chunk_size  # unused, see the module docstring
    tp = effective(tp_group)
    vocab_local = output_weight_layer.shape[0]
    start = group_rank(tp) * vocab_local
    if (int(vocab_start_index), int(vocab_end_index)) != (start, start + vocab_local):
        raise ValueError(
            f"vocab [{vocab_start_index}, {vocab_end_index}) on TP rank {group_rank(tp)} does not match the weight "
            f"shard's {vocab_local} rows [{start}, {start + vocab_local}): the plugin's head needs Megatron's padded "
            "vocabulary (every rank owns weight.shape[0] ids)"
        )
    layout = SequenceLayout.build(cu_seqlens_padded, cp_group, cp_order)
    with torch.no_grad() if inference_only else contextlib.nullcontext():
        out = next_token_logprobs(
            tensor_parallel_hidden_states,
            output_weight_layer,
            target,
            tp,
            layout,
            sequence_parallel=group_size(tp) > 1,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
        )
        results = out if isinstance(out, tuple) else (out,)
        if layout.cu_seqlens_padded is not None and unpacked_seqlen is not None:
            cu = layout.cu_seqlens_padded
            results = tuple(unpack_next_token_logprobs(r, cu, unpacked_seqlen) for r in results)
        elif layout.packed:
            results = tuple(r.unsqueeze(0) for r in results)
        else:
            results = tuple(r[:, :-1] for r in results)
        return results if len(results) > 1 else results[0]


from_parallel_hidden_states_to_logprobs.nemo_is_head = True  # type: ignore[attr-defined]  # marks the replacement


def check_target(module: ModuleType) -> None:
    """Raise :class:`HostPatchError` unless ``module`` (NeMo-RL's model_utils) holds the function the plugin
    replaces, with the signature it was written for, called by name from the fused forward."""
    where = f"{module.__name__}.{TARGET}"
    fn = module.__dict__.get(ORIGINAL_ATTR) or getattr(module, TARGET, None)
    if fn is None:
        raise HostPatchError(
            f"{where} does not exist in this NeMo-RL ({getattr(module, '__file__', '?')}); the plugin's head was "
            f"written for NeMo-RL {NEMO_RL_COMMIT}: unset {SWITCH_ENV}, or use a NeMo-RL that has it"
        )
    found = [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]
    if found != list(PARAMS):
        raise HostPatchError(
            f"{where} has changed: its parameters are {found}, the plugin's head stands in for {list(PARAMS)} "
            f"(NeMo-RL {NEMO_RL_COMMIT}); unset {SWITCH_ENV} until the plugin supports this NeMo-RL"
        )
    if not _loads_global(getattr(getattr(module, CALLER, None), "__code__", None), TARGET):
        raise HostPatchError(
            f"{module.__name__}.{CALLER} no longer calls {TARGET} by name, so replacing it would change nothing; "
            f"unset {SWITCH_ENV} (written for NeMo-RL {NEMO_RL_COMMIT})"
        )


def _loads_global(code: Any, name: str) -> bool:
    """Whether ``code`` (or a function nested in it) loads ``name`` as a global: the binding the patch replaces.
    ``co_names`` also holds attribute names (``other.from_parallel_hidden_states_to_logprobs(...)``), which the patch
    does not reach, so the bytecode is read."""
    codes = [code] if inspect.iscode(code) else []
    while codes:
        current = codes.pop()
        if any(i.opname in ("LOAD_GLOBAL", "LOAD_NAME") and i.argval == name for i in dis.get_instructions(current)):
            return True
        codes += [c for c in current.co_consts if inspect.iscode(c)]
    return False


def patch_nemo_rl(module: ModuleType) -> None:
    """Replace NeMo-RL's ``from_parallel_hidden_states_to_logprobs`` in ``module`` by the plugin's (idempotent; the
    original is kept as ``module._nemo_is_original_from_parallel_hidden_states_to_logprobs``)."""
    check_target(module)
    if ORIGINAL_ATTR not in module.__dict__:
        setattr(module, ORIGINAL_ATTR, getattr(module, TARGET))
    setattr(module, TARGET, from_parallel_hidden_states_to_logprobs)


def patch_if_switched_on(module: ModuleType) -> None:
    """The startup hook's callback: patch when the switch is on (an invalid switch value raises)."""
    if switch_on():
        patch_nemo_rl(module)


def install() -> bool:
    """Register :func:`patch_if_switched_on` for ``nemo_rl.distributed.model_utils`` in this process (now, if it is
    already imported) when the switch is on; returns whether it is."""
    from nemo_is_plugin.adapters.import_hooks import when_imported

    if not switch_on():
        return False
    when_imported(TARGET_MODULE, HOOK_KEY, patch_if_switched_on)
    return True


def status(module: ModuleType | None = None) -> dict[str, Any]:
    """What runs NeMo-RL's fused log-prob path in this process: the switch, whether NeMo-RL's module is imported,
    and whose function it holds."""
    import sys

    module = module if module is not None else sys.modules.get(TARGET_MODULE)
    fn = getattr(module, TARGET, None) if module is not None else None
    return {
        "switch": os.environ.get(SWITCH_ENV, ""),
        "module_imported": module is not None,
        "plugin_head": bool(getattr(fn, "nemo_is_head", False)),
        "function": None if fn is None else f"{fn.__module__}.{fn.__qualname__}",
    }


__all__ = [
    "HostPatchError",
    "SWITCH_ENV",
    "TARGET_MODULE",
    "check_target",
    "from_parallel_hidden_states_to_logprobs",
    "install",
    "patch_if_switched_on",
    "patch_nemo_rl",
    "status",
    "switch_on",
]
