"""Loading the golden cases copied from the reference implementations (tests/data/golden/*/README.md)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden"


def load_cases(suite: str) -> list[dict]:
    return [torch.load(p, weights_only=True) for p in sorted((GOLDEN / suite).glob("case_*.pt"))]


def case_ids(cases: list[dict]) -> list[str]:
    return [c.get("id") or c["description"][:40] for c in cases]


def load_named_cases(suite: str) -> list[dict]:
    """Like :func:`load_cases`, with ``id`` set to the file stem (``case_007``) when the case has none."""
    cases = []
    for p in sorted((GOLDEN / suite).glob("case_*.pt")):
        case = torch.load(p, weights_only=True)
        case.setdefault("id", p.stem)
        cases.append(case)
    return cases


# Metric tolerances of the NeMo-RL golden READMEs (tests/data/golden/nemo_rl*/README.md).
NEMO_RL_LOOSE = frozenset({"gen_kl_error", "policy_kl_error", "js_divergence_error", "kl_penalty"})
NEMO_RL_EXACT = frozenset({"is_oob_ratio", "num_valid_samples"})


def metric_close(name: str, got: float, want: float) -> bool:
    """A NeMo-RL metric within the README tolerance; +-inf and NaN must match exactly."""
    if math.isinf(want) or math.isnan(want):
        return got == want or (math.isnan(want) and math.isnan(got))
    if name in NEMO_RL_EXACT or name.endswith("_min") or name.endswith("_max"):
        rtol, atol = 1e-6, 0.0
    elif name in NEMO_RL_LOOSE:
        rtol, atol = 1e-3, 1e-6
    else:
        rtol, atol = 1e-4, 1e-6
    return abs(got - want) <= atol + rtol * abs(want)
