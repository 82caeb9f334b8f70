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


def finite_grad(want: torch.Tensor) -> torch.Tensor:
    """NeMo-RL's gradient with its NaN replaced by 0, the plugin's value there.

    One nemo_rl_compat case (014: on-policy KL approximation, -inf generation log-prob) has a NaN gradient in NeMo-RL:
    its KL weight nan_to_num(exp(c - g)) is the constant 0 on that token, but the backward of exp(inf) multiplies the
    0 gradient by inf. The plugin gives that token gradient 0, the derivative of the forward value NeMo-RL computes; a
    NaN gradient would poison the weights. (Every other golden gradient is finite: this is the identity there.)
    """
    return torch.where(torch.isnan(want), torch.zeros_like(want), want)
