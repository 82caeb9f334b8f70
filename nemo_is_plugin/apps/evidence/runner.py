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

import torch

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
    from nemo_is_plugin.apps.evidence import (
        ctpo_variance,
        drift,
        is_collapse,
        kl_gradient_bias,
        objective_experiment,
        rejection,
    )

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
    from nemo_is_plugin.apps.evidence import (
        ctpo_variance,
        drift,
        drift_plots,
        is_collapse,
        kl_gradient_bias,
        objective_experiment,
        objective_plots,
        plots,
        rejection,
        rejection_plots,
    )

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
    files = []
    if "is_collapse" in names:
        res = is_collapse.run_is_collapse(num_seqs=sizes.is_num_seqs, seed=seed, progress=say)
        say("plotting IS collapse")
        files.append(plots.plot_is_collapse(res, out_dir / FIGURES["is_collapse"][0]))
        files.append(plots.plot_is_lr_scale(res, out_dir / FIGURES["is_collapse"][1]))
        results["is_collapse"] = res
    if "ctpo_variance" in names:
        res = ctpo_variance.run_ctpo_variance(
            num_samples=sizes.ctpo_num_samples, horizon=sizes.ctpo_horizon, seed=seed, progress=say
        )
        say("plotting CTPO variance")
        files.append(plots.plot_ctpo_variance(res, out_dir / FIGURES["ctpo_variance"][0]))
        results["ctpo_variance"] = res
    if "kl_gradient_bias" in names:
        res = kl_gradient_bias.run_kl_gradient_bias(num_samples=sizes.kl_num_samples, seed=seed, progress=say)
        say("plotting KL gradient bias")
        files.append(plots.plot_kl_gradient_bias(res, out_dir / FIGURES["kl_gradient_bias"][0]))
        results["kl_gradient_bias"] = res
    if "objectives" in names:
        res = objective_experiment.run_objectives(
            num_seqs=sizes.objective_num_seqs,
            length=sizes.objective_length,
            lengths=sizes.objective_lengths,
            seed=seed,
            progress=say,
        )
        say("plotting policy objectives")
        files.append(objective_plots.plot_objectives(res, out_dir / FIGURES["objectives"][0]))
        results["objectives"] = res
    if "rejection" in names:
        res = rejection.run_rejection(
            num_seqs=sizes.rejection_num_seqs,
            length=sizes.rejection_length,
            lengths=sizes.rejection_lengths,
            seed=seed,
            progress=say,
        )
        say("plotting rejection rules")
        files.append(rejection_plots.plot_rejection(res, out_dir / FIGURES["rejection"][0]))
        results["rejection"] = res
    if "drift" in names:
        # seeds offset by the run's seed: each drift seed is its own paired (SC off / on) replicate
        res = drift.run_drift(
            steps=sizes.drift_steps,
            batch=sizes.drift_batch,
            seeds=[seed + s for s in sizes.drift_seeds],
            progress=say,
        )
        say("plotting drift")
        files.append(drift_plots.plot_drift(res, out_dir / FIGURES["drift"][0]))
        results["drift"] = res
    results["headline"] = headline(results)
    results["files"] = [str(f) for f in files]
    # allow_nan=False: the file must be strict JSON (a NaN would mean a bug upstream, so fail loudly).
    (out_dir / JSON_NAME).write_text(json.dumps(results, indent=1, allow_nan=False) + "\n")
    return results


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
