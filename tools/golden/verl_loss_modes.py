"""Regenerate the verl policy-loss golden suite (tests/data/golden/verl_loss_modes) from verl 0.9.1.

    python -m tools.golden.verl_loss_modes --installed --out /tmp/verl_loss_modes [--check]
    python -m tools.golden.verl_loss_modes --repo /path/to/verl --out /tmp/verl_loss_modes [--check]

The suite was written from the verl 0.9.1 release installed from the package registry, not from a checkout: the wheel
names no commit, so the suite records the release tag, verl-project/verl v0.9.1 (suite README). ``--installed``
imports the installed ``verl`` and refuses any version but 0.9.1; ``--repo`` imports a checkout instead (the tag v0.9.1
reproduces the suite; another commit is compared with it, e.g. v0.9.0, whose ``compute_policy_loss_gspo`` always
aggregates with ``seq-mean-token-mean`` where 0.9.1 honours ``loss_agg_mode``).

Each committed case stores the loss mode, the aggregation, the config fields verl's policy losses read and the inputs.
This builds a real ``verl.workers.config.ActorConfig`` holding those fields (gspo / sapo / cispo assert its type; it is
checked to hold exactly the stored values), looks the loss up in verl's registry (``get_policy_loss_fn(mode)``, as
verl's actor does) and calls it in float32 on CPU with ``log_prob`` a leaf that requires grad, writing
``expected = {loss, grad_log_prob, metrics}``. Nothing is stubbed: verl 0.9.1 imports with the environment's packages.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tools.golden import checkout, common

RELEASE = "0.9.1"
# The ActorConfig fields that verl's checks need and the losses never read (one process, the original generator's).
ACTOR_SETUP = {"strategy": "fsdp", "rollout_n": 1, "ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 1}
# --fresh inputs: old probabilities U(0.05, 0.95), log-prob steps N(0, 0.6^2) (beyond the clip ranges and thresholds).
OLD_PROB_LOW, OLD_PROB_SPAN, STEP_STD = 0.05, 0.9, 0.6


def config_record(cfg: Any) -> dict:
    """The fields of an ``ActorConfig`` that verl's policy losses read, as plain values (each case's ``config``)."""
    return {
        "clip_ratio": float(cfg.clip_ratio),
        "clip_ratio_low": float(cfg.clip_ratio_low),
        "clip_ratio_high": float(cfg.clip_ratio_high),
        "clip_ratio_c": float(cfg.clip_ratio_c),
        "tau_pos": float(cfg.tau_pos),
        "tau_neg": float(cfg.tau_neg),
        "dro_beta": None if cfg.policy_loss.dro_beta is None else float(cfg.policy_loss.dro_beta),
        "global_batch_info": dict(cfg.global_batch_info),
    }


def _regenerate_with_imported_verl() -> common.Regenerate:
    """``regenerate`` calling the ``verl`` imported now (the checkout's or the installed one)."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers.config import ActorConfig, PolicyLossConfig

    def actor_config(case: dict) -> Any:
        stored = case["config"]
        fields = {k: v for k, v in stored.items() if k not in ("dro_beta", "global_batch_info")}
        cfg = ActorConfig(
            **ACTOR_SETUP,
            policy_loss=PolicyLossConfig(loss_mode=case["mode"], dro_beta=stored["dro_beta"]),
            global_batch_info=dict(stored["global_batch_info"]),
            **fields,
        )
        if config_record(cfg) != stored:
            raise SystemExit(f"{case['description']!r}: verl's ActorConfig holds {config_record(cfg)}, not {stored}")
        return cfg

    def regenerate(case: dict) -> dict:
        inputs = case["inputs"]
        log_prob = inputs["log_prob"].clone().requires_grad_(True)
        loss, metrics = get_policy_loss_fn(case["mode"])(
            old_log_prob=inputs["old_log_prob"],
            log_prob=log_prob,
            advantages=inputs["advantages"],
            response_mask=inputs["response_mask"],
            loss_agg_mode=case["loss_agg_mode"],
            config=actor_config(case),
        )
        (grad,) = torch.autograd.grad(loss, log_prob)
        return {"loss": loss.detach(), "grad_log_prob": grad, "metrics": common.to_metrics(metrics)}

    return regenerate


def make_regenerate(repo: Path) -> common.Regenerate:
    checkout.use_checkout(repo, "verl")
    return _regenerate_with_imported_verl()


def make_regenerate_installed() -> common.Regenerate:
    import verl

    if verl.__version__ != RELEASE:
        raise SystemExit(f"the installed verl is {verl.__version__}, the suite records {RELEASE}: pass --repo instead")
    return _regenerate_with_imported_verl()


def tolerance(case: dict, path: tuple[str, ...]) -> common.Tolerance:
    """Suite README, "Tolerances": loss and metrics rtol 1e-5 / atol 1e-6, gradient rtol 1e-5 / atol 1e-7."""
    return (1e-5, 1e-7) if path[:1] == ("grad_log_prob",) else (1e-5, 1e-6)


def redraw(case: dict, generator: torch.Generator, seed: int, template: str) -> dict:
    """New inputs on a case's mode, aggregation, config and response mask: old probabilities U(0.05, 0.95), current
    log-probs the old ones plus N(0, 0.6^2) (kept below -1e-3, a probability below 1), advantages N(0, 1) per sequence
    or per token as the template's ``params.advantages`` says, zero on masked tokens."""
    inputs, params = case["inputs"], case["params"]
    mask = inputs["response_mask"]
    old = torch.log(OLD_PROB_LOW + OLD_PROB_SPAN * torch.rand(mask.shape, generator=generator))
    inputs["old_log_prob"] = old
    inputs["log_prob"] = (old + common.normal(mask.shape, generator, STEP_STD)).clamp(max=-1e-3)
    if params["advantages"] == "seq":
        advantages = common.normal((mask.shape[0], 1), generator).expand(mask.shape)
    else:
        advantages = common.normal(mask.shape, generator)
    inputs["advantages"] = advantages * mask
    params["seed"], params["generator"] = seed, {"fresh_from": template}
    case["description"] = f"fresh inputs (seed {seed}) on {template}'s config and mask: {case['description']}"
    return case


SUITE = common.Suite(
    "verl_loss_modes",
    "verl-project/verl",
    f"v{RELEASE}",
    make_regenerate,
    tolerance,
    redraw,
    make_regenerate_installed=make_regenerate_installed,
)


def main(argv: Sequence[str] | None = None) -> int:
    return common.run(SUITE, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
