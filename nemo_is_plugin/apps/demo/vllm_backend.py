"""vLLM rollout backend (optional extra ``nemo-is-plugin[vllm]``; needs a CUDA GPU). Import only via ``rollout``.

The Megatron weights are exported as a HuggingFace Mixtral checkpoint (same network: RMSNorm, rotate-half RoPE,
top-k-then-softmax router, SwiGLU experts) into a private directory; vLLM serves it in bf16 (or fp8,
``quantization="fp8"``) and reports the sampled tokens' log-probs (``logprobs=0``), which become the loss's
``generation_logprobs``. Weight sync after each update rewrites the checkpoint and calls the workers'
``reload_weights``.

Not exercised by the CPU test suite (no GPU there); ``functional_tests/test_demo.py`` skips it without vLLM + CUDA.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from nemo_is_plugin.apps.demo.model import ModelShape
from nemo_is_plugin.apps.demo.rollout import RolloutOutput
from nemo_is_plugin.apps.demo.task import EOS, PAD, VOCAB_SIZE

if TYPE_CHECKING:
    from vllm import LLM


def mixtral_config(shape: ModelShape) -> dict:
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.expert_ffn,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.heads,
        "head_dim": shape.head_dim,
        "num_local_experts": shape.experts,
        "num_experts_per_tok": shape.topk,
        "max_position_embeddings": shape.max_seq_len,
        "rope_theta": float(shape.rotary_base),
        "rms_norm_eps": shape.norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": EOS,
        "pad_token_id": PAD,
    }


def megatron_to_mixtral(shape: ModelShape, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename / split the unsharded Megatron weights into HF Mixtral names (fused per-head [q; k; v] -> q, k, v)."""
    hd, f = shape.head_dim, shape.expert_ffn
    out = {
        "model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
        "model.norm.weight": state["decoder.final_layernorm.weight"],
        "lm_head.weight": state["output_layer.weight"],
    }
    for i in range(shape.layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = state[src + "self_attention.linear_qkv.weight"].view(shape.heads, 3, hd, shape.hidden)
        for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
            out[dst + f"self_attn.{name}.weight"] = qkv[:, j].reshape(shape.heads * hd, shape.hidden)
        out[dst + "self_attn.o_proj.weight"] = state[src + "self_attention.linear_proj.weight"]
        out[dst + "input_layernorm.weight"] = state[src + "input_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = state[src + "pre_mlp_layernorm.weight"]
        out[dst + "block_sparse_moe.gate.weight"] = state[src + "mlp.router.weight"]
        for e in range(shape.experts):
            fc1 = state[src + f"mlp.experts.local_experts.{e}.linear_fc1.weight"]
            moe = dst + f"block_sparse_moe.experts.{e}."
            out[moe + "w1.weight"], out[moe + "w3.weight"] = fc1[:f], fc1[f:]  # gate, up
            out[moe + "w2.weight"] = state[src + f"mlp.experts.local_experts.{e}.linear_fc2.weight"]
    return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in out.items()}


class VLLMBackend:
    def __init__(self, shape: ModelShape, precision: str, temperature: float, seed: int) -> None:
        assert shape.vocab_size == VOCAB_SIZE
        if precision not in ("bf16", "fp8"):
            raise ValueError(f"the vllm backend serves bf16 or fp8 weights, not {precision!r}")
        self.shape, self.precision, self.temperature, self.seed = shape, precision, temperature, seed
        self.dir = Path(tempfile.mkdtemp(prefix="nemo_is_demo_vllm_"))
        (self.dir / "config.json").write_text(json.dumps(mixtral_config(shape), indent=1))
        self.llm: LLM | None = None  # built by the first load_weights()

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        torch.save(megatron_to_mixtral(self.shape, state), self.dir / "pytorch_model.bin")
        if self.llm is None:
            from vllm import LLM

            self.llm = LLM(
                model=str(self.dir),
                skip_tokenizer_init=True,
                dtype="bfloat16",
                quantization="fp8" if self.precision == "fp8" else None,
                seed=self.seed,
                enforce_eager=True,
                gpu_memory_utilization=0.3,
                max_model_len=self.shape.max_seq_len,
            )
        else:
            self.llm.collective_rpc("reload_weights")

    def generate(self, prompts: torch.Tensor, max_new_tokens: int, *, ignore_eos: bool, seed: int) -> RolloutOutput:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [
            SamplingParams(
                temperature=self.temperature,
                max_tokens=max_new_tokens,
                ignore_eos=ignore_eos,
                stop_token_ids=[] if ignore_eos else [EOS],
                logprobs=0,
                seed=seed + i,
                detokenize=False,
            )
            for i in range(prompts.shape[0])
        ]
        if self.llm is None:
            raise RuntimeError("VLLMBackend.generate() before load_weights(): the engine is built with the weights")
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=row.tolist()) for row in prompts], params)
        b = prompts.shape[0]
        tokens = torch.full((b, max_new_tokens), PAD, dtype=torch.long)
        logprobs = torch.zeros(b, max_new_tokens)
        mask = torch.zeros(b, max_new_tokens, dtype=torch.long)
        for i, out in enumerate(outs):
            comp = out.outputs[0]
            n = len(comp.token_ids)
            tokens[i, :n] = torch.tensor(comp.token_ids)
            logprobs[i, :n] = torch.tensor([lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs)])
            mask[i, :n] = 1
        return RolloutOutput(tokens, logprobs, mask)
