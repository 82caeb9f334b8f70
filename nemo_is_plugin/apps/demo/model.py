"""The tiny MoE causal LM, built with megatron-core on CPU, trained with tensor parallelism over gloo.

Layout (see docs/demo.md): TP=2 for everything (attention, experts, embedding, LM head) *with sequence
parallelism*. megatron-core refuses MoE at TP>1 in training mode without sequence parallelism, and its local spec's
``WrappedTorchNorm`` refuses sequence parallelism; so the layer spec below swaps the norms for :class:`SPRMSNorm`, a
plain RMSNorm whose weight is marked ``sequence_parallel`` (its gradient is partial per TP rank and is all-reduced in
:func:`allreduce_sequence_parallel_grads`, which is what Megatron's DDP does on GPU). gloo supports the
reduce-scatter / all-gather that sequence parallelism needs.

CPU patches (``apply_cpu_patches``): attention-mask and RoPE buffers hard-code ``torch.cuda.current_device()``; the
RNG tracker forks CUDA generators; the MoE router calls Transformer Engine's GEMM when the name exists.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nemo_is_plugin.apps.moe_gpt import moe_gpt_settings, untied_rope_gpt


@dataclass(frozen=True)
class ModelShape:
    """Shape of the tiny MoE model. head_dim = hidden / heads; the vocabulary must divide by the TP size."""

    vocab_size: int = 16
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    experts: int = 4
    topk: int = 2
    expert_ffn: int = 128
    max_seq_len: int = 4608
    rotary_base: int = 10000
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class _CPURNGTracker:
    """Stand-in for Megatron's CUDA RNG tracker: named CPU generator states, forked around a block."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}

    def is_initialized(self) -> bool:
        return True

    def reset(self) -> None:
        self.states = {}

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = dict(states)

    def add(self, name: str, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.states[name] = gen.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states:
            self.add(name, 1234)
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def _cpu_current_device() -> str:
    return "cpu"


def apply_cpu_patches() -> None:
    """The three patches megatron-core 0.16.1 needs to build and train GPTModel + MoE on CPU (idempotent)."""
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.moe.moe_utils as moe_utils

    # Buffers are allocated on current_device(); make that the CPU. megatron-core passes the value on as a device, so a
    # device name works.
    torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]  # torch types it as a CUDA index
    if not isinstance(mrandom._CUDA_RNG_STATE_TRACKER, _CPURNGTracker):
        mrandom._CUDA_RNG_STATE_TRACKER = _CPURNGTracker()
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    moe_utils.te_general_gemm = None  # without Transformer Engine the name is unbound -> NameError in the router


class SPRMSNorm(torch.nn.RMSNorm):
    """RMSNorm accepting Megatron's norm-constructor signature and sequence parallelism.

    Under sequence parallelism each TP rank normalises its own slice of the sequence, so the weight gradient is a
    partial sum: the ``sequence_parallel`` attribute tells :func:`allreduce_sequence_parallel_grads` to sum it.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused) -> None:
        super().__init__(hidden_size, eps=eps)
        sp = bool(config.sequence_parallel)
        self.weight.sequence_parallel = sp  # type: ignore[attr-defined]  # Megatron's parameter tag, untyped in torch


def init_distributed(rank: int, world_size: int, tp: int, master_addr: str, master_port: int) -> None:
    """gloo process group + Megatron parallel state (TP=tp, DP=world/tp), then the CPU patches."""
    from megatron.core import parallel_state

    os.environ["MASTER_ADDR"] = master_addr
    os.environ["MASTER_PORT"] = str(master_port)
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    apply_cpu_patches()


def build_gpt(shape: ModelShape, tp: int, seed: int):
    """GPTModel with ``shape.experts`` SwiGLU experts (top-k softmax router), RoPE, RMSNorm, untied LM head.

    All ranks draw the same master weights (``use_cpu_initialization`` initialises the full matrix from the global
    CPU generator and keeps this rank's slice), so TP=1 and TP=2 models built with one seed are the same network.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    apply_cpu_patches()
    config = TransformerConfig(
        **moe_gpt_settings(shape, torch.float32, init_std=0.05, cpu_init=True),
        moe_router_dtype="fp32",
        tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1,  # MoE + TP>1 trains only with sequence parallelism
        layernorm_epsilon=shape.norm_eps,
    )
    layer_spec = get_gpt_layer_local_spec(num_experts=shape.experts, normalization="RMSNorm")
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        setattr(layer_spec.submodules, name, SPRMSNorm)
    block_spec = TransformerBlockSubmodules(layer_specs=[layer_spec] * shape.layers, layer_norm=SPRMSNorm)
    return untied_rope_gpt(
        config,
        block_spec,
        vocab=shape.vocab_size,
        max_seq_len=shape.max_seq_len,
        seed=seed,
        rotary_base=shape.rotary_base,
    )


def allreduce_sequence_parallel_grads(model: torch.nn.Module, tp_group) -> None:
    """Sum the partial gradients of replicated weights that saw only this rank's slice of the sequence."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return
    grads = [p.grad for p in model.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=tp_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def grad_norm(model: torch.nn.Module, tp_group) -> float:
    """Global L2 gradient norm: TP-sharded weights summed over ranks, replicated weights counted once."""
    sharded = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        if p.grad is None:
            continue
        sq = p.grad.detach().double().pow(2).sum()
        if getattr(p, "tensor_model_parallel", False):
            sharded += sq
        else:
            replicated += sq
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(sharded, group=tp_group)
    return float((sharded + replicated).sqrt())


def _gather(t: torch.Tensor, tp_group) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, t.contiguous(), group=tp_group)
    return parts


def full_state_dict(model: torch.nn.Module, tp_group) -> dict[str, torch.Tensor]:
    """The unsharded weights (identical on every TP rank), keyed by Megatron parameter name.

    A gated ``linear_fc1`` shard is ``[gate_r; up_r]`` (Megatron chunks the local output in two), so the full matrix
    is ``[gate_0; gate_1; up_0; up_1]``: the halves are gathered separately.
    """
    world = 1 if tp_group is None else dist.get_world_size(tp_group)
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if world == 1 or not getattr(p, "tensor_model_parallel", False):
            out[name] = t.clone()
            continue
        dim = p.partition_dim  # type: ignore[attr-defined]  # Megatron's tag on TP-sharded parameters, untyped in torch
        if name.endswith("linear_fc1.weight"):
            gate, up = t.chunk(2, dim=0)
            out[name] = torch.cat(_gather(gate, tp_group) + _gather(up, tp_group), dim=0)
        else:
            out[name] = torch.cat(_gather(t, tp_group), dim=dim)
    return out
