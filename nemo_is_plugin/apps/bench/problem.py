"""A synthetic LM-head + policy-gradient problem: hidden states, LM-head weight, sampled tokens, NeMo-RL batch.

Shared by the benchmark and the fused-path parity tests so that both exercise the same inputs.

Shapes: ``hidden [B, T, H]`` (T = S - 1 next-token positions), ``weight [V, H]`` (the full LM head; TP ranks take
row shards), ``target [B, T]`` = ``input_ids[:, 1:]``, ``data``: NeMo-RL's ``[B, S]`` tensors and ``sample_mask [B]``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Log-probs [B, T] of the sampled tokens, or how to compute them from the targets [B, T].
BaseLogprobs = torch.Tensor | Callable[[torch.Tensor], torch.Tensor]


@dataclass
class RLBatch:
    """The RL side of a problem alone, for a model that makes its own hidden states (no ``hidden`` / ``weight``)."""

    target: torch.Tensor
    data: dict[str, torch.Tensor]
    global_valid_seqs: float
    global_valid_toks: float
    hidden = None
    weight = None


@dataclass
class HeadProblem:
    hidden: torch.Tensor
    weight: torch.Tensor
    target: torch.Tensor
    data: dict[str, torch.Tensor]
    global_valid_seqs: float
    global_valid_toks: float

    @property
    def num_tokens(self) -> int:
        return self.target.numel()


def make_problem(
    batch: int,
    seq_len: int,
    hidden_size: int,
    vocab: int,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    logit_std: float = 2.0,
    base_logprobs: torch.Tensor | str | None = None,
    mismatch_std: float = 0.05,
    device: torch.device | None = None,
) -> HeadProblem:
    """Random problem with logits of std ``logit_std``; ``seq_len`` = S (T = S - 1 log-prob positions).

    ``prev`` / ``generation`` / ``reference`` log-probs are ``base_logprobs [B, T]`` (pass the true current log-probs
    so that ratios sit near 1 and both sides of the clip are hit) plus N(0, ``mismatch_std``) noise each; ``"model"``
    computes those true log-probs here (fp32, chunked; one extra GEMM); without it a log-uniform stand-in is used
    (values do not change the cost, but most ratios then sit far outside the clip, where the loss value does not
    depend on the log-probs). Responses have random lengths after a 2-token prompt, one sequence is masked out by
    ``sample_mask`` when ``batch > 2``.

    ``device``: where every tensor lives (None: CPU). Off the CPU the hidden states and the head are drawn there, from
    that device's generator (a V x H head drawn on one CPU thread and copied would take seconds at the real shapes);
    the rest is drawn on the CPU and moved.
    """
    device = torch.device("cpu") if device is None else torch.device(device)
    g = torch.Generator().manual_seed(seed)
    big = g if device.type == "cpu" else torch.Generator(device).manual_seed(seed)
    hidden = torch.randn(batch, seq_len - 1, hidden_size, generator=big, device=device).to(dtype)
    weight = torch.randn(vocab, hidden_size, generator=big, device=device)
    weight = weight.mul_(logit_std / hidden_size**0.5).to(dtype)
    base: BaseLogprobs | None
    if isinstance(base_logprobs, str):
        if base_logprobs != "model":
            raise ValueError(f"base_logprobs must be a tensor, None or 'model', got {base_logprobs!r}")

        def base(target: torch.Tensor) -> torch.Tensor:
            return target_logprobs(hidden, weight, target.to(device)).cpu()

    else:
        base = base_logprobs
    target, data, valid_seqs, valid_toks = _rl_batch(g, batch, seq_len, vocab, base, mismatch_std, device)
    return HeadProblem(hidden, weight, target, data, valid_seqs, valid_toks)


@torch.no_grad()
def target_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, chunk_bytes: int = 2**30
) -> torch.Tensor:
    """``log softmax(hidden @ weight.T)[target]``, ``[...]`` from ``hidden [..., H]``, ``weight [V, H]``, in fp32 (or
    the inputs' dtype when wider), chunked over tokens: one ``[chunk, V]`` block (about ``chunk_bytes``) at a time."""
    dt = torch.promote_types(hidden.dtype, torch.float32)
    x, t, w = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1), weight.to(dt)
    rows = max(1, chunk_bytes // (w.shape[0] * w.element_size()))
    lp = torch.empty(x.shape[0], dtype=dt, device=x.device)
    for s in range(0, x.shape[0], rows):
        z = x[s : s + rows].to(dt) @ w.t()
        lp[s : s + rows] = z.gather(1, t[s : s + rows, None])[:, 0] - torch.logsumexp(z, dim=-1)
    return lp.view(target.shape)


def make_rl_batch(
    batch: int, seq_len: int, vocab: int, *, seed: int = 0, device: torch.device | None = None
) -> RLBatch:
    """The RL batch of :func:`make_problem` alone (``hidden`` / ``weight`` are None): for a model that makes its own
    hidden states. ``data["input_ids"] [B, S]`` are the model's input tokens, ``target [B, S-1]`` the next tokens."""
    g = torch.Generator().manual_seed(seed)
    device = torch.device("cpu") if device is None else torch.device(device)
    target, data, valid_seqs, valid_toks = _rl_batch(g, batch, seq_len, vocab, None, 0.05, device)
    return RLBatch(target, data, valid_seqs, valid_toks)


def _rl_batch(
    g: torch.Generator,
    batch: int,
    seq_len: int,
    vocab: int,
    base_logprobs: BaseLogprobs | None,
    mismatch_std: float,
    device: torch.device,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], float, float]:
    """``(target [B, S-1], data, valid sequences, valid tokens)`` drawn from ``g`` on the CPU, moved to ``device``."""
    t = seq_len - 1
    input_ids = torch.randint(0, vocab, (batch, seq_len), generator=g)
    if base_logprobs is None:
        base_logprobs = -torch.rand(batch, t, generator=g) * 8.0
    elif not isinstance(base_logprobs, torch.Tensor):
        base_logprobs = base_logprobs(input_ids[:, 1:])
    base = base_logprobs.detach().double().cpu()

    def noisy() -> torch.Tensor:
        lp = (base + mismatch_std * torch.randn(base.shape, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
        return torch.cat([torch.zeros(batch, 1, dtype=torch.float64), lp], dim=1).float()  # [B, S], col 0 unused

    pos = torch.arange(seq_len).unsqueeze(0)
    lengths = torch.randint(max(1, seq_len // 2), seq_len - 1, (batch, 1), generator=g) if seq_len > 3 else None
    token_mask = (pos >= 2) & (pos < 2 + lengths) if lengths is not None else pos >= 1
    sample_mask = torch.ones(batch)
    if batch > 2:
        sample_mask[-1] = 0.0
    rewards = (torch.rand(batch, generator=g) > 0.5).float()
    data = {
        "input_ids": input_ids,
        "token_mask": token_mask.float(),
        "sample_mask": sample_mask,
        "advantages": (rewards - rewards.mean()).unsqueeze(1).expand(batch, seq_len).contiguous() + 0.1,
        "prev_logprobs": noisy(),
        "generation_logprobs": noisy(),
        "reference_policy_logprobs": noisy(),
        "rewards": rewards,
    }
    valid_toks = (token_mask[:, 1:].float() * sample_mask.unsqueeze(1)).sum().item()
    data = {k: v.to(device) for k, v in data.items()}
    return input_ids[:, 1:].contiguous().to(device), data, sample_mask.sum().item(), valid_toks


def leaf_grad(leaf: torch.Tensor) -> torch.Tensor:
    """The gradient ``backward()`` left on ``leaf``; an error when it left none (the loss did not use the leaf)."""
    if leaf.grad is None:
        raise RuntimeError(f"backward() left no gradient on the leaf of shape {tuple(leaf.shape)}")
    return leaf.grad


def vocab_shard(weight: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Rows ``[r V/tp, (r+1) V/tp)`` of the LM head: the shard a TP rank holds (V must divide evenly)."""
    vocab = weight.shape[0]
    if vocab % tp_size:
        raise ValueError(f"vocab {vocab} is not divisible by tp_size {tp_size}")
    per = vocab // tp_size
    return weight[tp_rank * per : (tp_rank + 1) * per]


__all__ = ["HeadProblem", "RLBatch", "leaf_grad", "make_problem", "make_rl_batch", "target_logprobs", "vocab_shard"]
