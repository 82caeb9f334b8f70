"""megatron-core 0.16.1 on a CPU for verl 0.9.1's Megatron engine (mbridge 0.15.1 building the model).

What each piece works around (megatron-core paths inside ``megatron/core``, tag core_v0.16.1 of NVIDIA/Megatron-LM):

- ``torch.cuda.current_device``: megatron-core allocates on it (``tensor_parallel/layers.py``,
  ``distributed/param_and_grad_buffer.py`` for the DDP grad buffers, ``optimizer/clip_grads.py`` for grad-norm
  clipping, ``pipeline_parallel/schedules.py``) and passes the value on as a device; ``"cpu"`` is a device too
  (``nemo_is_plugin.apps.demo.model.apply_cpu_patches``, shared with the demo, also replaces the CUDA RNG tracker that
  ``tensor_parallel/random.py`` line 235 builds on ``torch.cuda.get_rng_state``, called by verl's
  ``verl/workers/engine/megatron/utils.py`` line 38, ``set_random_seed``).
- ``Module.cuda(torch.cuda.current_device())``: mbridge moves the built model there (``mbridge/core/util.py`` line
  151, ``get_model``); with the device above being ``"cpu"``, ``Module.cuda("cpu")`` stays on the CPU (any other
  argument is torch's).
- ``device="cuda"`` written into megatron-core's factory calls: the optimizer's buffers
  (``optimizer/optimizer.py`` lines 473-485 and 907), grad-norm clipping (``optimizer/clip_grads.py`` lines 90-207),
  the schedules' token counts (``pipeline_parallel/schedules.py`` lines 596, 983, 2138), the grad buffers' warm-up
  tensor (``distributed/param_and_grad_buffer.py`` line 768), the local multi-tensor L2 norm that clipping falls back
  to without Apex / Transformer Engine (``utils.py`` line 1207): those modules see a ``torch`` whose tensor factories
  (``tensor``, ``zeros``, ``ones``, ``empty``, ``full``, ``arange``) put a CUDA device on the CPU
  (``CUDA_TO_CPU_MODULES``); everything else is torch itself.
- ``param.grad.type() == 'torch.cuda.FloatTensor'``, asserted before clipping (``optimizer/clip_grads.py`` line
  167, ``clip_grad_by_total_norm_fp32``, called from ``optimizer/optimizer.py`` lines 215 and 1324): during that call
  only, a CPU float tensor's ``type()`` names the CUDA type it stands for.
- the layer spec: mbridge builds Transformer Engine's (``mbridge/core/llm_bridge.py`` line 149,
  ``get_gpt_decoder_block_spec(config, use_transformer_engine=True)``); without Transformer Engine the model is built
  from megatron-core's local spec (``models/gpt/gpt_layer_specs.py``, ``get_gpt_layer_local_spec``) with an RMSNorm
  that accepts sequence parallelism (``transformer/torch_norm.py`` line 32 refuses it; the demo's ``SPRMSNorm``) and
  ``PackedCausalAttention`` below.
- the local spec's parameter names: its norms are modules of their own (``input_layernorm.weight``,
  ``pre_mlp_layernorm.weight``) where Transformer Engine's spec fuses them into the next linear
  (``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``), the only names mbridge maps
  to a checkpoint (``mbridge/core/bridge.py`` line 646, ``_weight_name_mapping_other``, raises on the others): the
  local names are looked up under the fused ones (the same tensors).
- ``PackedCausalAttention``: verl's engine with remove-padding packs the micro-batch's sequences (THD,
  ``PackedSeqParams``); the local spec's ``DotProductAttention`` refuses packed sequences
  (``transformer/dot_product_attention.py`` line 153). This runs causal ``scaled_dot_product_attention`` on each
  packed sequence (``cu_seqlens_q_padded`` when verl pads each one for TP / SP, else ``cu_seqlens_q``), the
  attention Transformer Engine's fused kernel computes there.
"""

from __future__ import annotations

import importlib
import types

import torch
import torch.nn.functional as F

CUDA_TO_CPU_MODULES = (
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.utils",
)
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like", "empty_like")


def _on_cpu(device):
    if device is None:
        return None
    if str(device).startswith("cuda") or isinstance(device, int):
        return "cpu"
    return device


class _CudaToCpuTorch(types.ModuleType):
    """``torch``, with its tensor factories mapping a CUDA device to the CPU (a module's global ``torch`` only)."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str):
        value = getattr(torch, name)
        if name in _FACTORIES:

            def factory(*args, _fn=value, **kwargs):
                if "device" in kwargs:
                    kwargs["device"] = _on_cpu(kwargs["device"])
                return _fn(*args, **kwargs)

            return factory
        return value


def _with_cuda_type_names(fn):
    """``fn`` with ``Tensor.type()`` (no argument) answering ``torch.cuda.<T>`` for a CPU tensor while it runs."""
    tensor_type = torch.Tensor.type

    def cuda_type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = tensor_type(self)
            return name.replace("torch.", "torch.cuda.", 1) if self.device.type == "cpu" else name
        return tensor_type(self, dtype, non_blocking, **kwargs)

    def wrapped(*args, **kwargs):
        torch.Tensor.type = cuda_type  # type: ignore[method-assign,assignment]
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.type = tensor_type  # type: ignore[method-assign]

    wrapped._nemo_is_cpu = True  # type: ignore[attr-defined]
    return wrapped


LOCAL_TO_FUSED_NORMS = {
    ".input_layernorm.weight": ".self_attention.linear_qkv.layer_norm_weight",
    ".pre_mlp_layernorm.weight": ".mlp.linear_fc1.layer_norm_weight",
}


def packed_causal_attention_cls():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class PackedCausalAttention(DotProductAttention):
        """Megatron's local core attention, plus THD packed sequences (causal, each sequence on its own)."""

        def forward(
            self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
        ):
            if packed_seq_params is None:
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
            assert packed_seq_params.qkv_format == "thd", packed_seq_params.qkv_format
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            # query [t, np, hn], key / value [t, ng, hn] (Attention.forward squeezes the dummy batch for THD)
            groups = query.shape[1] // key.shape[1]
            if groups > 1:
                key = key.repeat_interleave(groups, dim=1)
                value = value.repeat_interleave(groups, dim=1)
            bounds = cu.tolist()
            out = []
            for start, end in zip(bounds[:-1], bounds[1:], strict=True):
                if end == start:
                    continue
                q, k, v = (x[start:end].transpose(0, 1) for x in (query, key, value))  # [np, s, hn]
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
                out.append(o.transpose(0, 1))
            tail = query.shape[0] - bounds[-1]
            if tail > 0:  # tokens past the last sequence (none in verl's packing): zeros, as no sequence holds them
                out.append(query.new_zeros(tail, *query.shape[1:]))
            return torch.cat(out, dim=0).reshape(query.shape[0], -1)

    return PackedCausalAttention


def local_decoder_block_spec(config):
    """megatron-core's local GPT layer spec for a dense RMSNorm model (Qwen2 / Llama), with the SP-capable RMSNorm
    and the packed-sequence attention, as a block spec of ``config.num_layers`` layers."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from nemo_is_plugin.apps.demo.model import SPRMSNorm

    layer = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=bool(getattr(config, "qk_layernorm", False)))
    layer.submodules.input_layernorm = SPRMSNorm
    layer.submodules.pre_mlp_layernorm = SPRMSNorm
    layer.submodules.self_attention.submodules.core_attention = packed_causal_attention_cls()
    return TransformerBlockSubmodules(layer_specs=[layer] * config.num_layers, layer_norm=SPRMSNorm)


def install() -> None:
    """Apply every shim above (idempotent)."""
    from mbridge.core.bridge import Bridge
    from mbridge.core.llm_bridge import LLMBridge

    from nemo_is_plugin.apps.demo.model import apply_cpu_patches

    apply_cpu_patches()
    for name in CUDA_TO_CPU_MODULES:
        module = importlib.import_module(name)
        if not isinstance(module.torch, _CudaToCpuTorch):
            module.torch = _CudaToCpuTorch()
    import megatron.core.optimizer.optimizer as optimizer_module

    if not getattr(optimizer_module.clip_grad_by_total_norm_fp32, "_nemo_is_cpu", False):
        optimizer_module.clip_grad_by_total_norm_fp32 = _with_cuda_type_names(
            optimizer_module.clip_grad_by_total_norm_fp32
        )
    if not getattr(torch.nn.Module.cuda, "_nemo_is_cpu", False):
        cuda = torch.nn.Module.cuda

        def cuda_or_cpu(self, device=None):
            return self if device == "cpu" else cuda(self, device)

        cuda_or_cpu._nemo_is_cpu = True  # type: ignore[attr-defined]
        torch.nn.Module.cuda = cuda_or_cpu  # type: ignore[method-assign]
    if not getattr(LLMBridge._get_transformer_layer_spec, "_nemo_is_local_spec", False):

        def local_spec(self, vp_stage=None):
            return local_decoder_block_spec(self.config)

        local_spec._nemo_is_local_spec = True  # type: ignore[attr-defined]
        LLMBridge._get_transformer_layer_spec = local_spec  # type: ignore[method-assign]
    if not getattr(Bridge._weight_name_mapping_mcore_to_hf, "_nemo_is_local_spec", False):
        to_hf = Bridge._weight_name_mapping_mcore_to_hf

        def local_names_to_hf(self, name: str):
            for local, fused in LOCAL_TO_FUSED_NORMS.items():
                name = name.replace(local, fused)
            return to_hf(self, name)

        local_names_to_hf._nemo_is_local_spec = True  # type: ignore[attr-defined]
        Bridge._weight_name_mapping_mcore_to_hf = local_names_to_hf  # type: ignore[method-assign]
