"""Loading the golden cases copied from the reference implementations (tests/data/golden/*/README.md)."""

from __future__ import annotations

from pathlib import Path

import torch

from tools.golden import common, nemo_rl

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


def metric_close(name: str, got: float, want: float) -> bool:
    """A NeMo-RL metric within the golden READMEs' tolerance (tests/data/golden/nemo_rl*/README.md), the rule the
    suites' generator applies (tools/golden/nemo_rl.py, ``metric_tolerance``); +-inf and NaN must match exactly."""
    return common.close(got, want, nemo_rl.metric_tolerance(name))
