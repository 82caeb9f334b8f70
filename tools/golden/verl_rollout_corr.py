"""Regenerate the verl rollout-correction golden suite (tests/data/golden/verl_rollout_corr) from a verl checkout.

    python -m tools.golden.verl_rollout_corr --repo /path/to/verl --out /tmp/verl_rollout_corr [--check]

Each committed case stores the exact arguments of one call of
``verl.trainer.ppo.rollout_corr_helper.compute_rollout_correction_and_rejection_mask`` (``rollout_is``,
``rollout_is_threshold``, ``rollout_is_batch_normalize``, ``rollout_rs``, ``rollout_rs_threshold``) and its inputs;
this calls it from the checkout (the suite records volcengine/verl, now verl-project/verl, commit
b178a3cd56f58b2d502255daba591e92833930a7) in float32 on CPU without ``torch.distributed``, and writes
``expected = {rollout_is_weights (or None), modified_response_mask, metrics}``, or ``{error: {raises, message}}``.

Cases made from a ``RolloutCorrectionConfig`` preset name it in ``params["preset"]``; the stored arguments are what
runs, and a preset whose current defaults no longer give those arguments is reported (a note, not a failure: the
suite pins the call, the preset is how the case was chosen).

The installed ``transformers`` cannot be imported by the checkout (it names classes newer releases removed); the
code under test never uses it, so it is replaced by an empty stub (tools/golden/checkout.py, ``install_stubs``). verl
runs from the checkout, unchanged, not from the verl installed in the environment.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from tools.golden import checkout, common

CALL_ARGUMENTS = (
    "rollout_is",
    "rollout_is_threshold",
    "rollout_is_batch_normalize",
    "rollout_rs",
    "rollout_rs_threshold",
)


def make_regenerate(repo: Path):
    checkout.install_stubs(always=["transformers"])
    checkout.use_checkout(repo, "verl")
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    def preset_note(case: dict) -> None:
        preset = case["params"].get("preset")
        if not preset or preset == "disabled":
            return
        config = getattr(RolloutCorrectionConfig, preset)()
        changed = {k: getattr(config, k) for k in CALL_ARGUMENTS if getattr(config, k) != case["params"][k]}
        if changed:
            print(f"note: {case['description']!r}: the stored arguments differ from {preset}()'s {changed}")

    def regenerate(case: dict) -> dict:
        preset_note(case)
        inputs = case["inputs"]
        try:
            weights, mask, metrics = compute_rollout_correction_and_rejection_mask(
                old_log_prob=inputs["old_log_prob"],
                rollout_log_prob=inputs["rollout_log_prob"],
                response_mask=inputs["response_mask"],
                **{k: case["params"][k] for k in CALL_ARGUMENTS},
            )
        except (TypeError, ValueError, AssertionError) as exc:
            return {"error": {"raises": common.error_name(exc), "message": str(exc)}}
        return {
            "rollout_is_weights": None if weights is None else weights.batch["rollout_is_weights"],
            "modified_response_mask": mask,
            "metrics": common.to_metrics(metrics),
        }

    return regenerate


def redraw(case: dict, generator: torch.Generator, seed: int, template: str) -> dict:
    """New inputs on a case's call arguments and response mask: training log-probs -|N(0,1)|, rollout log-probs
    those plus N(0, 0.05^2)."""
    inputs, params = case["inputs"], case["params"]
    old = common.log_probs(inputs["response_mask"].shape, generator)
    inputs["old_log_prob"] = old
    inputs["rollout_log_prob"] = old + common.normal(old.shape, generator, 0.05)
    params["seed"], params["generator"] = seed, {"fresh_from": template}
    case["description"] = f"fresh inputs (seed {seed}) on {template}'s arguments and mask: {case['description']}"
    return case


def tolerance(case: dict, path: tuple[str, ...]) -> common.Tolerance:
    """Suite README, "Tolerances": masks exact, weights rtol 1e-5 / atol 1e-7, metrics rtol 1e-5 / atol 1e-6."""
    if path[:1] == ("modified_response_mask",):
        return 0.0, 0.0
    if path[:1] == ("rollout_is_weights",):
        return 1e-5, 1e-7
    return 1e-5, 1e-6


SUITE = common.Suite(
    "verl_rollout_corr",
    "volcengine/verl",
    "b178a3cd56f58b2d502255daba591e92833930a7",
    make_regenerate,
    tolerance,
    redraw,
)


def main(argv: Sequence[str] | None = None) -> int:
    return common.run(SUITE, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
