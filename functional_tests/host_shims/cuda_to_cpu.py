"""Tensors a host names the GPU for, made on the CPU: the one device shim the NeMo-RL and slime steps share.

Each host module documents the calls it needs this for (file and line); this module holds only the mechanism.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def on_cpu(device: Any) -> Any:
    """``device`` with CUDA replaced by the CPU (a string or a torch.device); anything else unchanged."""
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class CudaToCpu(TorchFunctionMode):
    """Within it, ``.cuda()`` is a no-op, ``device=`` and ``.to(...)`` naming CUDA name the CPU, ``pin_memory=True``
    (page-locked memory for copies to a GPU, which needs one) is off, and, with
    ``cuda_type_names``, ``Tensor.type()`` answers with the CUDA type name (for hosts that assert a tensor's type by
    name, e.g. megatron-core's ``'torch.cuda.FloatTensor'`` checks)."""

    def __init__(self, *, cuda_type_names: bool = False) -> None:
        super().__init__()
        self.cuda_type_names = cuda_type_names

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if self.cuda_type_names and func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs:
            kwargs["device"] = on_cpu(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to:
            args = tuple(on_cpu(a) for a in args)
        return func(*args, **kwargs)
