"""Every log-prob path the benchmark knows, in ``PATHS`` order: the plugin's own
(:mod:`nemo_is_plugin.apps.bench.paths`), their Triton variants and the baselines
(:mod:`nemo_is_plugin.apps.bench.liger`, :mod:`nemo_is_plugin.apps.bench.cce`), each marked ``unavailable`` where it
cannot run."""

from __future__ import annotations

from dataclasses import replace

import torch

from nemo_is_plugin.apps.bench.cce import cce_path
from nemo_is_plugin.apps.bench.liger import liger_path
from nemo_is_plugin.apps.bench.paths import FUSED_VARIANTS, PLUGIN_PATHS, LogprobPath, fused_path, logprob_paths


def _triton_unavailable(device: torch.device) -> str | None:
    try:
        from nemo_is_plugin.kernels.triton_logprob import triton_usable
    except ImportError as exc:
        return f"the Triton kernels do not import ({exc})"
    if not triton_usable(device):
        return f"the Triton backend needs a CUDA device and triton (device here: {device.type})"
    return None


def bench_paths(chunk_size: int | None = None, device: torch.device | None = None) -> list[LogprobPath]:
    """Every path the benchmark knows (``PATHS`` order), with ``unavailable`` filled in for ``device``."""
    device = device or torch.device("cpu")
    paths = logprob_paths(chunk_size)
    for variant in FUSED_VARIANTS:
        if variant.name in PLUGIN_PATHS:
            continue
        path = fused_path(variant, chunk_size)
        why = _triton_unavailable(device) if variant.kwargs.get("backend") == "triton" else None
        paths.append(replace(path, unavailable=why) if why and not path.unavailable else path)
    return paths + [liger_path(device), cce_path(device)]


__all__ = ["bench_paths"]
