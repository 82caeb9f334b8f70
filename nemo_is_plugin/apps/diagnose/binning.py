"""Response-length bins: power-of-two edges by default (lengths span decades; IS variance grows with length)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LengthBin:
    """Responses with ``lo <= valid length < hi`` (hi = None: unbounded)."""

    lo: int
    hi: int | None

    @property
    def label(self) -> str:
        if self.hi is None:
            return f">={self.lo}"
        return f"{self.lo}" if self.hi == self.lo + 1 else f"{self.lo}-{self.hi - 1}"

    def contains(self, lengths: np.ndarray) -> np.ndarray:
        """bool[B] for int lengths [B]."""
        inside = lengths >= self.lo
        return inside if self.hi is None else inside & (lengths < self.hi)


def length_bins(valid_lengths: np.ndarray, *, max_bins: int = 6, edges: Sequence[int] | None = None) -> list[LengthBin]:
    """Bins covering every response with at least one valid token; empty bins are dropped.

    Args:
        valid_lengths: int[B] unmasked tokens per response (responses with 0 are not binned).
        max_bins: default edges are powers of two, grouped a few octaves per bin so at most this many remain.
        edges: explicit inner edges (e.g. ``[256, 1024, 4096]`` gives ``1-255, 256-1023, 1024-4095, >=4096``).
    """
    lengths = np.asarray(valid_lengths, dtype=np.int64)
    lengths = lengths[lengths > 0]
    if len(lengths) == 0:
        return []
    ends: list[int | None]  # a bin's exclusive end; None: unbounded
    if edges is not None:
        inner = sorted({int(e) for e in edges if int(e) > 1})
        starts, ends = [1, *inner], [*inner, None]
    else:
        if max_bins < 1:
            raise ValueError(f"max_bins must be >= 1, got {max_bins}")
        e_lo = int(math.floor(math.log2(int(lengths.min()))))
        e_hi = int(math.floor(math.log2(int(lengths.max())))) + 1
        step = max(1, math.ceil((e_hi - e_lo) / max_bins))
        top = e_lo + step * math.ceil((e_hi - e_lo) / step)  # >= e_hi: the last bin ends above the longest response
        bounds = [2**e for e in range(e_lo, top + 1, step)]
        starts, ends = bounds[:-1], [*bounds[1:]]
    bins = [LengthBin(lo, hi) for lo, hi in zip(starts, ends)]
    return [b for b in bins if b.contains(lengths).any()]
