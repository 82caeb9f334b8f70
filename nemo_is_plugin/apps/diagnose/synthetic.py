"""A synthetic rollout dump with a controllable training/rollout mismatch, for tests and documentation.

Model (per token t of response i, all independent):

    g_t  = -Exponential(mean=entropy)                       rollout-engine log-prob of the sampled token
    d_t  = bias + std * (1 + |g_t|) * N(0, 1)               mismatch, larger on uncertain tokens (as measured in
                                                            vLLM vs Megatron: low-probability tokens disagree most)
    d_t ~ N(0, outlier_std) with probability outlier_rate   rare large disagreements (kernel / precision outliers)
    p_t  = min(g_t + d_t, 0)                                training-engine log-prob

Response lengths are log-uniform in [min_len, max_len]; a fraction of responses gets masked trailing padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def synthetic_records(
    num_responses: int = 64,
    *,
    min_len: int = 16,
    max_len: int = 2048,
    mismatch_std: float = 0.02,
    mismatch_bias: float = 0.0,
    outlier_rate: float = 1e-3,
    outlier_std: float = 2.0,
    entropy: float = 0.3,
    padded_fraction: float = 0.25,
    steps: int = 1,
    configs: Sequence[str] | None = None,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Records in the dump format (see ``nemo_is_plugin.apps.diagnose.dump``), one per response.

    Args:
        num_responses: B responses, spread evenly over ``steps`` steps (and cycled over ``configs`` if given).
        min_len, max_len: response length range (tokens, masked padding excluded), log-uniform.
        mismatch_std, mismatch_bias: scale and mean of p_t - g_t (see module docstring).
        outlier_rate, outlier_std: rate and size of large per-token disagreements.
        entropy: mean of -g_t.
        padded_fraction: fraction of responses followed by 1-8 masked padding tokens.
        seed: numpy seed; the same arguments give the same records.
    """
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.uniform(np.log(min_len), np.log(max_len + 1), size=num_responses)).astype(np.int64)
    lengths = np.clip(lengths, min_len, max_len)
    records = []
    for i, n in enumerate(lengths):
        pad = int(rng.integers(1, 9)) if rng.random() < padded_fraction else 0
        g = -rng.exponential(entropy, size=n)
        d = mismatch_bias + mismatch_std * (1.0 + np.abs(g)) * rng.standard_normal(n)
        out = rng.random(n) < outlier_rate
        d[out] = rng.normal(0.0, outlier_std, size=int(out.sum()))
        p = np.minimum(g + d, 0.0)
        rec: dict[str, Any] = {
            "generation_logprobs": np.concatenate([g, np.zeros(pad)]).round(7).tolist(),
            "prev_logprobs": np.concatenate([p, np.zeros(pad)]).round(7).tolist(),
            "mask": [1] * int(n) + [0] * pad,
            "advantage": float(rng.choice([-1.0, 1.0])),
            "reward": float(rng.integers(0, 2)),
            "step": int(i * steps // max(num_responses, 1)),
            "sample_id": i,
        }
        if configs:
            rec["config"] = str(configs[i % len(configs)])
        records.append(rec)
    return records
