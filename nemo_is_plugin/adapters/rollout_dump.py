"""Dump rollouts from inside training, in the format ``nemo-is diagnose`` reads (``diagnose.dump``: one JSON line per
response with ``generation_logprobs``, ``prev_logprobs``, ``mask``, ``advantage``, ``reward``, ``step``).

Opt-in: nothing is written unless a path is given, as an argument or in ``$NEMO_IS_DUMP_ROLLOUTS`` (``.jsonl`` or
``.jsonl.gz``; appended to, one call per training step). ``$NEMO_IS_DUMP_EVERY=k`` keeps every k-th step. The host
calls it once per step from its driver process, where the whole batch is (see ``adapters.nemo_rl.dump_rollouts`` and
``adapters.verl.dump_rollouts``); the tensors may live on any device and are copied to the host in one transfer.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

DUMP_ENV = "NEMO_IS_DUMP_ROLLOUTS"
EVERY_ENV = "NEMO_IS_DUMP_EVERY"


class RolloutDumper:
    """Appends one record per response of each batch it is given to ``path`` (JSONL, gzipped if it ends in .gz).

    Args:
        path: the dump file; its directory is created. Records are appended, so a resumed run continues its dump.
        every: keep only steps that are multiples of ``every``.
        config: an optional label written into every record (``nemo-is diagnose --config`` selects it).
    """

    def __init__(self, path: str | os.PathLike, every: int = 1, config: str | None = None):
        if every < 1:
            raise ValueError(f"every={every}: dump every k-th step with k >= 1")
        self.path, self.every, self.config = Path(path), int(every), config
        self._next_sample = 0

    @classmethod
    def resolve(cls, path: str | os.PathLike | None = None) -> RolloutDumper | None:
        """A dumper for ``path``, else for ``$NEMO_IS_DUMP_ROLLOUTS``; None when neither is set (dumping is off)."""
        target = path if path is not None else os.environ.get(DUMP_ENV) or None
        if target is None:
            return None
        return _cached(str(target), int(os.environ.get(EVERY_ENV, "1")))

    def wants(self, step: int) -> bool:
        return step % self.every == 0

    def write(
        self,
        prev_logprobs: torch.Tensor,
        generation_logprobs: torch.Tensor,
        mask: torch.Tensor,
        *,
        step: int,
        advantages: torch.Tensor | None = None,
        rewards: torch.Tensor | None = None,
    ) -> int:
        """Append the responses of one batch; returns how many were written (rows without a valid token are not).

        Args:
            prev_logprobs, generation_logprobs: Float[B, T] training / rollout log-probs of the same tokens.
            mask: [B, T] 1 where a token counts (response tokens of valid samples); anything numeric or bool.
            advantages: Float[B, T] (NeMo-RL, verl: constant along a GRPO response) or Float[B]; the record holds each
                response's mean over its valid tokens.
            rewards: Float[B] per-response rewards.
        """
        b, t = prev_logprobs.shape
        dtype = torch.promote_types(prev_logprobs.dtype, torch.float32)  # half-precision rewards would round
        m = mask.detach().to(dtype)
        adv = advantages if advantages is not None else torch.zeros_like(m)
        adv = adv.detach().to(dtype).reshape(b, -1).expand(b, t)
        token = [prev_logprobs.detach().to(dtype), generation_logprobs.detach().to(dtype), m, adv]
        parts = [torch.stack(token).reshape(-1)]
        if rewards is not None:
            parts.append(rewards.detach().to(dtype).reshape(-1))
        host = torch.cat(parts).to("cpu", torch.float64).numpy()  # the one device -> host transfer
        prev, gen, valid, adv_h = host[: 4 * b * t].reshape(4, b, t)
        reward = host[4 * b * t :] if rewards is not None else None
        lines = []
        for i in range(b):
            idx = valid[i].nonzero()[0]
            if len(idx) == 0:
                continue
            a, z = int(idx[0]), int(idx[-1]) + 1  # from the first to the last valid token (prompts drop out)
            keep = valid[i, a:z] != 0
            rec: dict[str, Any] = {
                "generation_logprobs": [round(float(x), 6) if k else 0.0 for x, k in zip(gen[i, a:z], keep)],
                "prev_logprobs": [round(float(x), 6) if k else 0.0 for x, k in zip(prev[i, a:z], keep)],
                "mask": keep.astype(int).tolist(),
                "advantage": float(adv_h[i, a:z][keep].mean()),
                "step": int(step),
                "sample_id": self._next_sample,
            }
            if reward is not None:
                rec["reward"] = float(reward[i])
            if self.config is not None:
                rec["config"] = self.config
            self._next_sample += 1
            lines.append(json.dumps(rec))
        if lines:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            opener = gzip.open if self.path.suffix == ".gz" else open  # appended gzip members read as one stream
            with opener(self.path, "at", encoding="utf-8") as fh:
                fh.write("\n".join(lines) + "\n")
        return len(lines)


_DUMPERS: dict[tuple[str, int], RolloutDumper] = {}


def _cached(path: str, every: int) -> RolloutDumper:
    """One dumper per (path, every) per process, so that sample ids keep counting across steps."""
    key = (path, every)
    if key not in _DUMPERS:
        _DUMPERS[key] = RolloutDumper(path, every)
    return _DUMPERS[key]


def dump_batch(
    tensors: Mapping[str, Any],
    step: int,
    path: str | os.PathLike | None = None,
    *,
    rewards: torch.Tensor | None = None,
    **keys: str,
) -> int:
    """Dump one training batch held under the host's own key names (``keys``: prev, gen, mask, advantages, rewards,
    sample_mask); ``rewards`` given directly wins. A no-op returning 0 when dumping is off or ``step`` is skipped."""
    dumper = RolloutDumper.resolve(path)
    if dumper is None or not dumper.wants(step):
        return 0

    def get(role: str) -> torch.Tensor | None:
        name = keys.get(role)
        return tensors[name] if name is not None and name in tensors else None

    prev, gen, mask = get("prev"), get("gen"), get("mask")
    if prev is None or gen is None or mask is None:
        missing = [keys[r] for r in ("prev", "gen", "mask") if get(r) is None]
        raise KeyError(f"dumping rollouts needs {missing} in the batch (present: {sorted(map(str, tensors.keys()))})")
    sample_mask = get("sample_mask")
    if sample_mask is not None:
        mask = mask * sample_mask.to(mask.dtype).reshape(-1, 1)
    rewards = rewards if rewards is not None else get("rewards")
    return dumper.write(prev, gen, mask, step=step, advantages=get("advantages"), rewards=rewards)


__all__ = ["DUMP_ENV", "EVERY_ENV", "RolloutDumper", "dump_batch"]
