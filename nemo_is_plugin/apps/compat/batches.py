"""The batches ``nemo-is compat`` runs both losses on, in NeMo-RL's layout (the verl host strips column 0).

A :class:`CompatBatch` holds ``[B, S]`` tensors under NeMo-RL's keys and the current policy's ``next_token_logprobs
[B, S-1]`` (column ``t`` predicts token ``t + 1``; column 0 of the data is the prompt's last token, never read). The
values are float32, as the hosts' trainers pass them.

Synthetic batches cycle through four kinds, each with its own seed and response lengths, so that N >= 4 batches hold
every edge a trainer really passes (NeMo-RL's unit tests and its ``grpo_train`` batches):

- ``mismatch``: per-row rollout/training mismatch from on-policy (1e-3) to far off-policy (0.6), a current policy that
  drifts enough to clip, IS weights on both sides of the usual truncation bounds;
- ``padded rows``: the last rows have ``sample_mask`` 0 and no valid token (the rows NeMo-RL pads a batch with to
  split it over data-parallel ranks), and one response of a single token;
- ``-inf log-prob``: one valid token whose rollout log-prob is ``-inf`` (a token outside the inference engine's
  top-k / top-p set);
- ``positive log-probs``: valid tokens whose log-probs are slightly above 0 (bf16 rounding of near-certain tokens;
  NeMo-RL's own tests use log 3).

A rollout dump (``nemo-is diagnose``'s format) becomes batches of :data:`DUMP_BATCH_SIZE` responses with the dump's
rollout (``generation_logprobs``) and training (``prev_logprobs``) log-probs; a dump holds no current policy, so the
current log-probs are ``prev`` plus a seeded N(0, :data:`DUMP_POLICY_DRIFT`) drift (a policy after a few updates).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

SYNTHETIC_KINDS = ("mismatch", "padded rows", "-inf log-prob", "positive log-probs")
ROWS, SEQ_LEN = 8, 40
ROW_MISMATCH = (1e-3, 0.01, 0.03, 0.1, 0.2, 0.35, 0.5, 0.6)  # per-row std of log(pi_old / mu)
POLICY_DRIFT = 0.25  # std of log(pi_theta / pi_old): enough for the PPO clip at 0.2 to act
DUMP_BATCH_SIZE = 16
DUMP_POLICY_DRIFT = 0.05


@dataclass(frozen=True)
class CompatBatch:
    """One batch: ``data`` holds NeMo-RL's ``[B, S]`` tensors (``sample_mask``, ``rewards``: ``[B]``)."""

    name: str
    logprobs: torch.Tensor
    data: dict[str, torch.Tensor]

    @property
    def valid(self) -> torch.Tensor:
        """Bool[B, S-1]: the tokens every loss counts (``token_mask[:, 1:]`` of the rows with ``sample_mask``)."""
        return (self.data["token_mask"][:, 1:] * self.data["sample_mask"][:, None]) != 0


def _assemble(
    name: str,
    curr: torch.Tensor,
    prev: torch.Tensor,
    gen: torch.Tensor,
    mask: torch.Tensor,
    adv_rows: torch.Tensor,
    rewards: torch.Tensor,
    g: torch.Generator,
) -> CompatBatch:
    """NeMo-RL's layout from ``[B, T]`` response tensors: a prompt column in front, zeros on masked tokens."""
    b = curr.shape[0]
    pad = lambda t: torch.cat([torch.zeros(b, 1, dtype=torch.float64), t * mask], 1).float()  # noqa: E731
    ref = prev + 0.05 * torch.randn(prev.shape, generator=g, dtype=torch.float64)
    data = {
        "token_mask": pad(torch.ones_like(mask)),
        "sample_mask": (mask.sum(-1) > 0).float(),
        "advantages": pad(adv_rows[:, None].expand_as(mask)),
        "prev_logprobs": pad(prev),
        "generation_logprobs": pad(gen),
        "reference_policy_logprobs": pad(ref),
        "rewards": rewards.float(),
    }
    return CompatBatch(name, (curr * mask).float().contiguous(), data)


def synthetic_batch(index: int, seed: int = 0) -> CompatBatch:
    """Synthetic batch ``index`` (its kind is ``SYNTHETIC_KINDS[index % 4]``)."""
    kind = SYNTHETIC_KINDS[index % len(SYNTHETIC_KINDS)]
    g = torch.Generator().manual_seed(1000 * seed + index)
    shape = (ROWS, SEQ_LEN - 1)
    noise = lambda: torch.randn(shape, generator=g, dtype=torch.float64)  # noqa: E731
    prev = -torch.rand(shape, generator=g, dtype=torch.float64) * 2.5 - 0.02
    scale = torch.tensor(ROW_MISMATCH, dtype=torch.float64)[torch.randperm(ROWS, generator=g)].unsqueeze(1)
    gen = (prev - scale * noise() - 0.5 * scale**2).clamp(max=-1e-4)
    curr = (prev + POLICY_DRIFT * noise()).clamp(max=-1e-4)
    lengths = torch.randint(3, SEQ_LEN, (ROWS,), generator=g)
    mask = (torch.arange(SEQ_LEN - 1)[None, :] < lengths[:, None]).double()
    rewards = (torch.rand(ROWS, generator=g) > 0.5).double()
    adv = rewards - rewards.mean() + 0.1 * torch.randn(ROWS, generator=g, dtype=torch.float64)
    if kind == "padded rows":
        mask[-2:] = 0.0
        mask[0] = 0.0
        mask[0, 0] = 1.0
    elif kind == "-inf log-prob":
        gen[1, int(lengths[1]) // 2] = -math.inf
    elif kind == "positive log-probs":
        bump = torch.rand(shape, generator=g, dtype=torch.float64) < 0.1
        for t in (prev, gen, curr):
            t[bump] = torch.rand(int(bump.sum()), generator=g, dtype=torch.float64) * 0.01 + 1e-4
    return _assemble(f"synthetic {index} ({kind})", curr, prev, gen, mask, adv, rewards, g)


def synthetic_batches(n: int, seed: int = 0) -> list[CompatBatch]:
    if n < 1:
        raise ValueError(f"--batches {n}: compare on at least 1 batch (4 cover every synthetic kind)")
    return [synthetic_batch(i, seed) for i in range(n)]


def dump_batches(path: str | Path, max_batches: int, seed: int = 0) -> list[CompatBatch]:
    """Batches of :data:`DUMP_BATCH_SIZE` responses from a rollout dump (at most ``max_batches``); raises
    :class:`~nemo_is_plugin.apps.diagnose.dump.DumpError` for an unreadable dump."""
    from nemo_is_plugin.apps.diagnose.dump import DumpError
    from nemo_is_plugin.apps.diagnose.readers import read_dump

    dump = read_dump(path)
    if dump.num_responses == 0:
        raise DumpError(f"{dump.source}: the dump holds no response")
    g = torch.Generator().manual_seed(seed)
    out = []
    for start in range(0, dump.num_responses, DUMP_BATCH_SIZE)[:max_batches]:
        rows = range(start, min(start + DUMP_BATCH_SIZE, dump.num_responses))
        width = max(int(dump.lengths[i]) for i in rows)
        prev, gen, mask = (torch.zeros(len(rows), width, dtype=torch.float64) for _ in range(3))
        for r, i in enumerate(rows):
            a, z = int(dump.cu_seqlens[i]), int(dump.cu_seqlens[i + 1])
            prev[r, : z - a] = torch.from_numpy(dump.prev_logprobs[a:z])
            gen[r, : z - a] = torch.from_numpy(dump.generation_logprobs[a:z])
            mask[r, : z - a] = torch.from_numpy(dump.mask[a:z].astype(np.float64))
        rewards = _per_row(dump.reward, rows, default=0.0)
        adv = _per_row(dump.advantage, rows, default=math.nan)
        if torch.isnan(adv).any():  # a dump without advantages: GRPO's reward - mean(reward)
            adv = torch.where(torch.isnan(adv), rewards - rewards.mean(), adv)
        curr = prev + DUMP_POLICY_DRIFT * torch.randn(prev.shape, generator=g, dtype=torch.float64)
        out.append(_assemble(f"rollouts {rows.start}-{rows.stop - 1}", curr, prev, gen, mask, adv, rewards, g))
    return out


def _per_row(values: np.ndarray | None, rows: range, default: float) -> torch.Tensor:
    if values is None:
        return torch.full((len(rows),), default, dtype=torch.float64)
    picked = torch.tensor([float(values[i]) for i in rows], dtype=torch.float64)
    return torch.where(torch.isnan(picked), torch.full_like(picked, default), picked)


__all__ = ["CompatBatch", "DUMP_BATCH_SIZE", "SYNTHETIC_KINDS", "dump_batches", "synthetic_batch", "synthetic_batches"]
