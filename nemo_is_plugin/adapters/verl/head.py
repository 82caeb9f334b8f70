"""verl's Megatron fused forward on the plugin's head, switched on from verl's own model config.

verl's Megatron engine with ``actor_rollout_ref.model.use_fused_kernels=True`` computes log-probs and entropy straight
from the decoder's hidden states: ``verl/models/mcore/model_forward_fused.py`` (``fused_output_processor``, Megatron's
output-processor hook, and ``_fused_GPTModel_forward``, the patched forward of older megatron-core) and the 1F1B
overlap path (``verl/models/mcore/model_forward_1f1b_overlap.py``) all call the module global ``linear_cross_entropy``
(``verl/utils/kernel/linear_cross_entropy.py``: verl's Triton kernel) as

    logprobs, entropy = linear_cross_entropy(hidden, weight, labels, temperature, "none", tp_group)

with ``hidden [T, 1, H]`` (sequence-parallel rows already all-gathered by Megatron's
``gather_from_sequence_parallel_region``), ``weight [V/TP, H]``, ``labels [1, T]`` already rolled and CP-sharded by
verl, and gets ``[T]`` fp32 log-probs and entropy of ``softmax(h W^T / temperature)``; the hidden states' gradient it
returns is this rank's share: with sequence parallelism the gather's backward sums the shares over TP (a
reduce-scatter); without it each rank keeps its share, as verl's kernel does.

:func:`linear_cross_entropy` here takes the same arguments and returns the same thing, computed by the plugin's chunked
head (:func:`~nemo_is_plugin.distributed.head.fused_linear.fused_linear_logprobs` with ``reduce_grad_hidden=False``).

The switch, in verl's words: ``actor_rollout_ref.model.fused_kernel_options.impl_backend=nemo_is`` together with
``actor_rollout_ref.model.use_fused_kernels=True`` (verl's ``fused_kernel_options.impl_backend`` names the fused
kernels' implementation; its Megatron engine reads no other value). The plugin's ``verl.plugins`` entry point, which
verl loads at ``import verl`` in every process, calls :func:`install_hooks`: on import of verl's model config and
Megatron engine modules it wraps ``HFModelConfig.__post_init__`` (refuses ``nemo_is`` without ``use_fused_kernels``,
and a verl whose engine cannot be patched) and ``MegatronEngine._maybe_enable_fused_kernels`` (which verl runs while
initialising an engine, before its first forward): when that engine's model config asks for ``nemo_is`` and verl kept
its fused kernels on, the two modules' ``linear_cross_entropy`` become the plugin's in that process. A missing
function, a changed signature or a module that no longer calls it by name raises
:class:`~nemo_is_plugin.adapters.import_hooks.HostPatchError` instead of leaving verl's kernel running.

The same switch on verl's FSDP engine (Hugging Face models) runs the plugin's head as a third backend of verl's
``FusedLinearForPPO``: :mod:`~nemo_is_plugin.adapters.verl.fsdp_head`, hooked on verl's
``verl.models.transformers.monkey_patch`` by :func:`install_hooks`.
"""

from __future__ import annotations

import dis
import importlib
import inspect
import logging
from types import FunctionType, ModuleType
from typing import Any

import torch

from nemo_is_plugin.adapters.import_hooks import HostPatchError
from nemo_is_plugin.adapters.verl import fsdp_head
from nemo_is_plugin.adapters.verl.fsdp_head import BACKEND
from nemo_is_plugin.distributed.head.fused_linear import fused_linear_logprobs
from nemo_is_plugin.distributed.parallel.groups import ProcessGroup, effective

TARGET = "linear_cross_entropy"
KERNEL_MODULE = "verl.utils.kernel.linear_cross_entropy"
FUSED_MODULES = ("verl.models.mcore.model_forward_fused", "verl.models.mcore.model_forward_1f1b_overlap")
CONFIG_MODULE, ENGINE_MODULE = "verl.workers.config.model", "verl.workers.engine.megatron.transformer_impl"
ENGINE_CLASS, ENGINE_METHOD = "MegatronEngine", "_maybe_enable_fused_kernels"
KERNEL_PARAMS = ("ctx", "hidden", "weight", "labels", "temperature", "reduction", "dist_process_group")
_STATE: dict[str, Any] = {"requested": False, "engine_unsupported": None}
logger = logging.getLogger(__name__)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    reduction: str = "none",
    dist_process_group: ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``linear_cross_entropy`` on the plugin's head: ``(logprobs, entropy)`` of ``labels`` under
    ``softmax(hidden W^T / temperature)``, flattened to ``[N]`` (``reduction`` "sum" / "mean": the log-probs' sum or
    mean, a scalar, as verl's), the weight's rows sharded over ``dist_process_group``; dX is this rank's share."""
    if reduction.lower() not in ("none", "sum", "mean"):
        raise ValueError(f"reduction must be 'none', 'sum' or 'mean' (verl's), got {reduction!r}")
    lp, ent = fused_linear_logprobs(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        labels.reshape(-1),
        effective(dist_process_group),
        temperature=float(temperature),
        with_entropy=True,
        reduce_grad_hidden=False,
    )
    if reduction.lower() == "sum":
        return lp.sum(), ent
    if reduction.lower() == "mean":
        return lp.mean(), ent
    return lp, ent


linear_cross_entropy.nemo_is_head = True  # type: ignore[attr-defined]  # marks the replacement


def _references(module: ModuleType, name: str) -> bool:
    """Whether code defined in ``module`` (functions, methods, nested functions) loads ``name`` as a global: the
    binding the patch replaces. ``co_names`` is not enough: an attribute access (``kernel.linear_cross_entropy(...)``)
    puts the name there too, and the patch would then rebind a global nobody calls; so the bytecode is read, and only
    a ``LOAD_GLOBAL`` / ``LOAD_NAME`` of ``name`` counts (``LOAD_ATTR`` / ``LOAD_METHOD`` do not)."""
    seen: set[int] = set()
    codes = []
    for value in vars(module).values():
        members = vars(value).values() if isinstance(value, type) else [value]
        codes += [m.__code__ for m in members if isinstance(m, FunctionType) and m.__module__ == module.__name__]
    while codes:
        code = codes.pop()
        if id(code) in seen:
            continue
        seen.add(id(code))
        if name in code.co_names and any(
            ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and ins.argval == name for ins in dis.get_instructions(code)
        ):
            return True
        codes += [c for c in code.co_consts if inspect.iscode(c)]
    return False


def check_targets(modules: list[ModuleType], kernel: ModuleType) -> None:
    """Raise :class:`HostPatchError` unless verl's kernel has the signature the plugin stands in for and every fused
    module calls ``linear_cross_entropy`` by name."""
    fn = getattr(getattr(kernel, "LinearCrossEntropy", None), "forward", None)
    found = None if fn is None else tuple(inspect.signature(fn).parameters)
    if found != KERNEL_PARAMS:
        raise HostPatchError(
            f"{KERNEL_MODULE}.LinearCrossEntropy.forward takes {found}, the plugin's head stands in for "
            f"{KERNEL_PARAMS}; set fused_kernel_options.impl_backend back to verl's until the plugin supports it"
        )
    for module in modules:
        if not hasattr(module, TARGET) or not _references(module, TARGET):
            raise HostPatchError(
                f"{module.__name__} no longer calls {TARGET} by name: the plugin's head cannot replace verl's there; "
                "set fused_kernel_options.impl_backend back to verl's"
            )


def install_head() -> None:
    """Replace ``linear_cross_entropy`` in verl's fused-forward modules by the plugin's (idempotent; the original
    is kept as ``module._nemo_is_original_linear_cross_entropy``)."""
    modules = [importlib.import_module(name) for name in FUSED_MODULES]
    check_targets(modules, importlib.import_module(KERNEL_MODULE))
    for module in modules:
        if "_nemo_is_original_" + TARGET not in vars(module):
            setattr(module, "_nemo_is_original_" + TARGET, getattr(module, TARGET))
        setattr(module, TARGET, linear_cross_entropy)


def requested(model_config: Any) -> bool:
    """Whether verl's model config asks for the plugin's head; ValueError for ``nemo_is`` without fused kernels."""
    options = getattr(model_config, "fused_kernel_options", None) or {}
    if options.get("impl_backend") != BACKEND:
        return False
    if not getattr(model_config, "use_fused_kernels", False):
        raise ValueError(
            f"fused_kernel_options.impl_backend={BACKEND} selects the plugin's head for verl's fused kernels, which "
            "are off: also set actor_rollout_ref.model.use_fused_kernels=True"
        )
    return True


def _on_config_module(module: ModuleType) -> None:
    cls = getattr(module, "HFModelConfig", None)
    if cls is None or getattr(cls.__post_init__, "nemo_is_hook", False):
        return
    original = cls.__post_init__

    def __post_init__(self):
        original(self)
        if requested(self):
            _STATE["requested"] = True
            if _STATE["engine_unsupported"]:
                raise HostPatchError(_STATE["engine_unsupported"])

    __post_init__.nemo_is_hook = True  # type: ignore[attr-defined]
    cls.__post_init__ = __post_init__


def _on_engine_module(module: ModuleType) -> None:
    cls = getattr(module, ENGINE_CLASS, None)
    original = getattr(cls, ENGINE_METHOD, None)
    if original is None:
        _STATE["engine_unsupported"] = (
            f"{ENGINE_MODULE}.{ENGINE_CLASS}.{ENGINE_METHOD} does not exist in this verl: the plugin's head cannot "
            f"be switched on there (fused_kernel_options.impl_backend={BACKEND})"
        )
        if _STATE["requested"]:
            raise HostPatchError(_STATE["engine_unsupported"])
        return
    if getattr(original, "nemo_is_hook", False):
        return

    def _maybe_enable_fused_kernels(self):
        original(self)
        if not requested(self.model_config):
            if getattr(self.engine_config, "use_fused_kernels", False) and head_installed():
                raise HostPatchError(
                    "this process already runs verl's fused kernels on the plugin's head for another engine; give "
                    f"every engine in it fused_kernel_options.impl_backend={BACKEND}, or none"
                )
            return
        if getattr(self.engine_config, "use_fused_kernels", False):
            install_head()
        else:
            logger.warning("verl turned its fused kernels off for this engine: the plugin's head does not run here")

    _maybe_enable_fused_kernels.nemo_is_hook = True  # type: ignore[attr-defined]
    setattr(cls, ENGINE_METHOD, _maybe_enable_fused_kernels)


def install_hooks() -> None:
    """Register the config and engine hooks, and the FSDP models' fused-forward hook (``fsdp_head``) (the
    ``verl.plugins`` entry point calls this in every verl process)."""
    from nemo_is_plugin.adapters.import_hooks import when_imported

    when_imported(CONFIG_MODULE, "nemo_is.verl_head.config", _on_config_module)
    when_imported(ENGINE_MODULE, "nemo_is.verl_head.engine", _on_engine_module)
    when_imported(fsdp_head.PATCH_MODULE, "nemo_is.verl_head.fsdp", fsdp_head.on_patch_module)


def head_installed() -> bool:
    """Whether verl's fused-forward modules run the plugin's head in this process (without importing them)."""
    import sys

    loaded = [sys.modules.get(name) for name in FUSED_MODULES]
    return any(getattr(getattr(m, TARGET, None), "nemo_is_head", False) for m in loaded if m is not None)


__all__ = [
    "BACKEND",
    "check_targets",
    "head_installed",
    "install_head",
    "install_hooks",
    "linear_cross_entropy",
    "requested",
]
