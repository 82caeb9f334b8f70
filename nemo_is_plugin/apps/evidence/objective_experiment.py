"""The policy-objective experiment (docs/evidence.md, 4) as one run: the drift sweep of :mod:`.objectives`, the
shape properties of :mod:`.objective_shapes`, and the headline numbers the CLI's table and the docs quote."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from nemo_is_plugin.apps.evidence import objective_shapes as shapes
from nemo_is_plugin.apps.evidence.objectives import DRIFTS, make_batch, run_drift_sweep


def run_objectives(
    *,
    num_seqs: int = 64,
    length: int = 64,
    lengths: Sequence[int] | None = None,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """The drift sweep and the shape properties (:mod:`.objective_shapes`). Returns a JSON-ready dict."""
    batch = make_batch(num_seqs=num_seqs, length=length, seed=seed)
    sweep = run_drift_sweep(batch, progress=progress)
    if progress:
        progress("objectives: SAPO gate")
    sapo = shapes.run_sapo_gate()
    lengths = tuple(lengths) if lengths is not None else shapes.LENGTHS
    if progress:
        progress("objectives: GMPO spread")
    gmpo = shapes.run_gmpo_spread(num_seqs=num_seqs, lengths=lengths, seed=seed + 1)
    if progress:
        progress("objectives: CPPO budget")
    cppo = shapes.run_cppo_budget(num_seqs=num_seqs, lengths=lengths, seed=seed + 2)
    return {"drift_sweep": sweep, "sapo_gate": sapo, "gmpo_spread": gmpo, "cppo_budget": cppo}


def step_count(drifts: Sequence[float] = DRIFTS) -> int:
    """Progress messages :func:`run_objectives` emits (without the runner's plotting step)."""
    return len(drifts) + 3


def first_drift_above(sweep: dict, name: str, level: float) -> float | None:
    """The smallest swept drift at which ``name``'s clip fraction exceeds ``level`` (None when none does: strict
    JSON has no inf)."""
    fractions = np.array(sweep["objectives"][name]["clip_fraction"])
    above = np.nonzero(fractions > level)[0]
    return float(sweep["drifts"][above[0]]) if above.size else None


HEADLINE_DRIFT = 1.0  # the drift the table quotes (one of DRIFTS)


def headline(result: dict) -> dict[str, dict[str, float | None]]:
    """Per objective, the numbers the CLI's table and docs/evidence.md quote: property label -> value (None: the
    sweep never reached it)."""
    sweep = result["drift_sweep"]
    i = sweep["drifts"].index(HEADLINE_DRIFT)
    rows = sweep["objectives"]
    s = f"s={HEADLINE_DRIFT:g}"
    out: dict[str, dict[str, float | None]] = {}
    for name in ("ppo_clip", "dppo_tv", "dppo_kl", "prob_diff", "cppo"):
        out[name] = {
            f"dropped fraction at {s}": rows[name]["clip_fraction"][i],
            f"||g - g_pg|| / ||g_pg|| at {s}": rows[name]["deviation"][i],
            "first drift dropping > 5%": first_drift_above(sweep, name, 0.05),
        }
    cppo = result["cppo_budget"]
    mid_drift = f"{cppo['drifts'][len(cppo['drifts']) // 2]:g}"
    runs_out = cppo["by_length"][mid_drift]["cppo_budget_exhausted_position_fraction"]
    lengths = cppo["lengths"]
    lim = cppo["limit"]
    zero = [b for b, f in zip(lim["delta_b"], lim["budget_bound_fraction"]) if f == 0.0]
    out["cppo"] |= {
        f"budget runs out at (fraction of L), s={mid_drift}, L={lengths[0]}": runs_out[0],
        f"budget runs out at (fraction of L), s={mid_drift}, L={lengths[-1]}": runs_out[-1],
        f"smallest delta_b with no budget-only drop, s={lim['drift']:g}": min(zero) if zero else None,
    }
    sapo = result["sapo_gate"]
    r = np.array(sapo["ratios"])
    pos = np.array(sapo["weights"]["sapo"]["pos"])
    out["sapo"] = {
        "gate weight at r=1 (A>0)": float(pos[np.argmin(np.abs(r - 1.0))]),
        "largest gate weight (A>0)": float(pos.max()),
        "at r": float(r[pos.argmax()]),
    }
    gmpo = result["gmpo_spread"]
    out["gmpo"] = {
        f"ratio std at L={gmpo['lengths'][-1]}: {key}": gmpo["ratios"][key]["std"][-1]
        for key in ("token", "gspo", "gmpo")
    }
    pg = sweep["untruncated_grad_norm"]
    out["gpg"] = {
        "||g|| / ||g_pg|| at s=0": rows["gpg"]["grad_norm"][0] / pg[0],
        f"||g|| / ||g_pg|| at {s}": rows["gpg"]["grad_norm"][i] / pg[i],
        f"||g - g_pg|| / ||g_pg|| at {s}": rows["gpg"]["deviation"][i],
    }
    out["dro"] = {f"pull-back at {s}: {name}": rows[name]["pull_back"][i] for name in rows if name.startswith("dro")}
    out["dro"][f"pull-back at {s}: gpg"] = rows["gpg"]["pull_back"][i]
    return out
