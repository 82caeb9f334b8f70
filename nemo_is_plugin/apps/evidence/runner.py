"""Run the evidence experiments, write their PNGs and one JSON of the numbers, and pick the headline numbers.

``run_evidence(output_dir)`` is what ``nemo-is evidence`` calls; the default sizes take about a minute on 2 CPU cores,
``quick=True`` a few seconds (for tests and smoke runs; the numbers are noisier, the figures look the same).
"""

from __future__ import annotations

import json
import platform
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from nemo_is_plugin.apps.evidence import (
    ctpo_variance,
    drift,
    is_collapse,
    kl_gradient_bias,
    objective_experiment,
    rejection,
)

EXPERIMENTS = ("is_collapse", "ctpo_variance", "kl_gradient_bias", "objectives", "rejection", "drift")
JSON_NAME = "evidence_numbers.json"
FIGURES = {
    "is_collapse": ("evidence_is_collapse.png", "evidence_is_lr_scale.png"),
    "ctpo_variance": ("evidence_ctpo_variance.png",),
    "kl_gradient_bias": ("evidence_kl_gradient_bias.png",),
    "objectives": ("evidence_objectives.png",),
    "rejection": ("evidence_rejection.png",),
    "drift": ("evidence_drift.png",),
}
PLOTTING = {  # what the progress line says while an experiment's figures are drawn
    "is_collapse": "IS collapse",
    "ctpo_variance": "CTPO variance",
    "kl_gradient_bias": "KL gradient bias",
    "objectives": "policy objectives",
    "rejection": "rejection rules",
    "drift": "drift",
}


@dataclass(frozen=True)
class Sizes:
    """Monte Carlo sizes: sequences per (distribution, length); CTPO samples and horizon; KL samples; the policy
    objectives' batch (sequences, tokens) and the lengths of their GMPO / CPPO sweeps; the rejection rules' batch and
    the lengths of their sequence panel; the drift experiment's GRPO steps, batch and seeds."""

    is_num_seqs: int = 256
    ctpo_num_samples: int = 400_000
    ctpo_horizon: int = 32
    kl_num_samples: int = 200_000
    objective_num_seqs: int = 64
    objective_length: int = 64
    objective_lengths: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
    rejection_num_seqs: int = 128
    rejection_length: int = 128
    rejection_lengths: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512)
    drift_steps: int = 100
    drift_batch: int = 64
    drift_seeds: tuple[int, ...] = (0, 1, 2, 3, 4)

    def synthetic_batch(self, experiment: str) -> dict[str, Any]:
        """The ``num_seqs``, ``length`` and ``lengths`` of the policy objectives' or the rejection rules' batch."""
        prefix = {"objectives": "objective", "rejection": "rejection"}[experiment]
        return {key: getattr(self, f"{prefix}_{key}") for key in ("num_seqs", "length", "lengths")}


FULL = Sizes()
QUICK = Sizes(
    is_num_seqs=32,
    ctpo_num_samples=20_000,
    ctpo_horizon=16,
    kl_num_samples=20_000,
    objective_num_seqs=16,
    objective_length=32,
    objective_lengths=(16, 64, 256),
    rejection_num_seqs=64,
    rejection_length=64,
    rejection_lengths=(8, 32, 128),
    drift_steps=8,
    drift_batch=16,
    drift_seeds=(0, 1),
)


def step_count(only: Sequence[str] = EXPERIMENTS) -> int:
    """Number of progress messages :func:`run_evidence` emits (for a progress bar's total)."""
    counts = {
        "drift": drift.step_count(),
        "is_collapse": len(is_collapse.default_distributions()) * len(is_collapse.LENGTHS),
        "ctpo_variance": len(ctpo_variance.CHI2_VALUES),
        "kl_gradient_bias": len(kl_gradient_bias.ALL_VARIANTS),
        "objectives": objective_experiment.step_count(),
        "rejection": rejection.step_count(),
    }
    return sum(counts[name] + 1 for name in only)  # + 1: the plotting step of each experiment


def run_evidence(
    output_dir: Path,
    *,
    quick: bool = False,
    seed: int = 0,
    only: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Run the selected experiments (all by default), write the figures and ``evidence_numbers.json``.

    Returns the dict written to the JSON: ``meta``, one entry per experiment, ``headline`` and ``files``.
    """
    names = tuple(only) if only else EXPERIMENTS
    unknown = [n for n in names if n not in EXPERIMENTS]
    if unknown:
        raise ValueError(f"unknown experiment(s) {unknown}; choose from {EXPERIMENTS}")
    sizes = QUICK if quick else FULL
    out_dir = Path(output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda _msg: None)
    results: dict = {
        "meta": {
            "seed": seed,
            "quick": quick,
            "sizes": asdict(sizes),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
    }
    files: list[Path] = []
    for name in (n for n in EXPERIMENTS if n in names):
        res = _run_experiment(name, sizes, seed, say)
        say(f"plotting {PLOTTING[name]}")
        files += _plot_experiment(name, res, [out_dir / f for f in FIGURES[name]])
        results[name] = res
    results["headline"] = headline(results)
    results["files"] = [str(f) for f in files]
    # allow_nan=False: the file must be strict JSON (a NaN would mean a bug upstream, so fail loudly).
    (out_dir / JSON_NAME).write_text(json.dumps(results, indent=1, allow_nan=False) + "\n")
    return results


def _run_experiment(name: str, sizes: Sizes, seed: int, say: Callable[[str], None]) -> dict:
    if name == "is_collapse":
        return is_collapse.run_is_collapse(num_seqs=sizes.is_num_seqs, seed=seed, progress=say)
    if name == "ctpo_variance":
        samples, horizon = sizes.ctpo_num_samples, sizes.ctpo_horizon
        return ctpo_variance.run_ctpo_variance(num_samples=samples, horizon=horizon, seed=seed, progress=say)
    if name == "kl_gradient_bias":
        return kl_gradient_bias.run_kl_gradient_bias(num_samples=sizes.kl_num_samples, seed=seed, progress=say)
    if name == "objectives":
        return objective_experiment.run_objectives(**sizes.synthetic_batch(name), seed=seed, progress=say)
    if name == "rejection":
        return rejection.run_rejection(**sizes.synthetic_batch(name), seed=seed, progress=say)
    # seeds offset by the run's seed: each drift seed is its own paired (SC off / on) replicate
    seeds = [seed + s for s in sizes.drift_seeds]
    return drift.run_drift(steps=sizes.drift_steps, batch=sizes.drift_batch, seeds=seeds, progress=say)


def _plot_experiment(name: str, res: dict, paths: list[Path]) -> list[Path]:
    """The experiment's figures, written to ``paths`` (its ``FIGURES``)."""
    from nemo_is_plugin.apps.evidence import drift_plots, objective_plots, plots, rejection_plots

    if name == "is_collapse":
        return [plots.plot_is_collapse(res, paths[0]), plots.plot_is_lr_scale(res, paths[1])]
    plot = {
        "ctpo_variance": plots.plot_ctpo_variance,
        "kl_gradient_bias": plots.plot_kl_gradient_bias,
        "objectives": objective_plots.plot_objectives,
        "rejection": rejection_plots.plot_rejection,
        "drift": drift_plots.plot_drift,
    }[name]
    return [plot(res, paths[0])]


def headline(results: dict) -> dict:
    """The numbers docs/evidence.md quotes, one flat dict per experiment."""
    out: dict = {}
    if "is_collapse" in results:
        r = results["is_collapse"]
        i = r["lengths"].index(9000)
        fit = next(d for d in r["distributions"] if d["name"] == "seed fit")
        u2 = r["stats"]["unbiased 2%"]
        s2 = r["stats"]["2% shift"]
        out["is_collapse"] = {
            "seed_fit_shift": fit["shift"],
            "seed_fit_spread": fit["spread"],
            "seed_fit_mc_mean_9k": r["seed_check"]["mean"],
            "seed_fit_mc_mean_se": r["seed_check"]["mean_se"],
            "seed_fit_mc_std_9k": r["seed_check"]["std"],
            "seed_fit_mc_std_se": r["seed_check"]["std_se"],
            "unbiased2_sequence_median_9k": u2["sequence"]["p50"][i],
            "unbiased2_sequence_ess_9k": u2["sequence"]["ess_fraction"][i],
            "unbiased2_sequence_mean_p5_p95_9k": [u2["sequence_mean"]["p5"][i], u2["sequence_mean"]["p95"][i]],
            "shift2_sequence_mean_9k": s2["sequence"]["mean"][i],
            "shift2_sequence_mean_level_9k": s2["sequence_mean"]["mean"][i],
        }
    if "ctpo_variance" in results:
        out["ctpo_variance"] = [
            {
                "chi2": run["chi2"],
                "horizon": run["horizon"],
                "predicted_ratio_t1": run["predicted_second_moment_ratio"][0],
                "measured_second_moment_ratio_t1": run["measured_second_moment_ratio"][0],
                "ratio_se_t1": run["measured_second_moment_ratio_se"][0],
                "ratio_exact_se_t1": run["predicted_second_moment_ratio_se"][0],
                "measured_variance_ratio_t1": run["measured_variance_ratio"][0],
                "max_abs_ratio_z": max(abs(z) for z in run["second_moment_ratio_z"]),
                "max_abs_z_cumulative_mean": run["max_abs_z_cumulative"],
                "max_abs_z_full_mean": run["max_abs_z_full"],
            }
            for run in results["ctpo_variance"]["runs"]
        ]
    if "kl_gradient_bias" in results:
        out["kl_gradient_bias"] = {
            v["name"]: {"max_abs_z": v["max_abs_z"], "p_value": v["p_value"], "exact_bias_norm": v["exact_bias_norm"]}
            for v in results["kl_gradient_bias"]["variants"]
        }
    if "objectives" in results:
        from nemo_is_plugin.apps.evidence.objective_experiment import headline as objectives_headline

        out["objectives"] = objectives_headline(results["objectives"])
    if "rejection" in results:
        from nemo_is_plugin.apps.evidence.rejection import headline as rejection_headline

        out["rejection"] = rejection_headline(results["rejection"])
    if "drift" in results:
        from nemo_is_plugin.apps.evidence.drift import headline as drift_headline

        out["drift"] = drift_headline(results["drift"])
    return out
