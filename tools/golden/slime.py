"""Regenerate the slime golden suite (tests/data/golden/slime) from a slime checkout.

    python -m tools.golden.slime --repo /path/to/THUDM/slime --out /tmp/slime [--check]

The suite records THUDM/slime commit 624b824a898ab0ec1fcb4d373004c7f3852bf515. It has two parts, one directory each,
whose cases keep slime's outputs as top-level entries next to the stored call (suite README):

- ``policy/``: slime's ``loss_function(args, batch, num_microbatches, step_global_batch_size, logits)`` (``args``
  with ``--loss-type policy_loss``, ``batch`` in slime's per-sample format, float32 ``logits [1, T, V]`` a leaf that
  requires grad) -> ``loss`` (rescaled, as slime hands it to Megatron), ``metrics`` (name -> float) and
  ``logits_grad`` (d loss / d logits);
- ``tis/``: slime's ``vanilla_tis_function`` / ``icepop_function`` (``function``) on ``inputs`` (per-token
  ``pg_loss``, per-sample log-probs and loss masks, lengths) -> ``pg_loss``, ``masks`` and the per-token ``metrics``.

slime is not on the package registry: ``slime/backends/megatron_utils/loss.py`` is imported from the checkout with
stubs for what a single CPU process does not need: megatron-core's ``mpu`` (one rank: no CP, TP or DP; numbers, not
tools/golden/checkout.py's attribute stubs, since slime compares them), the package ``__init__`` of
``slime.backends.megatron_utils`` (Megatron patches and accelerator set-up; its ``loss`` and ``cp_utils`` submodules
load from their files), and ``torch.compile`` (an identity while slime's modules import: the same math, eagerly).
Nothing of slime is copied: its functions are called.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from tools.golden import checkout, common

PARTS = ("policy", "tis")
POLICY_OUTPUTS = ("loss", "metrics", "logits_grad")
TIS_OUTPUTS = ("pg_loss", "masks", "metrics")
# Noise scales of --fresh's log-probs around the current policy's (rollout: the training / rollout mismatch).
OLD_NOISE, REF_NOISE, POLICY_MISMATCH, TIS_MISMATCH = 0.15, 0.3, 0.4, 0.8


def _module(name: str, **attributes: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    return module


def _mpu() -> types.ModuleType:
    """megatron-core's mpu for one process: no context, tensor or data parallelism."""
    one_rank: dict[str, Any] = {"is_pipeline_last_stage": lambda *a, **k: True}
    for kind in ("context", "tensor_model", "data"):
        one_rank[f"get_{kind}_parallel_world_size"] = lambda *a, **k: 1
        one_rank[f"get_{kind}_parallel_rank"] = lambda *a, **k: 0
        one_rank[f"get_{kind}_parallel_group"] = lambda *a, **k: None
    return _module("megatron.core.mpu", **one_rank)


def _identity_compile(fn: Any = None, **kwargs: Any) -> Any:
    return fn if fn is not None else (lambda f: f)


def import_loss(repo: Path) -> types.ModuleType:
    """slime's ``slime.backends.megatron_utils.loss`` from the checkout at ``repo``, with the stubs of the module
    docstring."""
    mpu = _mpu()
    core = _module("megatron.core", mpu=mpu)
    sys.modules.update({"megatron": _module("megatron", core=core), "megatron.core": core, "megatron.core.mpu": mpu})
    checkout.use_checkout(repo, "slime")
    # The package without its __init__: its submodules are found in its directory of the checkout.
    package = types.ModuleType("slime.backends.megatron_utils")
    package.__path__ = [str(repo.resolve() / "slime" / "backends" / "megatron_utils")]
    sys.modules[package.__name__] = package
    with mock.patch.object(torch, "compile", _identity_compile):
        return importlib.import_module("slime.backends.megatron_utils.loss")


def make_regenerate(repo: Path) -> common.Regenerate:
    loss = import_loss(repo)

    def regenerate(case: dict) -> dict:
        args = argparse.Namespace(**case["args"])
        if "function" in case:  # tis/
            pg_loss, masks, metrics = getattr(loss, case["function"])(args, **copy.deepcopy(case["inputs"]))
            return {"pg_loss": pg_loss, "masks": masks, "metrics": metrics}
        logits = case["logits"].clone().requires_grad_(True)
        scaled, _, log = loss.loss_function(
            args, copy.deepcopy(case["batch"]), case["num_microbatches"], case["step_global_batch_size"], logits
        )
        scaled.backward()
        metrics = {str(k): float(v) for k, v in zip(log["keys"], log["values"][1:].tolist())}  # values[0]: a count
        return {"loss": scaled.detach(), "metrics": metrics, "logits_grad": logits.grad}

    return regenerate


def tolerance(case: dict, path: tuple[str, ...]) -> common.Tolerance:
    """Suite README, "Tolerances" (paths from the case's top: the stored call must match exactly): loss and metrics
    rtol 1e-5 / atol 1e-6, logit gradients rtol 1e-4 / atol 1e-6; the TIS functions' outputs to 1 ulp, masks exact."""
    outputs = TIS_OUTPUTS if "function" in case else POLICY_OUTPUTS
    if path[0] not in outputs or path[0] == "masks":
        return 0.0, 0.0
    if "function" in case:
        return 1.2e-7, 0.0
    return (1e-4, 1e-6) if path[0] == "logits_grad" else (1e-5, 1e-6)


def _near(x: torch.Tensor, scale: float, generator: torch.Generator) -> torch.Tensor:
    """Log-probs ``x`` plus N(0, scale^2) noise, kept below -1e-3."""
    return (x + common.normal(x.shape, generator, scale)).clamp(max=-1e-3)


def redraw(case: dict, generator: torch.Generator, seed: int, template: str) -> dict:
    """New inputs on a case's args, lengths and loss masks (and denominators). policy/: logits N(0, 1.5^2), tokens
    uniform, ``log_probs`` / ``ref_log_probs`` the logits' own log-probs plus N(0, 0.15^2) / N(0, 0.3^2) (none where the
    template has none), ``rollout_log_probs`` those plus N(0, 0.4^2), N(0,1) advantages. tis/: ``pg_loss`` N(0,1),
    train log-probs -|N(0,1)|, rollout ones those plus N(0, 0.8^2), so the truncation bounds are hit."""
    if "function" in case:
        inputs = case["inputs"]
        train = [common.log_probs((n,), generator) for n in inputs["response_lengths"]]
        inputs["train_log_probs"] = train
        inputs["rollout_log_probs"] = [_near(lp, TIS_MISMATCH, generator) for lp in train]
        inputs["pg_loss"] = common.normal((sum(inputs["response_lengths"]),), generator)
    else:
        batch = case["batch"]
        totals, responses = batch["total_lengths"], batch["response_lengths"]
        vocab = case["logits"].shape[-1]
        logits = common.normal((1, sum(totals), vocab), generator, 1.5)
        tokens = [torch.randint(0, vocab, (t,), generator=generator) for t in totals]
        current, start = [], 0
        for toks, total, resp in zip(tokens, totals, responses):  # the log-prob of token t sits at logit t - 1
            lp = torch.log_softmax(logits[0, start + total - resp - 1 : start + total - 1], -1)
            current.append(lp.gather(-1, toks[-resp:, None])[:, 0])
            start += total
        old = [_near(c, OLD_NOISE, generator) for c in current]
        batch.update(
            unconcat_tokens=tokens,
            advantages=[common.normal((r,), generator) for r in responses],
            log_probs=old if batch["log_probs"] else [],
            rollout_log_probs=[_near(lp, POLICY_MISMATCH, generator) for lp in old],
            ref_log_probs=[_near(c, REF_NOISE, generator) for c in current],
        )
        case["logits"] = logits
    case["description"] = f"fresh inputs (seed {seed}) on {template}'s args and masks: {case['description']}"
    return case


SUITE = common.Suite(
    "slime",
    "THUDM/slime",
    "624b824a898ab0ec1fcb4d373004c7f3852bf515",
    make_regenerate,
    tolerance,
    redraw,
    outputs=None,
    parts=PARTS,
)


def main(argv: Sequence[str] | None = None) -> int:
    return common.run(SUITE, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
