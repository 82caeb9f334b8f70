"""Regenerate the NeMo-RL ``ClippedPGLossFn`` golden suite (tests/data/golden/nemo_rl) from a NeMo-RL checkout.

    python -m tools.golden.nemo_rl --repo /path/to/NVIDIA-NeMo/RL --out /tmp/nemo_rl [--check]

Each committed case stores the full ``ClippedPGLossConfig`` and every input of one call; this re-runs
``nemo_rl.algorithms.loss.loss_functions.ClippedPGLossFn`` from the checkout on them, in float32 on CPU, exactly as
the suite README describes the call:

    fn = ClippedPGLossFn(ClippedPGLossConfig(**config))
    loss, metrics = fn(next_token_logprobs=x, data=BatchedDataDict(other inputs), global_valid_seqs, global_valid_toks)

with ``x`` (and ``curr_logprobs_unfiltered`` when the case has it, see tools/golden/nemo_rl_compat.py) a leaf that
requires grad, and writes ``expected = {loss, metrics, grad_<input>}`` (zeros where the loss does not depend on an
input), or ``{error, message, stage}`` when the constructor (``init``) or the call (``call``) raises.

Importing ``loss_functions`` pulls in NeMo-RL's logger, worker and server modules. The packages those import but the
loss never calls (experiment trackers, metrics exporters, web servers, ZeroMQ, NVML, Hydra, TensorBoard) are replaced
by empty stubs when they are not installed (tools/golden/checkout.py, ``install_stubs``); nothing of NeMo-RL is stubbed,
copied or changed. The suite records commit 7ea279abfbeb698b092856d0dab61e7cf39bc909 of NVIDIA-NeMo/RL.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tools.golden import checkout, common

# Imported at module level somewhere under nemo_rl.algorithms.loss, never called by ClippedPGLossFn.
UNUSED_PACKAGES = "fastapi hydra mlflow prometheus_client pynvml swanlab tensorboard uvicorn wandb zmq".split()
# Input tensors a case may hand in as differentiable leaves, in the order their gradients are stored.
DIFFERENTIABLE_INPUTS = ("next_token_logprobs", "curr_logprobs_unfiltered")

# Metric tolerances of the suite README ("Tolerances"): cancellation-prone KL metrics looser, counts and extrema tight.
LOOSE_METRICS = frozenset({"gen_kl_error", "policy_kl_error", "js_divergence_error", "kl_penalty"})
TIGHT_METRICS = frozenset({"is_oob_ratio", "num_valid_samples"})


def import_reference(repo: Path) -> tuple[Any, Any, Any]:
    """``(ClippedPGLossConfig, ClippedPGLossFn, BatchedDataDict)`` from the checkout at ``repo``."""
    stubs = ["torch.utils.tensorboard"] if _missing("tensorboard") else []
    checkout.install_stubs(always=stubs, if_missing=UNUSED_PACKAGES)
    checkout.use_checkout(repo, "nemo_rl")
    # NeMo-RL is not an installed package (hence the ignores): use_checkout has put the checkout on sys.path.
    from nemo_rl.algorithms.loss.loss_functions import (  # type: ignore[import-not-found]
        ClippedPGLossConfig,
        ClippedPGLossFn,
    )
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict  # type: ignore[import-not-found]

    return ClippedPGLossConfig, ClippedPGLossFn, BatchedDataDict


def _missing(package: str) -> bool:
    return importlib.util.find_spec(package) is None


def make_regenerate(repo: Path):
    config_cls, loss_cls, batch_cls = import_reference(repo)

    def regenerate(case: dict) -> dict:
        try:
            fn = loss_cls(config_cls(**case["config"]))
        except (AssertionError, ValueError) as exc:
            return {"error": common.error_name(exc), "message": str(exc), "stage": "init"}
        inputs = case["inputs"]
        leaves = {k: inputs[k].clone().requires_grad_(True) for k in DIFFERENTIABLE_INPUTS if k in inputs}
        data = batch_cls({k: leaves.get(k, v) for k, v in inputs.items() if k != "next_token_logprobs"})
        try:
            loss, metrics = fn(
                next_token_logprobs=leaves["next_token_logprobs"],
                data=data,
                global_valid_seqs=case["global_valid_seqs"],
                global_valid_toks=case["global_valid_toks"],
            )
        except (AssertionError, ValueError) as exc:
            return {"error": common.error_name(exc), "message": str(exc), "stage": "call"}
        grads: Sequence[torch.Tensor | None] = [None] * len(leaves)
        if loss.requires_grad:
            grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
        expected: dict[str, Any] = {"loss": loss.detach(), "metrics": common.to_metrics(metrics)}
        for (name, leaf), grad in zip(leaves.items(), grads):
            expected[f"grad_{name}"] = torch.zeros_like(leaf) if grad is None else grad
        return expected

    return regenerate


def redraw(case: dict, generator: torch.Generator, seed: int, template: str) -> dict:
    """New inputs on a case's config, masks, ids and global counts: previous log-probs -|N(0,1)|, generation /
    reference / current ones those plus N(0, 0.1^2) / N(0, 0.2^2) / N(0, 0.1^2), one N(0,1) advantage per sample,
    N(0,1) rewards, unfiltered log-probs below the current ones. Column 0 (junk NeMo-RL slices off) and non-finite
    entries (a template's -inf) keep the template's values."""
    inputs = case["inputs"]
    batch, seq = inputs["token_mask"].shape
    prev = common.log_probs((batch, seq), generator)
    drawn = {
        "prev_logprobs": prev,
        "generation_logprobs": prev + common.normal((batch, seq), generator, 0.1),
        "reference_policy_logprobs": prev + common.normal((batch, seq), generator, 0.2),
        "advantages": common.normal((batch, 1), generator).expand(batch, seq),
        "next_token_logprobs": prev[:, 1:] + common.normal((batch, seq - 1), generator, 0.1),
    }
    if "curr_logprobs_unfiltered" in inputs:
        noise = common.normal((batch, seq - 1), generator, 0.05).abs()
        drawn["curr_logprobs_unfiltered"] = drawn["next_token_logprobs"] - noise
    if "rewards" in inputs:
        drawn["rewards"] = common.normal((batch,), generator)
    for name, values in drawn.items():
        old = inputs[name]
        values = values.clone()
        if values.dim() == 2 and values.shape[1] == seq:
            values[:, 0] = old[:, 0]
        inputs[name] = torch.where(torch.isfinite(old), values, old).to(old.dtype)
    case["notes"] = []  # a template's notes quote its own expected values
    case["description"] = f"fresh inputs (seed {seed}) on {template}'s config and masks: {case['description']}"
    return case


def metric_tolerance(name: str) -> common.Tolerance:
    """The suite README's (rtol, atol) of the metric ``name``; the one rule of the NeMo-RL suites, which the tests
    (tests/helpers/golden_utils.py) apply to the plugin's metrics too."""
    if name in TIGHT_METRICS or name.endswith("_min") or name.endswith("_max"):
        return 1e-6, 0.0
    if name in LOOSE_METRICS:
        return 1e-3, 1e-6
    return 1e-4, 1e-6


def tolerance(case: dict, path: tuple[str, ...]) -> common.Tolerance:
    """Metrics by name (:func:`metric_tolerance`); the loss and gradients rtol 1e-4, atol 1e-6."""
    return metric_tolerance(path[1]) if path[:1] == ("metrics",) else (1e-4, 1e-6)


SUITE = common.Suite(
    "nemo_rl", "NVIDIA-NeMo/RL", "7ea279abfbeb698b092856d0dab61e7cf39bc909", make_regenerate, tolerance, redraw
)


def main(argv: Sequence[str] | None = None) -> int:
    return common.run(SUITE, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
