"""Writers for the run directory: ``metrics.jsonl`` / ``metrics.csv`` (one row per (config, step)) and
``rollouts.jsonl`` (one object per response, the format ``nemo-is diagnose`` reads).

``rollouts.jsonl`` keys: ``generation_logprobs``, ``prev_logprobs``, ``mask`` (lists over the response tokens, same
length), ``advantage``, ``reward``, ``step``, ``config``, ``sample_id``, plus ``phase`` ("short" / "long"). In the
long phase ``config`` is suffixed ``@long`` so a diagnose run groups the two lengths apart.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import torch


def _clean(v: Any) -> Any:
    """JSON-safe scalars: NaN / inf become None (JSON has no NaN)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class RunRecords:
    """Appends rows as the run goes (so a crash keeps what was done); ``close()`` writes the CSV."""

    def __init__(self, output_dir: str | Path) -> None:
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict[str, Any]] = []
        self._metrics = open(self.dir / "metrics.jsonl", "w")
        self._rollouts = open(self.dir / "rollouts.jsonl", "w")
        self._next_sample = 0

    def metrics_row(self, row: dict[str, Any]) -> None:
        row = {k: _clean(v) for k, v in row.items()}
        self.rows.append(row)
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()

    def rollouts(
        self,
        *,
        config: str,
        phase: str,
        step: int,
        generation_logprobs: torch.Tensor,
        prev_logprobs: torch.Tensor,
        mask: torch.Tensor,
        advantages: torch.Tensor,
        rewards: torch.Tensor,
    ) -> None:
        """One line per response. Tensors are response-aligned: [B, R] (lists are cut at the last masked token)."""
        name = config if phase == "short" else f"{config}@{phase}"
        for i in range(mask.shape[0]):
            n = int(mask[i].nonzero().max()) + 1 if mask[i].any() else 0
            rec = {
                "config": name,
                "phase": phase,
                "step": step,
                "sample_id": self._next_sample,
                "reward": float(rewards[i]),
                "advantage": float(advantages[i]),
                "generation_logprobs": [round(float(x), 6) for x in generation_logprobs[i, :n]],
                "prev_logprobs": [round(float(x), 6) for x in prev_logprobs[i, :n]],
                "mask": [int(x) for x in mask[i, :n]],
            }
            self._next_sample += 1
            self._rollouts.write(json.dumps(rec) + "\n")
        self._rollouts.flush()

    def close(self) -> None:
        self._metrics.close()
        self._rollouts.close()
        keys: list[str] = []
        for row in self.rows:
            keys.extend(k for k in row if k not in keys)
        with open(self.dir / "metrics.csv", "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=keys)
            writer.writeheader()
            writer.writerows(self.rows)
