"""The megatron-core MoE GPT model the model-step benchmark (``model_step``) trains: its shapes, the model and the
world-size-1 parallel state it runs in, and the switch that bypasses its LM head.

``GPTModel`` with the local layer spec (no Transformer Engine / Apex), RMSNorm, RoPE, SwiGLU experts with a top-k
softmax router and the all-gather dispatcher, untied LM head; bf16 parameters on CUDA. ``GPU_STEP_SHAPE`` keeps
Qwen3-30B-A3B's head (hidden 2048, vocab 151,936, expert FFN 768, 32 heads / 4 KV groups as 16 x 128 here) and scales
the body down to fit one GPU (2 layers, 16 experts top-4 instead of 48 layers, 128 experts top-8).
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nemo_is_plugin.apps.bench.device import BenchDevice
from nemo_is_plugin.apps.moe_gpt import moe_gpt_settings, untied_rope_gpt


@dataclass(frozen=True)
class StepShape:
    """A GPT MoE model and its batch (``batch`` sequences of ``seq_len`` tokens)."""

    name: str
    hidden: int
    vocab: int
    layers: int
    heads: int
    query_groups: int
    experts: int
    topk: int
    expert_ffn: int
    batch: int
    seq_len: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len


GPU_STEP_SHAPE = StepShape(
    "Qwen3-30B-A3B head, scaled body",
    hidden=2048,
    vocab=151936,
    layers=2,
    heads=16,
    query_groups=4,
    experts=16,
    topk=4,
    expert_ffn=768,
    batch=4,
    seq_len=2048,
)
QUICK_STEP_SHAPE = StepShape(
    "tiny",
    hidden=64,
    vocab=512,
    layers=2,
    heads=4,
    query_groups=2,
    experts=4,
    topk=2,
    expert_ffn=128,
    batch=2,
    seq_len=33,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def single_process_parallel(dev: BenchDevice, seed: int):
    """torch.distributed with world size 1 (NCCL on CUDA, gloo on CPU) and Megatron's parallel state at TP = PP = 1;
    torn down on exit if this context created it. CPU: the demo's patches for megatron-core without a GPU."""
    from megatron.core import parallel_state, tensor_parallel

    created = not dist.is_initialized()
    if created:
        if dev.is_cuda:
            torch.cuda.set_device(dev.device)
        dist.init_process_group(
            "nccl" if dev.is_cuda else "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
        )
    made_state = not parallel_state.model_parallel_is_initialized()
    if made_state:
        parallel_state.initialize_model_parallel(1, 1)
    if dev.is_cuda:
        import megatron.core.transformer.moe.moe_utils as moe_utils

        if not hasattr(moe_utils, "te_general_gemm"):  # without Transformer Engine the router would hit a NameError
            moe_utils.te_general_gemm = None
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        from nemo_is_plugin.apps.demo.model import apply_cpu_patches

        apply_cpu_patches()
    try:
        yield
    finally:
        if made_state:
            parallel_state.destroy_model_parallel()
        if created:
            dist.destroy_process_group()


def build_model(shape: StepShape, dev: BenchDevice, seed: int):
    """The MoE ``GPTModel`` on ``dev`` in ``dev.dtype`` (see the module docstring)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    half = dev.dtype in (torch.bfloat16, torch.float16)
    settings = dict(
        moe_gpt_settings(shape, dev.dtype, init_std=0.02, cpu_init=not dev.is_cuda),
        num_query_groups=shape.query_groups,
        moe_grouped_gemm=False,
        moe_router_dtype="fp32" if half else None,
    )
    known = {f.name for f in dataclasses.fields(TransformerConfig)}  # megatron-core versions differ in their fields
    config = TransformerConfig(**{k: v for k, v in settings.items() if k in known and v is not None})
    spec = get_gpt_layer_local_spec(num_experts=shape.experts, moe_grouped_gemm=False, normalization="RMSNorm")
    model = untied_rope_gpt(config, spec, vocab=shape.vocab, max_seq_len=shape.seq_len, seed=seed)
    return model.to(device=dev.device)  # parameters are already in params_dtype; buffers keep theirs


@contextlib.contextmanager
def head_bypassed(model):
    """The output layer returns its input: the model's output is the final-normed hidden states ``[B, S, H]``."""

    def identity(hidden, weight=None, runtime_gather_output=None, **_unused):
        return hidden, None

    model.output_layer.forward = identity
    try:
        yield
    finally:
        del model.output_layer.forward


__all__ = [
    "GPU_STEP_SHAPE",
    "QUICK_STEP_SHAPE",
    "StepShape",
    "build_model",
    "head_bypassed",
    "single_process_parallel",
]
