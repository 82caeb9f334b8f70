"""A synthetic LM-head + policy-gradient problem: hidden states, LM-head weight, sampled tokens, NeMo-RL batch.

Shared by the benchmark and the fused-path parity tests so that both exercise the same inputs.

Shapes: ``hidden [B, T, H]`` (T = S - 1 next-token positions), ``weight [V, H]`` (the full LM head; TP ranks take
row shards), ``target [B, T]`` = ``input_ids[:, 1:]``, ``data``: NeMo-RL's ``[B, S]`` tensors and ``sample_mask [B]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


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
    base_logprobs: Optional[torch.Tensor] = None,
    mismatch_std: float = 0.05,
) -> HeadProblem:
    """Random problem with logits of std ``logit_std``; ``seq_len`` = S (T = S - 1 log-prob positions).

    ``prev`` / ``generation`` / ``reference`` log-probs are ``base_logprobs [B, T]`` (pass the true current log-probs
    so that ratios sit near 1 and both sides of the clip are hit) plus N(0, ``mismatch_std``) noise each; without it
    a log-uniform stand-in is used (the benchmark: values do not change the cost). Responses have random lengths after
    a 2-token prompt, one sequence is masked out by ``sample_mask`` when ``batch > 2``.
    """
    g = torch.Generator().manual_seed(seed)
    t = seq_len - 1
    hidden = torch.randn(batch, t, hidden_size, generator=g).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=g) * (logit_std / hidden_size**0.5)).to(dtype)
    input_ids = torch.randint(0, vocab, (batch, seq_len), generator=g)
    if base_logprobs is None:
        base_logprobs = -torch.rand(batch, t, generator=g) * 8.0
    base = base_logprobs.detach().double()

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
    return HeadProblem(hidden, weight, input_ids[:, 1:].contiguous(), data, sample_mask.sum().item(), valid_toks)


def vocab_shard(weight: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Rows ``[r V/tp, (r+1) V/tp)`` of the LM head: the shard a TP rank holds (V must divide evenly)."""
    vocab = weight.shape[0]
    if vocab % tp_size:
        raise ValueError(f"vocab {vocab} is not divisible by tp_size {tp_size}")
    per = vocab // tp_size
    return weight[tp_rank * per : (tp_rank + 1) * per]


__all__ = ["HeadProblem", "make_problem", "vocab_shard"]
