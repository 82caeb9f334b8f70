"""Dumps with exactly known log-probs, shared by the diagnose tests."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from nemo_is_plugin.apps.diagnose.dump import RolloutDump


def constant_dump(
    lengths: Sequence[int], delta: float, *, gen: float = -1.0, masked_tail: Sequence[int] | None = None
) -> RolloutDump:
    """Responses of the given valid lengths with p_t - g_t = delta on every token (g_t = gen).

    masked_tail: per response, extra masked tokens appended (holding 0).
    """
    tails = masked_tail or [0] * len(lengths)
    g, p, m = [], [], []
    for n, tail in zip(lengths, tails):
        g += [gen] * n + [0.0] * tail
        p += [gen + delta] * n + [0.0] * tail
        m += [True] * n + [False] * tail
    total = np.asarray(lengths) + np.asarray(tails)
    cu = np.concatenate([[0], np.cumsum(total)]).astype(np.int64)
    return RolloutDump(np.asarray(g, float), np.asarray(p, float), np.asarray(m, bool), cu, source="<constant>")
