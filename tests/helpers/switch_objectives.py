"""A float64 batch and the whole loss's value and gradient, for the objectives NeMo-RL's switches select (cispo,
reinforce, on_policy: tests/loss/test_cispo.py, test_reinforce.py, test_on_policy.py)."""

from __future__ import annotations

import dataclasses

import torch

from nemo_is_plugin.loss import ClippedPGLoss, LossInputs
from nemo_is_plugin.loss.layout import TokenLayout

F64 = torch.float64
B, T = 3, 4


def switch_batch(seed: int = 0) -> tuple[LossInputs, TokenLayout]:
    """[3, 4] float64: ratios far enough from 1 that a 0.2 clip bites on both sides, advantages of both signs, one
    masked token (the loss divides by the token count + 1e-8, NeMo-RL's eps)."""
    g = torch.Generator().manual_seed(seed)
    prev = torch.log(torch.rand(B, T, generator=g, dtype=F64) * 0.8 + 0.1)
    c = (prev + 0.5 * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-3)
    gen = (prev + 0.1 * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-3)
    adv = torch.tensor([[1.0], [-2.0], [0.5]], dtype=F64).expand(B, T).clone()
    tm = torch.ones(B, T, dtype=F64)
    tm[2, 3] = 0
    sm = torch.ones(B, dtype=F64)
    inputs = LossInputs(
        curr_logprobs=c,
        prev_logprobs=prev,
        generation_logprobs=gen,
        reference_logprobs=None,
        advantages=adv,
        token_mask=tm,
        sample_mask=sm,
        global_valid_seqs=float(B),
        global_valid_toks=float(tm.sum()),
    )
    return inputs, TokenLayout.padded(B, T)


def loss_and_grad(cfg: dict, inputs: LossInputs, layout: TokenLayout):
    """The loss (KL off), d loss / d c and the metrics of ``cfg`` on ``inputs``."""
    c = inputs.curr_logprobs.clone().requires_grad_(True)
    loss, metrics = ClippedPGLoss({"reference_policy_kl_penalty": 0.0, **cfg}).compute(
        dataclasses.replace(inputs, curr_logprobs=c), layout
    )
    (grad,) = torch.autograd.grad(loss, c)
    return loss.detach(), grad, metrics
