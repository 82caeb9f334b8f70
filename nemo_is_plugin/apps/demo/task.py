"""The verifiable task: reverse a string of digits. Integer vocabulary, exact-match reward, GRPO group advantages.

Vocabulary (no tokenizer, nothing downloaded): ``PAD=0, BOS=1, SEP=2, EOS=3``, digits 0-9 are tokens 4-13; the model's
vocabulary is 16 (two unused ids keep it divisible by TP=2).

    prompt   [BOS, d_1, ..., d_n, SEP]           (every prompt has the same n, so batches need no left padding)
    answer   [d_n, ..., d_1, EOS]
    reward   1.0 if the response up to its first EOS equals the answer, else 0.0

With ``ignore_eos`` (the long-response setting) the response keeps going after the EOS, like a long reasoning trace
after which only the answer is graded: the reward reads the tokens before the first EOS.
"""

from __future__ import annotations

import torch

PAD, BOS, SEP, EOS = 0, 1, 2, 3
DIGIT0 = 4
VOCAB_SIZE = 16


def make_prompts(num: int, num_digits: int, generator: torch.Generator) -> torch.Tensor:
    """Random prompts: [num, num_digits + 2]."""
    digits = torch.randint(0, 10, (num, num_digits), generator=generator) + DIGIT0
    bos = torch.full((num, 1), BOS, dtype=torch.long)
    sep = torch.full((num, 1), SEP, dtype=torch.long)
    return torch.cat([bos, digits, sep], dim=1)


def answers(prompts: torch.Tensor) -> torch.Tensor:
    """The correct responses: [B, P] prompts -> [B, n + 1] reversed digits then EOS."""
    digits = prompts[:, 1:-1].flip(1)
    return torch.cat([digits, torch.full((prompts.shape[0], 1), EOS, dtype=torch.long)], dim=1)


def rewards(prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """Exact match: [B, P], [B, R] -> [B] float in {0, 1}. The response must reproduce the answer through its EOS."""
    target = answers(prompts)
    n = target.shape[1]
    if responses.shape[1] < n:
        return torch.zeros(prompts.shape[0])
    return (responses[:, :n] == target).all(dim=1).float()


def group_advantages(reward: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (r - group mean) / (group std + eps) for consecutive groups of ``group_size``: [B] -> [B].

    A group whose rewards are all equal gets advantage 0 (no signal), as in NeMo-RL.
    """
    r = reward.view(-1, group_size)
    centred = r - r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True) if group_size > 1 else torch.ones_like(r)
    return (centred / (std + eps)).reshape(-1)


def sft_batch(
    num: int, num_digits: int, generator: torch.Generator, tail: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Supervised warm-start batch: ``tokens [num, P + n + 1 + tail]`` and ``loss_mask`` on the response tokens.

    ``tail`` uniformly random digits follow the EOS: they teach the model what to write when the engine ignores EOS
    (a free-form trace the grader does not read), with the per-token entropy (ln 10) of real long generations.
    Without it the tiny model's post-EOS tokens are near-deterministic and no mismatch accumulates over them.
    """
    prompts = make_prompts(num, num_digits, generator)
    free = torch.randint(0, 10, (num, tail), generator=generator) + DIGIT0
    tokens = torch.cat([prompts, answers(prompts), free], dim=1)
    mask = torch.zeros_like(tokens)
    mask[:, prompts.shape[1] :] = 1
    return tokens, mask
