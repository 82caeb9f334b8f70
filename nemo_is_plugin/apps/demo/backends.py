"""Picks the rollout backend by name: ``cpu`` (:class:`~nemo_is_plugin.apps.demo.rollout.CPUBackend`) or ``vllm``
(:class:`~nemo_is_plugin.apps.demo.vllm_backend.VLLMBackend`, imported only when asked for)."""

from __future__ import annotations

import importlib.util

import torch

from nemo_is_plugin.apps.demo.model import ModelShape
from nemo_is_plugin.apps.demo.rollout import CPUBackend, RolloutBackend


def vllm_available() -> bool:
    """vLLM is importable and a CUDA device is visible (the official wheel is CUDA-only)."""
    return importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()


def make_backend(
    name: str, shape: ModelShape, precision: str, temperature: float, seed: int, top_k: int = 0
) -> RolloutBackend:
    """``top_k > 0``: the backend also returns its top-k head per token (score centering); only ``cpu`` does."""
    if name == "cpu":
        return CPUBackend(shape, precision, temperature, top_k)
    if top_k:
        raise ValueError(
            f"a score-centering setting needs the sampler's top-{top_k} head: only the cpu backend returns it "
            "(use --backend cpu, or leave the score-centering setting out)"
        )
    if name == "vllm":
        if not vllm_available():
            raise RuntimeError(
                "rollout backend 'vllm' needs the vllm package and a CUDA GPU (pip install 'nemo-is-plugin[vllm]'); "
                "use --backend cpu on this machine"
            )
        from nemo_is_plugin.apps.demo.vllm_backend import VLLMBackend

        return VLLMBackend(shape, precision=precision, temperature=temperature, seed=seed)
    raise ValueError(f"unknown rollout backend {name!r}: use 'cpu' or 'vllm'")
