"""Golden cases of verl's policy losses (``actor_rollout_ref.actor.policy_loss.loss_mode``), written from the
INSTALLED verl: each case calls ``verl.trainer.ppo.core_algos.get_policy_loss_fn(mode)`` on deterministic float32
inputs and stores the inputs, the config fields the function reads, the loss, its gradient w.r.t. ``log_prob`` and
the metrics verl returns.

    python -m tools.golden.verl_loss_modes --out tests/data/golden/verl_loss_modes

Inputs: ragged response masks (full rows, short rows, one interior zero), several lengths, advantages of both signs
(per sequence, and per token in some cases), and current log-probs moved far enough from the old ones to cross every
threshold (ratios beyond the clip range and the dual-clip / truncation cap, probability changes beyond the DPPO
thresholds). The config is a real ``verl.workers.config.ActorConfig`` (gspo / sapo / cispo assert its type); the
fields that matter are stored with each case. Files are ``torch.save`` of plain dicts and tensors, loadable with
``torch.load(path, weights_only=True)``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

# (mode, loss_agg_mode, config overrides, advantage kind, shape (B, T), seed, description)
CASES: list[tuple[str, str, dict, str, tuple[int, int], int, str]] = [
    (
        "vanilla",
        "token-mean",
        {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0},
        "seq",
        (4, 8),
        1,
        "PPO clip with dual clip, token mean",
    ),
    (
        "vanilla",
        "seq-mean-token-mean",
        {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 2.0},
        "token",
        (3, 12),
        2,
        "PPO clip, per-token advantages, sequence mean",
    ),
    (
        "gspo",
        "seq-mean-token-mean",
        {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4},
        "seq",
        (4, 8),
        3,
        "GSPO-token sequence ratio, GSPO's clip widths",
    ),
    (
        "gspo",
        "token-mean",
        {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28},
        "seq",
        (3, 12),
        4,
        "GSPO-token sequence ratio, token mean",
    ),
    (
        "cispo",
        "token-mean",
        {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28},
        "seq",
        (4, 8),
        5,
        "CISPO clipped detached weight",
    ),
    (
        "cispo",
        "seq-mean-token-sum",
        {"clip_ratio_low": 1.0, "clip_ratio_high": 4.0},
        "token",
        (3, 12),
        6,
        "CISPO with MiniMax-style wide bounds, sequence sum",
    ),
    (
        "dppo_tv",
        "token-mean",
        {"clip_ratio_low": 0.15, "clip_ratio_high": 0.2, "clip_ratio_c": 20.0},
        "seq",
        (4, 8),
        7,
        "DPPO Binary-TV, cap 20 (verl's dict-config default)",
    ),
    (
        "dppo_tv",
        "seq-mean-token-mean",
        {"clip_ratio_low": 0.1, "clip_ratio_high": 0.1, "clip_ratio_c": 3.0},
        "token",
        (3, 12),
        8,
        "DPPO Binary-TV, cap 3 (the ActorConfig default clip_ratio_c), per-token advantages",
    ),
    (
        "dppo_kl",
        "token-mean",
        {"clip_ratio_low": 0.05, "clip_ratio_high": 0.05, "clip_ratio_c": 20.0},
        "seq",
        (4, 8),
        9,
        "DPPO Binary-KL, cap 20",
    ),
    (
        "dppo_kl",
        "seq-mean-token-sum-norm",
        {"clip_ratio_low": 0.02, "clip_ratio_high": 0.08, "clip_ratio_c": 3.0},
        "token",
        (3, 12),
        10,
        "DPPO Binary-KL, asymmetric thresholds, sum-norm by the horizon",
    ),
    ("sapo", "seq-mean-token-mean", {"tau_pos": 1.0, "tau_neg": 1.05}, "seq", (4, 8), 11, "SAPO, default temperatures"),
    (
        "sapo",
        "token-mean",
        {"tau_pos": 2.0, "tau_neg": 3.0},
        "token",
        (3, 12),
        12,
        "SAPO, token-mean requested (verl forces seq-mean-token-mean)",
    ),
    (
        "geo_mean",
        "token-mean",
        {"clip_ratio_low": 0.4, "clip_ratio_high": 0.4},
        "seq",
        (4, 8),
        13,
        "GMPO, log-space clip 0.4 (loss_agg_mode ignored)",
    ),
    (
        "geo_mean",
        "token-mean",
        {"clip_ratio_low": 0.2, "clip_ratio_high": 0.3},
        "token",
        (3, 12),
        14,
        "GMPO, per-token advantages (zero advantages included)",
    ),
    ("gpg", "token-mean", {}, "seq", (4, 8), 15, "GPG, token mean"),
    ("gpg", "seq-mean-token-sum", {}, "token", (3, 12), 16, "GPG, sequence sum"),
    ("dro", "token-mean", {"dro_beta": 0.1}, "seq", (4, 8), 17, "DRO quadratic penalty"),
]

METRIC_PREFIX = "actor/"


def _inputs(kind: str, shape: tuple[int, int], seed: int) -> dict[str, torch.Tensor]:
    B, T = shape
    g = torch.Generator().manual_seed(seed)
    lengths = [T, T - 2, 3, 1, T - 1][:B]
    mask = torch.zeros(B, T)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1.0
    mask[0, 2] = 0.0  # an interior masked token (tool output)
    old_prob = 0.05 + 0.9 * torch.rand(B, T, generator=g)
    old = torch.log(old_prob)
    step = 0.6 * torch.randn(B, T, generator=g)
    step[0, 1], step[1, 0] = 1.5, -2.0  # ratios e^1.5 (beyond every cap but 20) and e^-2
    old[1, 1], step[1, 1] = math.log(0.02), 3.4  # ratio e^3.4 = 30: beyond the DPPO cap 20, probability 0.02 -> 0.6
    # Cannot exceed probability 1: the current log-prob stays <= log(0.999).
    curr = torch.minimum(old + step, torch.full_like(old, -1e-3))
    if kind == "seq":
        adv = torch.tensor([1.0, -0.7, 0.4, -1.3, 0.9][:B]).unsqueeze(1).expand(B, T).clone()
    else:
        adv = torch.randn(B, T, generator=g)
        adv[B - 1, 0] = 0.0
    return {"old_log_prob": old, "log_prob": curr, "advantages": adv * mask, "response_mask": mask}


def _actor_config(mode: str, overrides: dict):
    from verl.workers.config import ActorConfig, PolicyLossConfig

    fields = dict(overrides)
    policy = PolicyLossConfig(loss_mode=mode, dro_beta=fields.pop("dro_beta", None))
    fields.setdefault("clip_ratio", 0.2)
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_gpu=1,
        policy_loss=policy,
        **fields,
    )


def _config_record(cfg) -> dict:
    """The fields verl's policy losses read, as plain values."""
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


def build_case(index: int) -> dict:
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    mode, agg, overrides, kind, shape, seed, description = CASES[index]
    inputs = _inputs(kind, shape, seed)
    cfg = _actor_config(mode, overrides)
    log_prob = inputs["log_prob"].clone().requires_grad_(True)
    loss, metrics = get_policy_loss_fn(mode)(
        old_log_prob=inputs["old_log_prob"],
        log_prob=log_prob,
        advantages=inputs["advantages"],
        response_mask=inputs["response_mask"],
        loss_agg_mode=agg,
        config=cfg,
    )
    (grad,) = torch.autograd.grad(loss, log_prob)
    return {
        "mode": mode,
        "loss_agg_mode": agg,
        "config": _config_record(cfg),
        "inputs": inputs,
        "expected": {
            "loss": loss.detach(),
            "grad_log_prob": grad,
            "metrics": {k: float(v) for k, v in metrics.items()},
        },
        "params": {"seed": seed, "shape": list(shape), "advantages": kind, "dtype": "float32", "device": "cpu"},
        "description": description,
    }


def _readme(verl_version: str, torch_version: str) -> str:
    modes = sorted({c[0] for c in CASES})
    return f"""# Golden vectors: verl policy losses (loss_mode)

Written by `python -m tools.golden.verl_loss_modes --out tests/data/golden/verl_loss_modes` from the installed
verl {verl_version} (torch {torch_version}, CPU, float32): `verl.trainer.ppo.core_algos.get_policy_loss_fn(mode)` for
{", ".join(f"`{m}`" for m in modes)}, i.e. `compute_policy_loss_vanilla`, `_gspo`, `_cispo`, `_dppo_tv`, `_dppo_kl`,
`_sapo`, `_geo_mean`, `_gpg`, `_dro` of `verl/trainer/ppo/core_algos.py`, with `agg_loss` for the aggregation.
The config is a real `verl.workers.config.ActorConfig` (strategy fsdp, empty `global_batch_info`: one process).

## File format
`case_XXX.pt`, `torch.load(path, weights_only=True)`:
- `mode`, `loss_agg_mode` (what was passed; sapo forces `seq-mean-token-mean`, geo_mean ignores it)
- `config`: `clip_ratio`, `clip_ratio_low`, `clip_ratio_high`, `clip_ratio_c`, `tau_pos`, `tau_neg`, `dro_beta`,
  `global_batch_info`
- `inputs`: `old_log_prob`, `log_prob`, `advantages`, `response_mask` (float32 `[B, T]`; ragged rows, one interior
  masked token, advantages zero on masked tokens)
- `expected`: `loss` (0-d), `grad_log_prob` (`[B, T]`, d loss / d log_prob), `metrics` (dict str -> float, verl's
  `actor/pg_clipfrac`, `actor/ppo_kl`, `actor/pg_clipfrac_lower` where the mode returns them)
- `params`: `seed`, `shape`, `advantages` (`seq`: one value per sequence, `token`: per token), dtype, device
- `description`: one line

Note: verl's DPPO losses read `config.get("clip_ratio_c", 20.0)`; an `ActorConfig` always has `clip_ratio_c`
(default 3.0), so the 20 applies only to a plain dict config without the key. The cases set it explicitly.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output folder (created)")
    args = parser.parse_args(argv)
    import verl

    torch.use_deterministic_algorithms(True)
    args.out.mkdir(parents=True, exist_ok=True)
    for i in range(len(CASES)):
        torch.save(build_case(i), args.out / f"case_{i:03d}.pt")
    (args.out / "README.md").write_text(_readme(verl.__version__, torch.__version__.split("+")[0]))
    print(f"wrote {len(CASES)} cases to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
