"""The rollout engine's own implementation of the policy network: a KV-cached decoder in emulated low precision.

This is the "numerically different path" of a real RL system (vLLM / SGLang serving bf16 or fp8 weights while
Megatron trains in fp32). It computes the same function as :func:`nemo_is_plugin.apps.demo.model.build_gpt` (checked to
~1e-5 in fp32 by ``functional_tests/test_demo.py``), but:

- ``precision="bf16"``: weights stored in bf16, every activation rounded to bf16 after each op, products accumulated
  in fp32. That is what a tensor core does (bf16 inputs, fp32 accumulate, bf16 output), and it runs at fp32 speed
  on a CPU where bf16 matmuls are ~100x slower.
- ``precision="fp8"``: additionally the linear layers are W8A8 e4m3 with one weight scale per tensor and one
  dynamic activation scale per call, as in vLLM's ``quantization="fp8"`` (dynamic, per-tensor). This is the mismatch
  knob: ~10x the bf16 per-token log-prob error, so exp(sum) IS weights collapse at hundreds instead of thousands of
  tokens.
- ``precision="int4"``: weight-only int4 (W4A16, group-wise scales, as AWQ / GPTQ kernels serve), bf16 activations:
  the strongest mismatch, for short demos of the collapse.
- ``precision="fp32"``: the exact path, for the parity test.

Also different from Megatron: incremental decoding with a KV cache instead of one full-sequence forward, and every
expert evaluated densely then weighted by the (mostly zero) routing probabilities.

Weights are the unsharded Megatron state dict (:func:`nemo_is_plugin.apps.demo.model.full_state_dict`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_is_plugin.apps.demo.model import ModelShape

PRECISIONS = ("fp32", "bf16", "fp8", "int4")
_INT4_GROUP = 32  # input channels per int4 scale (AWQ / GPTQ use 32-128)
_FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _round(x: torch.Tensor, precision: str) -> torch.Tensor:
    """Round an fp32 tensor to the engine's activation dtype (and back to fp32 for the next fp32-accumulated op)."""
    if precision == "fp32":
        return x
    return x.to(torch.bfloat16).to(torch.float32)


def _fp8(x: torch.Tensor) -> torch.Tensor:
    """Quantise-dequantise to e4m3 with one absmax scale for the whole tensor (vLLM's per-tensor fp8)."""
    scale = x.abs().amax().clamp_min(1e-12) / _FP8_MAX
    return (x / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale


def _int4(w: torch.Tensor) -> torch.Tensor:
    """Symmetric int4 weight-only quantise-dequantise, one absmax scale per group of input channels: [out, in]."""
    out_f, in_f = w.shape
    group = min(_INT4_GROUP, in_f)
    g = w.reshape(out_f, in_f // group, group)
    scale = g.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 7.0
    return (torch.round(g / scale).clamp(-8, 7) * scale).reshape(out_f, in_f)


@dataclass
class _Linear:
    """y = x W^T in the engine's precision. W: [out, in] fp32 holding already-rounded values."""

    weight: torch.Tensor
    precision: str

    @classmethod
    def make(cls, w: torch.Tensor, precision: str) -> _Linear:
        w = w.detach().float()
        if precision == "fp8":
            w = _fp8(w)
        elif precision == "int4":
            w = _int4(w)
        return cls(_round(w, precision), precision)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.precision == "fp8":
            x = _fp8(x)  # dynamic activation scale
        return _round(x @ self.weight.t(), self.precision)


@dataclass
class _Layer:
    """One decoder layer's weights in the engine's precision (the router stays fp32, as in serving)."""

    ln1: torch.Tensor
    qkv: _Linear
    proj: _Linear
    ln2: torch.Tensor
    router: torch.Tensor
    experts: list[tuple[_Linear, _Linear]]  # (fc1, fc2) per expert


class KVCachedDecoder:
    """Autoregressive sampler over the Megatron GPT weights with a per-layer KV cache.

    ``sample(prompts [B, P], max_new_tokens, ...)`` returns ``tokens [B, R]`` and the engine's log-probs of the
    sampled tokens ``logprobs [B, R]`` (fp32, from the engine-precision logits, like vLLM's ``logprobs=0``), and with
    ``top_k = k`` its top-k head per generated token (score centering's ``rollout_topk_ids`` / ``_logprobs``).
    """

    def __init__(self, shape: ModelShape, state: dict[str, torch.Tensor], precision: str = "bf16") -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        self.shape, self.precision = shape, precision
        p = precision

        def r(t: torch.Tensor) -> torch.Tensor:
            return _round(t.detach().float(), precision)

        self.embed = r(state["embedding.word_embeddings.weight"])
        self.final_norm = r(state["decoder.final_layernorm.weight"])
        # quantised checkpoints keep the LM head in bf16 (vLLM fp8, AWQ / GPTQ)
        self.head = _Linear.make(state["output_layer.weight"], "bf16" if p in ("fp8", "int4") else p)
        self.layers: list[_Layer] = []
        for i in range(shape.layers):
            pre = f"decoder.layers.{i}."
            experts = []
            for e in range(shape.experts):
                ep = f"{pre}mlp.experts.local_experts.{e}."
                experts.append(
                    (_Linear.make(state[ep + "linear_fc1.weight"], p), _Linear.make(state[ep + "linear_fc2.weight"], p))
                )
            self.layers.append(
                _Layer(
                    ln1=r(state[pre + "input_layernorm.weight"]),
                    qkv=_Linear.make(state[pre + "self_attention.linear_qkv.weight"], p),
                    proj=_Linear.make(state[pre + "self_attention.linear_proj.weight"], p),
                    ln2=r(state[pre + "pre_mlp_layernorm.weight"]),
                    router=state[pre + "mlp.router.weight"].detach().float(),  # routers stay fp32 in serving too
                    experts=experts,
                )
            )
        hd = shape.head_dim
        inv_freq = 1.0 / (shape.rotary_base ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        self._inv_freq = inv_freq

    # ------------------------------------------------------------------ blocks
    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return _round(x * torch.rsqrt(var + self.shape.norm_eps) * w, self.precision)

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [B, H, T, hd], pos [T]: Megatron's non-interleaved rotary embedding (rotate the two halves)."""
        freqs = torch.outer(pos.float(), self._inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        x1, x2 = x.chunk(2, dim=-1)
        return _round(x * emb.cos() + torch.cat((-x2, x1), dim=-1) * emb.sin(), self.precision)

    def _moe(self, x: torch.Tensor, layer: _Layer) -> torch.Tensor:
        """Top-k on router logits, softmax over the k chosen (Megatron's default, = Mixtral), dense experts."""
        logits = x @ layer.router.t()  # [N, E] fp32
        top, idx = logits.topk(self.shape.topk, dim=-1)
        probs = torch.zeros_like(logits).scatter(-1, idx, torch.softmax(top, dim=-1))
        out = torch.zeros_like(x)
        for e, (fc1, fc2) in enumerate(layer.experts):
            rows = probs[:, e] > 0
            if rows.any():
                gate, up = fc1(x[rows]).chunk(2, dim=-1)
                h = _round(torch.nn.functional.silu(gate) * up, self.precision)
                out[rows] += probs[rows, e : e + 1] * fc2(h)
        return _round(out, self.precision)

    def _step(self, tokens: torch.Tensor, start: int, cache: list) -> torch.Tensor:
        """Run tokens [B, T] at positions start..start+T-1, append to the cache; returns fp32 logits [B, T, V]."""
        b, t = tokens.shape
        s, hd = self.shape, self.shape.head_dim
        x = self.embed[tokens]  # [B, T, h]
        pos = torch.arange(start, start + t)
        end = start + t
        causal = torch.ones(t, end, dtype=torch.bool).tril(diagonal=start)  # [T, end]
        for layer, (k_cache, v_cache) in zip(self.layers, cache):
            h = self._norm(x, layer.ln1)
            qkv = layer.qkv(h).view(b, t, s.heads, 3 * hd).transpose(1, 2)  # per head [q; k; v] (Megatron layout)
            q, k, v = qkv.split(hd, dim=-1)
            k_cache[:, :, start:end] = self._rope(k, pos)
            v_cache[:, :, start:end] = v
            q = self._rope(q, pos)
            scores = (q @ k_cache[:, :, :end].transpose(-1, -2)) / hd**0.5
            probs = _round(torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1), self.precision)
            ctx = _round(probs @ v_cache[:, :, :end], self.precision).transpose(1, 2).reshape(b, t, s.hidden)
            x = _round(x + layer.proj(ctx), self.precision)
            h = self._norm(x, layer.ln2)
            x = _round(x + self._moe(h.reshape(b * t, s.hidden), layer).view(b, t, s.hidden), self.precision)
        return self.head(self._norm(x, self.final_norm)).float()

    # ------------------------------------------------------------------ API
    def new_cache(self, batch: int, length: int) -> list:
        shape = (batch, self.shape.heads, length, self.shape.head_dim)
        return [(torch.zeros(shape), torch.zeros(shape)) for _ in self.layers]

    @torch.no_grad()
    def score(self, tokens: torch.Tensor) -> torch.Tensor:
        """Engine log-probs of tokens[:, 1:] given their prefixes, one full pass: [B, S] -> [B, S-1]."""
        logits = self._step(tokens, 0, self.new_cache(tokens.shape[0], tokens.shape[1]))
        return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)

    @torch.no_grad()
    def sample(
        self,
        prompts: torch.Tensor,
        max_new_tokens: int,
        *,
        eos_id: int,
        pad_id: int,
        ignore_eos: bool,
        generator: torch.Generator,
        temperature: float = 1.0,
        top_k: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, SamplerHead | None]:
        """Sample continuations of prompts [B, P] (all the same length).

        Returns ``tokens [B, R]`` (``pad_id`` after a sequence ended), ``logprobs [B, R]`` (0 on padding),
        ``mask [B, R]`` (1 on generated tokens, EOS included) and, with ``top_k > 0``, the sampler's head
        (:class:`SamplerHead`, None without). With ``ignore_eos`` every row runs to ``max_new_tokens`` (vLLM's
        ``ignore_eos=True``: EOS is sampled and kept like any token).
        """
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no head), got {top_k}")
        b, p = prompts.shape
        if p + max_new_tokens > self.shape.max_seq_len:
            raise ValueError(f"prompt {p} + {max_new_tokens} new tokens exceeds max_seq_len {self.shape.max_seq_len}")
        cache = self.new_cache(b, p + max_new_tokens)
        logits = self._step(prompts, 0, cache)[:, -1]
        tokens = torch.full((b, max_new_tokens), pad_id, dtype=torch.long)
        logprobs = torch.zeros(b, max_new_tokens)
        head = SamplerHead.empty(b, max_new_tokens, top_k) if top_k else None
        alive = torch.ones(b, dtype=torch.bool)
        for i in range(max_new_tokens):
            lp = torch.log_softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(lp.exp(), 1, generator=generator).squeeze(-1)
            tokens[:, i] = torch.where(alive, nxt, pad_id)
            logprobs[:, i] = torch.where(alive, lp.gather(-1, nxt[:, None]).squeeze(-1), 0.0)
            if head is not None:
                head.record(i, lp, alive)
            if not ignore_eos:
                alive &= nxt != eos_id
                if not alive.any():
                    break
            if i + 1 < max_new_tokens:
                logits = self._step(nxt[:, None], p + i, cache)[:, -1]
        mask = torch.zeros_like(tokens)
        ended = torch.zeros(b, dtype=torch.bool)
        for i in range(max_new_tokens):  # generated = not yet past an EOS (the EOS itself counts)
            mask[:, i] = (~ended).long()
            if not ignore_eos:
                ended |= tokens[:, i] == eos_id
        return tokens, logprobs, mask, head


@dataclass
class SamplerHead:
    """The sampler's top-k head per generated token, from the distribution it sampled from (the temperature-scaled
    log-softmax of the engine-precision logits, vLLM's processed log-probs): ``ids [B, R, k]`` (long, by descending
    log-prob) and ``logprobs [B, R, k]`` fp32. Slots past the vocabulary and tokens after a sequence ended are
    empty: id 0, log-prob -inf (zero mass, no gradient in the loss)."""

    ids: torch.Tensor
    logprobs: torch.Tensor

    @classmethod
    def empty(cls, batch: int, length: int, k: int) -> SamplerHead:
        return cls(torch.zeros(batch, length, k, dtype=torch.long), torch.full((batch, length, k), float("-inf")))

    def record(self, i: int, lp: torch.Tensor, alive: torch.Tensor) -> None:
        """Position i's head from ``lp [B, V]`` (the log-softmax sampled from); rows not ``alive`` stay empty."""
        k = min(self.ids.shape[-1], lp.shape[-1])
        top, idx = lp.topk(k, dim=-1)
        self.ids[:, i, :k] = torch.where(alive[:, None], idx, 0)
        self.logprobs[:, i, :k] = torch.where(alive[:, None], top, float("-inf"))
