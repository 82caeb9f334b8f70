"""verl's FSDP fused forward on the plugin's head, behind the same switch as its Megatron engine.

verl's FSDP engine (``verl/workers/engine/fsdp/transformer_impl.py``, ``FSDPEngine._build_module``) builds the Hugging
Face model through ``apply_monkey_patch`` (``verl/models/transformers/monkey_patch.py``), which ends in
``patch_forward_with_backends``: with ``actor_rollout_ref.model.use_fused_kernels=True`` and
``fused_kernel_options.impl_backend`` ``torch`` (or ``liger``) it sets the model class's forward to the model type's
``forward_with_torch_backend`` (``verl/models/transformers/dense_common.py`` for text models; ``qwen2_vl.py``,
``qwen3_vl.py``, ``glm4v.py``, ``qwen3_5.py`` for the vision-language ones) and stores the backend on the model
instance as ``_verl_fused_kernels_backend``. Each of those forwards runs the decoder, rolls the labels (or takes the
engine's ``shift_labels``: the globally rolled, Ulysses-sliced labels under remove-padding) and calls, at call time,

    FusedLinearForPPO(impl_backend=model._verl_fused_kernels_backend).forward(
        hidden_states=..., vocab_weights=self.lm_head.weight, input_ids=rolled_labels, temperature=temperature)

(``verl/utils/experimental/torch_functional.py``): ``hidden [B, S, H]`` (``[1, T, H]`` packed), the whole LM head
``[V, H]`` (FSDP unshards it for the forward), labels ``[B, S]``; it returns fp32 log-probs ``[B, S]`` and the entropy
in the hidden states' dtype, which the forward returns as ``CausalLMOutputForPPO.log_probs`` / ``.entropy``
(``dense_common.py``) and the engine reads in ``FSDPEngineWithLMHead.prepare_model_outputs``. verl's own op
materialises fp32 ``[512 tokens, V]`` logits per chunk and recomputes them twice in its backward.

``impl_backend=nemo_is`` here is a third backend of that op: the entry point's hook on ``patch_forward_with_backends``
lets verl install its torch-backend forward for the model type, then marks the model ``nemo_is``, and verl's
``FusedLinearForPPO`` becomes :data:`PluginFusedLinearForPPO`, which computes that backend with the plugin's chunked
head (:func:`~nemo_is_plugin.distributed.head.fused_linear.fused_linear_logprobs`: one chunk of logits at a time,
never an fp32 ``[tokens, V]``) and hands any other backend to verl's class unchanged (a model built with ``torch`` in
the same process keeps verl's op). Everything around the head (decoder, labels, temperature, output) stays verl's.
On FSDP2 with an untied LM head, where verl's forwards get the weight's shard and verl's own op fails, the head runs
as an FSDP2 forward method of ``lm_head`` (:func:`_through_fsdp2_lm_head`).

Nothing falls back silently: verl's op must take ``(hidden_states, vocab_weights, input_ids, temperature)``, the
installed forward must import the op from its module at call time and read ``_verl_fused_kernels_backend``, and after
``apply_monkey_patch`` the model must carry the ``nemo_is`` backend (verl skips the fused patch for some model types,
e.g. ``kimi_vl``): otherwise :class:`~nemo_is_plugin.adapters.import_hooks.HostPatchError` while verl builds the model,
one line naming the fix. verl's own class refuses ``impl_backend=nemo_is`` with a ``ValueError``, so a forward that
reached it anyway would fail, not run verl's head.
"""

from __future__ import annotations

import dis
import functools
import importlib
import inspect
import logging
import types
import weakref
from types import ModuleType
from typing import Any

import torch

from nemo_is_plugin.adapters.import_hooks import HostPatchError
from nemo_is_plugin.distributed.head.fused_linear import fused_linear_logprobs

BACKEND = "nemo_is"  # actor_rollout_ref.model.fused_kernel_options.impl_backend, for both engines (head.py too)
PATCH_MODULE, PATCH, APPLY = (
    "verl.models.transformers.monkey_patch",
    "patch_forward_with_backends",
    "apply_monkey_patch",
)
# the modules whose forward_with_torch_backend verl 0.9.1's patch_forward_with_backends installs, by model type
FORWARD_MODULES = tuple(
    f"verl.models.transformers.{name}" for name in ("dense_common", "qwen2_vl", "qwen3_vl", "glm4v", "qwen3_5")
)
OP_MODULE, OP = "verl.utils.experimental.torch_functional", "FusedLinearForPPO"
BACKEND_ATTR = "_verl_fused_kernels_backend"  # where patch_forward_with_backends stores the backend on the model
OP_INIT_PARAMS = ("self", "chunk_size", "impl_backend")
OP_FORWARD_PARAMS = ("self", "hidden_states", "vocab_weights", "input_ids", "temperature")
HEAD_METHOD = "nemo_is_ppo_head"  # the FSDP2 forward method the head runs as on a sharded lm_head
_MODELS: weakref.WeakSet = weakref.WeakSet()  # the models built with the nemo_is backend
FIX = "set fused_kernel_options.impl_backend to torch (verl's) until the plugin supports it"
logger = logging.getLogger(__name__)


def ppo_logprobs_and_entropy(
    hidden_states: torch.Tensor, vocab_weights: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """What verl's ``FusedLinearForPPO.forward`` returns, on the plugin's head: log-probs of ``input_ids`` under
    ``softmax(hidden_states W^T / temperature)`` (fp32; fp64 for fp64 inputs) and the entropy in the hidden states'
    dtype (as verl's torch op casts it), both shaped like ``input_ids``; differentiable in the hidden states and W.
    A ``vocab_weights`` that is FSDP2's shard of a patched model's LM head runs through that module (see
    :func:`_through_fsdp2_lm_head`)."""
    from torch.distributed.tensor import DTensor

    if isinstance(vocab_weights, DTensor):
        return _through_fsdp2_lm_head(hidden_states, vocab_weights, input_ids, temperature)
    if hidden_states.dim() not in (2, 3) or hidden_states.shape[:-1] != input_ids.shape:
        raise ValueError(  # verl's torch op accepts [T, H] / [B, S, H] with labels of the leading shape
            f"hidden_states {tuple(hidden_states.shape)} and input_ids {tuple(input_ids.shape)} must be "
            "[T, H] / [T] or [B, S, H] / [B, S]"
        )
    logprobs, entropy = fused_linear_logprobs(
        hidden_states,
        vocab_weights,
        input_ids.to(torch.int64),
        None,  # the whole vocabulary is on this rank: no reduction
        temperature=float(temperature),
        with_entropy=True,
    )
    return logprobs, entropy.to(hidden_states.dtype)


def _lm_head_forward(self, hidden_states, input_ids, temperature):
    return ppo_logprobs_and_entropy(hidden_states, self.weight, input_ids, temperature)


def _through_fsdp2_lm_head(hidden_states, vocab_weights, input_ids, temperature):
    """verl's FSDP2 wrapping (``apply_fsdp2`` / ``_select_fsdp2_wrap_targets``, verl/utils/fsdp_utils.py) makes an
    untied ``lm_head`` its own FSDP2 unit, whose weight is whole only inside that module's forward; verl's fused
    forwards never call it, they read ``self.lm_head.weight``: this rank's shard, a DTensor (verl's own torch op fails
    on it: "got mixed torch.Tensor and DTensor"). The head runs here as a forward method of that module
    (torch's ``register_fsdp_forward_method``): FSDP2 all-gathers the weight before it, reshards after it and
    reduce-scatters its gradient, as for ``lm_head(hidden)``. Any other sharded weight is refused."""
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    lm_head = next((h for h in _output_embeddings() if getattr(h, "weight", None) is vocab_weights), None)
    if not isinstance(lm_head, FSDPModule):
        raise HostPatchError(
            f"verl's fused forward passed a sharded {type(vocab_weights).__name__} LM head that is not the weight "
            "of an FSDP2-wrapped lm_head of a model built with impl_backend=nemo_is: the plugin's head takes the "
            "whole [V, H] weight; set use_fused_kernels=False"
        )
    if not hasattr(lm_head, HEAD_METHOD):
        setattr(lm_head, HEAD_METHOD, types.MethodType(_lm_head_forward, lm_head))
        register_fsdp_forward_method(lm_head, HEAD_METHOD)  # type: ignore[arg-type]  # an FSDPModule is a Module
    return getattr(lm_head, HEAD_METHOD)(hidden_states, input_ids, temperature)


def _output_embeddings() -> list[Any]:
    """The LM heads of the models built with the ``nemo_is`` backend in this process (alive ones)."""
    heads = []
    for model in list(_MODELS):
        get = getattr(model, "get_output_embeddings", None)
        heads.append(get() if get is not None else getattr(model, "lm_head", None))
    return heads


def _plugin_op_class(verl_op: type) -> type:
    """verl's ``FusedLinearForPPO`` with one more ``impl_backend``, :data:`BACKEND`; verl's backends run verl's."""

    class PluginFusedLinearForPPO(verl_op):
        nemo_is_head = True

        def __init__(self, chunk_size: int = 512, impl_backend: str = "torch"):
            if impl_backend != BACKEND:
                super().__init__(chunk_size=chunk_size, impl_backend=impl_backend)
                return
            torch.nn.Module.__init__(self)  # verl's __init__ refuses a backend it does not know
            # the plugin sizes its chunks by memory (fused_linear.plan_chunks), not verl's 512 tokens
            self.chunk_size, self.impl_backend = chunk_size, impl_backend

        def forward(self, hidden_states, vocab_weights, input_ids, temperature=1.0):
            if self.impl_backend != BACKEND:
                return super().forward(hidden_states, vocab_weights, input_ids, temperature)
            return ppo_logprobs_and_entropy(hidden_states, vocab_weights, input_ids, temperature)

    PluginFusedLinearForPPO.__qualname__ = PluginFusedLinearForPPO.__name__ = OP
    return PluginFusedLinearForPPO


def _params(fn: Any) -> tuple[str, ...] | None:
    return None if fn is None else tuple(inspect.signature(fn).parameters)


def check_op(op: Any) -> None:
    """HostPatchError unless ``op`` (verl's ``FusedLinearForPPO``) takes the arguments the plugin's backend does."""
    found = (_params(getattr(op, "__init__", None)), _params(getattr(op, "forward", None)))
    if found != (OP_INIT_PARAMS, OP_FORWARD_PARAMS):
        raise HostPatchError(
            f"{OP_MODULE}.{OP} takes __init__{found[0]} / forward{found[1]}, the plugin's head stands in for "
            f"__init__{OP_INIT_PARAMS} / forward{OP_FORWARD_PARAMS}; {FIX}"
        )


def check_targets() -> None:
    """Without patching anything: HostPatchError unless the installed verl's op and the torch-backend forwards of
    every model type ``patch_forward_with_backends`` knows are what the plugin stands in for (``head_check``)."""
    module = importlib.import_module(OP_MODULE)
    check_op(getattr(module, "_nemo_is_original_" + OP, getattr(module, OP, None)))
    for name in FORWARD_MODULES:
        check_forward(getattr(importlib.import_module(name), "forward_with_torch_backend", None))


def install_op() -> type:
    """Put :func:`_plugin_op_class` in place of verl's ``FusedLinearForPPO`` (idempotent; verl's class is kept as
    ``_nemo_is_original_FusedLinearForPPO``); HostPatchError if verl's op is not the one the plugin stands in for."""
    module = importlib.import_module(OP_MODULE)
    current = getattr(module, OP, None)
    if getattr(current, "nemo_is_head", False):
        return current  # type: ignore[return-value]
    check_op(current)
    assert current is not None
    setattr(module, "_nemo_is_original_" + OP, current)
    replacement = _plugin_op_class(current)
    setattr(module, OP, replacement)
    return replacement


def check_forward(forward: Any) -> None:
    """HostPatchError unless ``forward`` (the model class's forward verl installed) builds ``FusedLinearForPPO`` from
    :data:`OP_MODULE` at call time (``from ... import``: the binding :func:`install_op` replaces) and reads the
    model's :data:`BACKEND_ATTR`."""
    code = getattr(forward, "__code__", None)
    ops = set() if code is None else {(i.opname, i.argval) for i in dis.get_instructions(code)}
    consts = () if code is None else code.co_consts
    if not ({("IMPORT_NAME", OP_MODULE), ("IMPORT_FROM", OP)} <= ops and BACKEND_ATTR in consts):
        name = f"{getattr(forward, '__module__', '?')}.{getattr(forward, '__qualname__', forward)}"
        raise HostPatchError(
            f"{name} does not build {OP_MODULE}.{OP} from the model's {BACKEND_ATTR} at call time: the plugin's "
            f"head cannot run in it; {FIX}"
        )


def plugin_backend_on(model: Any) -> bool:
    """Whether ``model``'s fused forward runs the plugin's head (its backend is ``nemo_is`` and verl's op is the
    plugin's in this process)."""
    op = getattr(importlib.import_module(OP_MODULE), OP, None)
    return getattr(model, BACKEND_ATTR, None) == BACKEND and getattr(op, "nemo_is_head", False)


def _wrap_patch(module: ModuleType) -> None:
    original = getattr(module, PATCH, None)
    if original is None or getattr(original, "nemo_is_hook", False):
        return

    @functools.wraps(original)
    def patch_forward_with_backends(model, use_fused_kernels=False, fused_kernels_backend=None, *args, **kwargs):
        if not (use_fused_kernels and fused_kernels_backend == BACKEND):
            return original(model, use_fused_kernels, fused_kernels_backend, *args, **kwargs)
        install_op()
        original(model, True, "torch", *args, **kwargs)  # verl picks the model type's torch-backend forward
        if getattr(model, BACKEND_ATTR, None) != "torch":
            raise HostPatchError(
                f"{PATCH_MODULE}.{PATCH} did not set the model's {BACKEND_ATTR} for the torch backend: the plugin's "
                f"head cannot be selected on {type(model).__name__}; {FIX}"
            )
        check_forward(type(model).forward)
        setattr(model, BACKEND_ATTR, BACKEND)
        _MODELS.add(model)
        logger.info("verl's fused forward of %s runs on the plugin's head (impl_backend=%s)", type(model), BACKEND)

    patch_forward_with_backends.nemo_is_hook = True  # type: ignore[attr-defined]
    setattr(module, PATCH, patch_forward_with_backends)


def _wrap_apply(module: ModuleType) -> None:
    """After verl's ``apply_monkey_patch``, a model that asked for ``nemo_is`` must carry it (verl returns before its
    fused patch for some model types, and a verl that stops calling ``patch_forward_with_backends`` by name would
    bypass the hook above)."""
    original = getattr(module, APPLY, None)
    if original is None or getattr(original, "nemo_is_hook", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def apply_monkey_patch(*args, **kwargs):
        result = original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        asked = arguments.get("use_fused_kernels") and arguments.get("fused_kernels_backend") == BACKEND
        if asked and not plugin_backend_on(arguments.get("model")):
            model_type = getattr(getattr(arguments.get("model"), "config", None), "model_type", "?")
            raise HostPatchError(
                f"verl's {APPLY} installed no fused forward on the plugin's head for model_type {model_type!r} "
                f"(use_fused_kernels=True, impl_backend={BACKEND}): the plugin's head would not run; set "
                "use_fused_kernels=False for this model"
            )
        return result

    apply_monkey_patch.nemo_is_hook = True  # type: ignore[attr-defined]
    setattr(module, APPLY, apply_monkey_patch)


def on_patch_module(module: ModuleType) -> None:
    """The after-import hook on verl's monkey-patch module (registered by ``head.install_hooks``)."""
    _wrap_patch(module)
    _wrap_apply(module)


__all__ = [
    "check_forward",
    "check_op",
    "check_targets",
    "install_op",
    "on_patch_module",
    "plugin_backend_on",
    "ppo_logprobs_and_entropy",
]
