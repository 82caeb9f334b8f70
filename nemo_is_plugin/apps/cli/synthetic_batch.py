"""A synthetic NeMo-RL batch with a controllable training/rollout mismatch, for examples and smoke checks."""

from __future__ import annotations

import torch

PROMPT_LEN = 4
# responses hold seq_len // 4 to seq_len - PROMPT_LEN - 1 tokens: at least one, and a non-empty range of lengths
MIN_SEQ_LEN = 6


def synthetic_batch(
    batch_size: int = 8,
    seq_len: int = 256,
    *,
    mismatch_std: float = 0.02,
    mismatch_mean: float = 0.0,
    policy_drift: float = 0.05,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    head_k: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Return ``(next_token_logprobs [B, S-1], data)`` with NeMo-RL's keys ([B, S] tensors, sample_mask [B]).

    gen = prev + N(mismatch_mean, mismatch_std) per token (the rollout engine's error); curr = prev + N(0, drift).
    Responses have random lengths and a 4-token prompt, masked out like NeMo-RL's token_mask.
    ``head_k``: also a top-k head for score centering (:func:`synthetic_head`).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: the synthetic batch needs at least 1 sequence")
    if seq_len < MIN_SEQ_LEN:
        raise ValueError(
            f"seq_len={seq_len} is too short: the synthetic batch has a {PROMPT_LEN}-token prompt and "
            f"responses of seq_len // 4 to seq_len - {PROMPT_LEN + 1} tokens; use seq_len >= {MIN_SEQ_LEN}"
        )
    if not mismatch_std >= 0:
        raise ValueError(f"mismatch_std={mismatch_std} must be >= 0 (the std of the per-token log-prob mismatch)")
    g = torch.Generator().manual_seed(seed)
    shape = (batch_size, seq_len)
    prev = -torch.rand(shape, generator=g, dtype=torch.float64) * 2.0 - 0.01
    gen = prev - (mismatch_mean + mismatch_std * torch.randn(shape, generator=g, dtype=torch.float64))
    ref = prev + 0.05 * torch.randn(shape, generator=g, dtype=torch.float64)
    curr = prev + policy_drift * torch.randn(shape, generator=g, dtype=torch.float64)
    lengths = torch.randint(seq_len // 4, seq_len - PROMPT_LEN, (batch_size,), generator=g)
    pos = torch.arange(seq_len).unsqueeze(0)
    token_mask = ((pos >= PROMPT_LEN) & (pos < PROMPT_LEN + lengths.unsqueeze(1))).to(dtype)
    rewards = (torch.rand(batch_size, generator=g) > 0.5).to(dtype)
    adv = (rewards - rewards.mean()).unsqueeze(1).expand(shape).contiguous()
    clamp = lambda t: t.clamp(max=-1e-3).to(dtype)  # noqa: E731 - log-probs stay negative
    data = {
        "token_mask": token_mask,
        "sample_mask": torch.ones(batch_size, dtype=dtype),
        "advantages": adv.to(dtype),
        "prev_logprobs": clamp(prev),
        "generation_logprobs": clamp(gen),
        "reference_policy_logprobs": clamp(ref),
        "rewards": rewards,
    }
    if head_k is not None:
        data.update(synthetic_head(batch_size, seq_len, head_k, mismatch_std=mismatch_std, generator=g, dtype=dtype))
    return clamp(curr)[:, 1:].contiguous(), data


def synthetic_head(
    batch_size: int,
    seq_len: int,
    k: int,
    *,
    mismatch_std: float,
    generator: torch.Generator,
    dtype: torch.dtype = torch.float32,
    head_mass: float = 0.9,
) -> dict[str, torch.Tensor]:
    """Score centering's head in NeMo-RL's keys: ``rollout_topk_ids`` / ``rollout_topk_logprobs`` ``[B, S, k]`` and
    ``curr_topk_logprobs`` ``[B, S-1, k]``. Ids 0..k-1; the sampler's head holds ``head_mass`` of its distribution,
    spread by a softmax of N(0, 1) scores; the trainer's scores differ by N(0, mismatch_std) (so its head mass too)."""
    if k < 1:
        raise ValueError(f"head_k={k}: the head needs at least one token")
    shape = (batch_size, seq_len, k)
    scores = torch.randn(shape, generator=generator, dtype=torch.float64)
    drift = mismatch_std * torch.randn(shape, generator=generator, dtype=torch.float64)
    sampler = torch.log_softmax(scores, -1) + torch.log(torch.tensor(head_mass, dtype=torch.float64))
    trainer = torch.log_softmax(scores + drift, -1) + torch.log(torch.tensor(head_mass, dtype=torch.float64))
    return {
        "rollout_topk_ids": torch.arange(k).expand(shape).contiguous(),
        "rollout_topk_logprobs": sampler.to(dtype),
        "curr_topk_logprobs": trainer[:, 1:].to(dtype).contiguous(),
    }
