"""The tiny megatron-core MoE GPT that the demo trains (``demo/model.py``) and the model-step benchmark times
(``bench/moe_model.py``): the ``TransformerConfig`` settings the two share, in one place. Needs no extra to import;
megatron-core is the caller's."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

# megatron-core's fused kernels (Apex's, Transformer Engine's, its own CUDA ones): off, as the local layer spec runs
# without those and on CPU.
FUSIONS_OFF = (
    "gradient_accumulation_fusion",
    "bias_dropout_fusion",
    "apply_rope_fusion",
    "masked_softmax_fusion",
    "persist_layer_norm",
)


def moe_gpt_settings(shape: Any, dtype: torch.dtype, *, init_std: float, cpu_init: bool) -> dict[str, Any]:
    """``TransformerConfig`` keyword arguments of a GPT whose MLPs are ``shape.experts`` SwiGLU experts of width
    ``shape.expert_ffn`` behind a top-``shape.topk`` router, with RMSNorm, no biases and no dropout, its parameters in
    ``dtype`` drawn with std ``init_std`` (``cpu_init``: the full matrices from the CPU generator). The caller adds
    its parallelism and what else it needs. ``shape``: the demo's ``ModelShape`` or the bench's ``StepShape`` (their
    ``layers``, ``hidden``, ``heads``, ``expert_ffn``, ``experts`` and ``topk`` are read)."""
    size = dict(num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads)
    experts = dict(
        num_moe_experts=shape.experts,
        moe_router_topk=shape.topk,
        moe_ffn_hidden_size=shape.expert_ffn,
        ffn_hidden_size=shape.expert_ffn,  # the dense MLP's width, which megatron-core checks too
    )
    # the all-gather dispatcher and no load-balancing loss: the loss is the policy-gradient loss alone
    router = dict(moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    body = dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False)
    no_dropout = dict(hidden_dropout=0.0, attention_dropout=0.0)
    precision = dict(params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
    init = dict(init_method_std=init_std, use_cpu_initialization=cpu_init)
    unfused = dict.fromkeys(FUSIONS_OFF, False)
    return {**size, **experts, **router, **body, **no_dropout, **precision, **init, **unfused}


def untied_rope_gpt(config: Any, layer_spec: Any, *, vocab: int, max_seq_len: int, seed: int, **extra: Any) -> Any:
    """megatron-core's ``GPTModel`` with its embedding and its LM head (untied) and RoPE, drawn from ``seed``;
    ``extra``: more of ``GPTModel``'s arguments."""
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(seed)
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=vocab,
        max_sequence_length=max_seq_len,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        **extra,
    )


__all__ = ["FUSIONS_OFF", "moe_gpt_settings", "untied_rope_gpt"]
