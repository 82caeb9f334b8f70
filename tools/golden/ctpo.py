"""Regenerate the CTPO cumulative-token loss golden suite (tests/data/golden/ctpo) from a CTPO checkout.

    python -m tools.golden.ctpo --repo /path/to/horizon-llm/CTPO --out /tmp/ctpo [--check]

CTPO (horizon-llm/CTPO, a verl fork; the suite records commit acc40211dbeaa8cb37c2347a8b7ad64192b635c4) registers its
four cum-token losses in ``verl/trainer/ppo/core_algos.py``. Each committed case stores the loss mode, aggregation,
the config fields the loss reads and the inputs; this looks the loss up in the checkout's own registry
(``get_policy_loss_fn(loss_mode)``, as verl's actor does) and calls it in float32 on CPU with ``log_prob`` a leaf
that requires grad, writing ``expected = {pg_loss, metrics, grad_log_prob}``, or ``{error: {raises, message}}``.

The config is a stand-in: an ``ActorConfig`` instance (the loss asserts the type) created without running its
constructor, holding only the stored fields (``global_batch_info = {}``: one data-parallel rank, local batch sizes).
Cases with ``p0_workaround`` store ``clip_ratio_la_power = 1e-30`` in place of the 0.0 that crashes the reference
(suite README, "Reference behaviour that looks like a bug"); the ``pg_update/la_*`` metrics that only the p != 0
branch emits are dropped from them, as the suite documents.

The installed ``transformers`` cannot be imported by this verl fork (it names classes newer releases removed); the
loss never uses it, so it is replaced by an empty stub (tools/golden/checkout.py, ``install_stubs``). verl itself runs
from the checkout, unchanged, not from any verl installed in the environment.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tools.golden import checkout, common

LA_ONLY_METRICS = "pg_update/la_"  # prefix of the metrics only the p != 0 branch of the LA loss emits
COUNT_METRICS = ("/count", "valid_token_count", "neg_adv_token_count")


def make_regenerate(repo: Path):
    checkout.install_stubs(always=["transformers"])
    checkout.use_checkout(repo, "verl")
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers.config import ActorConfig

    def stand_in_config(fields: dict) -> Any:
        config = ActorConfig.__new__(ActorConfig)
        for name, value in fields.items():
            setattr(config, name, value)
        return config

    def regenerate(case: dict) -> dict:
        params, inputs = case["params"], case["inputs"]
        log_prob = inputs["log_prob"].clone().requires_grad_(True)
        try:
            pg_loss, metrics = get_policy_loss_fn(params["loss_mode"])(
                old_log_prob=inputs["old_log_prob"],
                log_prob=log_prob,
                advantages=inputs["advantages"],
                response_mask=inputs["response_mask"],
                loss_agg_mode=params["loss_agg_mode"],
                config=stand_in_config(params["config"]),
                rollout_is_weights=inputs["rollout_is_weights"],
            )
        except (TypeError, ValueError, AssertionError) as exc:
            return {"error": {"raises": common.error_name(exc), "message": str(exc)}}
        (grad,) = torch.autograd.grad(pg_loss, [log_prob], allow_unused=True) if pg_loss.requires_grad else (None,)
        metrics = common.to_metrics(metrics)
        if params.get("p0_workaround"):
            metrics = {k: v for k, v in metrics.items() if not k.startswith(LA_ONLY_METRICS)}
        return {
            "pg_loss": pg_loss.detach(),
            "metrics": metrics,
            "grad_log_prob": torch.zeros_like(log_prob) if grad is None else grad,
        }

    return regenerate


def redraw(case: dict, generator: torch.Generator, seed: int, template: str) -> dict:
    """New inputs on a case's config and response mask: log-probs -|N(0,1)| with a N(0, 0.05^2) policy change,
    one N(0,1) advantage per row (0 at masked tokens), token IS weights exp(N(0, 0.1^2)) where the case has weights."""
    inputs, params = case["inputs"], case["params"]
    mask = inputs["response_mask"]
    old = common.log_probs(mask.shape, generator)
    inputs["old_log_prob"] = old
    inputs["log_prob"] = old + common.normal(mask.shape, generator, 0.05)
    inputs["advantages"] = common.normal((mask.shape[0], 1), generator) * mask
    if inputs["rollout_is_weights"] is not None:
        inputs["rollout_is_weights"] = torch.exp(common.normal(mask.shape, generator, 0.1)) * mask
    params["seed"], params["generator"] = seed, {"fresh_from": template}
    case["description"] = f"fresh inputs (seed {seed}) on {template}'s config and mask: {case['description']}"
    return case


def tolerance(case: dict, path: tuple[str, ...]) -> common.Tolerance:
    """Suite README, "Tolerances": counts exact; loss and gradient rtol 1e-4 for T = 2048 (long float32 prefix sums)."""
    if path[:1] == ("metrics",):
        return (0.0, 0.0) if path[1].endswith(COUNT_METRICS) else (1e-5, 1e-6)
    return (1e-4 if case["params"]["T"] >= 2048 else 1e-5), 1e-6


SUITE = common.Suite(
    "ctpo", "horizon-llm/CTPO", "acc40211dbeaa8cb37c2347a8b7ad64192b635c4", make_regenerate, tolerance, redraw
)


def main(argv: Sequence[str] | None = None) -> int:
    return common.run(SUITE, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
