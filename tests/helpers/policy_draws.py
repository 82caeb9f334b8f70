"""Random float64 log-probs of one batch around on-policy, shared by the loss-gradient tests."""

from __future__ import annotations

import torch

F64 = torch.float64


def draw_policy_logprobs(g: torch.Generator, b: int, t: int) -> tuple[torch.Tensor, ...]:
    """``(curr, prev, gen, ref, adv)``, each float64 ``[b, t]``: current log-probs in [-3.05, -0.05], the old policy's
    within ~0.05 of them, the generator's within ~0.05 of the old policy's, the reference within ~0.1 of the current,
    standard-normal advantages. Drawn from ``g`` in that order (a test's seed fixes all five)."""
    curr = -torch.rand(b, t, dtype=F64, generator=g) * 3 - 0.05
    prev = curr + 0.05 * torch.randn(b, t, dtype=F64, generator=g)
    gen = prev + 0.05 * torch.randn(b, t, dtype=F64, generator=g)
    ref = curr + 0.1 * torch.randn(b, t, dtype=F64, generator=g)
    adv = torch.randn(b, t, dtype=F64, generator=g)
    return curr, prev, gen, ref, adv
