"""Golden cases of the slime adapter, computed by slime's own loss code (THUDM/slime, commit 624b824a).

    python -m tools.golden.slime --repo PATH/TO/slime --out tests/data/golden/slime

slime is not on the package registry, so its loss module is imported from a checkout (``--repo``) with stubs for what
a single CPU process does not need: megatron-core's ``mpu`` (one rank: no CP, TP or DP), the package ``__init__`` of
``slime.backends.megatron_utils`` (Megatron patches and accelerator set-up; the ``loss`` and ``cp_utils`` submodules
load from their files), and ``torch.compile`` (an identity while slime's modules import: the same math, eagerly).
Nothing of slime is copied: its functions are called.

Two suites, one ``case_NNN.pt`` each (``torch.load(..., weights_only=True)``):

- ``tis``: slime's ``vanilla_tis_function`` / ``icepop_function`` on per-token ``pg_loss`` and per-sample log-probs
  -> the returned ``pg_loss``, masks and per-token metrics;
- ``policy``: slime's ``loss_function`` (``--loss-type policy_loss``) on a micro-batch in slime's format and float32
  logits ``[1, T, V]`` -> the rescaled loss, the metrics (name -> value) and the gradient of the loss w.r.t. the logits.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import torch

COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"
VOCAB = 11

# slime's loss flags at their slime defaults (slime/utils/arguments.py); each case overrides some.
DEFAULT_ARGS: dict[str, Any] = {
    "loss_type": "policy_loss",
    "advantage_estimator": "grpo",
    "eps_clip": 0.2,
    "eps_clip_high": 0.2,
    "eps_clip_c": None,
    "use_kl_loss": False,
    "kl_loss_coef": 0.0,
    "kl_loss_type": "k1",
    "use_unbiased_kl": False,
    "entropy_coef": 0.0,
    "use_tis": False,
    "get_mismatch_metrics": False,
    "tis_clip": 2.0,
    "tis_clip_low": 0.0,
    "custom_tis_function_path": None,
    "custom_pg_loss_reducer_function_path": None,
    "use_rollout_logprobs": False,
    "use_opsm": False,
    "calculate_per_token_loss": False,
    "recompute_loss_function": False,
    "allgather_cp": False,
    "rollout_temperature": 1.0,
    "rollout_top_p": 1.0,
    "log_probs_chunk_size": -1,
}
ICEPOP = "slime.backends.megatron_utils.loss.icepop_function"

POLICY_CASES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("grpo_defaults", {}, {}),
    ("clip_higher_dual_clip_entropy", {"eps_clip_high": 0.28, "eps_clip_c": 3.0, "entropy_coef": 0.01}, {}),
    ("vanilla_tis", {"use_tis": True}, {}),
    ("vanilla_tis_low_bound", {"use_tis": True, "tis_clip": 1.5, "tis_clip_low": 0.8}, {}),
    ("icepop", {"use_tis": True, "custom_tis_function_path": ICEPOP, "tis_clip_low": 0.5, "tis_clip": 2.0}, {}),
    ("mismatch_metrics_only", {"get_mismatch_metrics": True}, {}),
    ("gspo", {"advantage_estimator": "gspo", "eps_clip": 3e-4, "eps_clip_high": 4e-4}, {}),
    ("cispo", {"advantage_estimator": "cispo", "eps_clip": 1.0, "eps_clip_high": 0.3}, {}),
    ("kl_k1", {"use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "k1"}, {}),
    ("kl_k2", {"use_kl_loss": True, "kl_loss_coef": 0.05, "kl_loss_type": "k2"}, {}),
    (
        "kl_low_var_unbiased",
        {"use_kl_loss": True, "kl_loss_coef": 0.2, "kl_loss_type": "low_var_kl", "use_unbiased_kl": True},
        {},
    ),
    ("bypass_rollout_logprobs_tis", {"use_rollout_logprobs": True, "use_tis": True}, {}),
    ("per_token_loss", {"calculate_per_token_loss": True, "use_tis": True}, {}),
    ("temperature_chunked", {"rollout_temperature": 0.7, "log_probs_chunk_size": 3}, {}),
    ("on_policy_no_log_probs", {"entropy_coef": 0.02}, {"drop_log_probs": True}),
]
TIS_CASES: list[tuple[str, dict[str, Any]]] = [
    ("vanilla", {}),
    ("vanilla_bounds", {"tis_clip": 1.3, "tis_clip_low": 0.7}),
    ("icepop", {"tis_clip": 1.5, "tis_clip_low": 0.6, "function": "icepop_function"}),
]


def _mpu() -> types.ModuleType:
    """megatron-core's mpu for one process: no context, tensor or data parallelism."""
    mpu = types.ModuleType("megatron.core.mpu")
    one = {"get_context_parallel_world_size", "get_tensor_model_parallel_world_size", "get_data_parallel_world_size"}
    for name in one:
        setattr(mpu, name, lambda *a, **k: 1)
    for name in ("get_context_parallel_rank", "get_tensor_model_parallel_rank", "get_data_parallel_rank"):
        setattr(mpu, name, lambda *a, **k: 0)
    for name in ("get_context_parallel_group", "get_tensor_model_parallel_group", "get_data_parallel_group"):
        setattr(mpu, name, lambda *a, **k: None)
    mpu.is_pipeline_last_stage = lambda *a, **k: True
    return mpu


def load_slime(repo: Path) -> types.ModuleType:
    """slime's ``slime.backends.megatron_utils.loss`` imported from ``repo`` with the stubs of the module docstring."""
    megatron, core = types.ModuleType("megatron"), types.ModuleType("megatron.core")
    core.mpu = _mpu()
    megatron.core = core
    sys.modules.update({"megatron": megatron, "megatron.core": core, "megatron.core.mpu": core.mpu})
    package = types.ModuleType("slime.backends.megatron_utils")
    package.__path__ = [str(repo / "slime" / "backends" / "megatron_utils")]
    sys.path.insert(0, str(repo))
    import slime.backends

    sys.modules["slime.backends.megatron_utils"] = package
    compile_, torch.compile = torch.compile, (lambda fn=None, **kw: fn if fn is not None else (lambda f: f))
    try:
        spec = importlib.util.spec_from_file_location(
            "slime.backends.megatron_utils.loss", repo / "slime" / "backends" / "megatron_utils" / "loss.py"
        )
        assert spec is not None and spec.loader is not None
        loss = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = loss
        spec.loader.exec_module(loss)
    finally:
        torch.compile = compile_
    assert slime.backends is not None
    return loss


def make_batch(
    seed: int, *, drop_log_probs: bool = False, mismatch: float = 0.4
) -> tuple[dict[str, Any], torch.Tensor]:
    """A micro-batch in slime's format (per-sample lists) and its float32 logits ``[1, sum(total), V]``;
    ``mismatch``: the scale of the rollout log-probs' noise around ``log_probs``."""
    g = torch.Generator().manual_seed(seed)
    totals, responses = [9, 7, 12, 6], [5, 4, 8, 1]
    logits = torch.randn(1, sum(totals), VOCAB, generator=g) * 1.5
    tokens = [torch.randint(0, VOCAB, (t,), generator=g) for t in totals]
    current, start = [], 0
    for toks, total, resp in zip(tokens, totals, responses):
        lp = torch.log_softmax(logits[0, start + total - resp - 1 : start + total - 1], -1)
        current.append(lp.gather(-1, toks[-resp:, None])[:, 0])
        start += total

    def near(x: torch.Tensor, scale: float) -> torch.Tensor:
        return (x + scale * torch.randn(x.shape, generator=g)).clamp(max=-1e-3)

    masks = [(torch.rand(r, generator=g) > 0.2).float() for r in responses]
    masks[0][0] = 1.0
    masks[3][0] = 1.0
    log_probs = [near(c, 0.15) for c in current]
    batch: dict[str, Any] = {
        "unconcat_tokens": tokens,
        "total_lengths": totals,
        "response_lengths": responses,
        "loss_masks": masks,
        "advantages": [torch.randn(r, generator=g) for r in responses],
        "log_probs": [] if drop_log_probs else log_probs,
        "rollout_log_probs": [near(lp, mismatch) for lp in log_probs],
        "ref_log_probs": [near(c, 0.3) for c in current],
        # per-rollout denominators: samples 0-1 and 2-3 are one rollout group each
        "rollout_mask_sums": [
            torch.tensor(float(masks[0].sum() + masks[1].sum() + 3.0)),
            torch.tensor(float(masks[0].sum() + masks[1].sum() + 3.0)),
            torch.tensor(float(masks[2].sum() + masks[3].sum())),
            torch.tensor(float(masks[2].sum() + masks[3].sum())),
        ],
    }
    return batch, logits


def policy_case(loss_mod: types.ModuleType, name: str, flags: dict, options: dict, seed: int) -> dict[str, Any]:
    args = argparse.Namespace(**{**DEFAULT_ARGS, **flags})
    batch, logits = make_batch(seed, **options)
    x = logits.clone().requires_grad_(True)
    loss, _, log = loss_mod.loss_function(args, batch, 2, 8, x)
    loss.backward()
    metrics = {k: float(v) for k, v in zip(log["keys"], log["values"][1:].tolist())}
    return {
        "id": name,
        "description": f"slime loss_function, --loss-type policy_loss, flags {flags}",
        "args": {k: v for k, v in vars(args).items()},
        "batch": batch,
        "logits": logits,
        "num_microbatches": 2,
        "step_global_batch_size": 8,
        "loss": loss.detach(),
        "metrics": metrics,
        "logits_grad": x.grad,
    }


def tis_case(loss_mod: types.ModuleType, name: str, flags: dict, seed: int) -> dict[str, Any]:
    flags = dict(flags)
    function = flags.pop("function", "vanilla_tis_function")
    args = argparse.Namespace(**{**DEFAULT_ARGS, "use_tis": True, **flags})
    batch, _ = make_batch(seed, mismatch=0.8)
    g = torch.Generator().manual_seed(seed + 1000)
    pg_loss = torch.randn(sum(batch["response_lengths"]), generator=g, dtype=torch.float32)
    kwargs = {
        "pg_loss": pg_loss,
        "train_log_probs": batch["log_probs"],
        "rollout_log_probs": batch["rollout_log_probs"],
        "loss_masks": batch["loss_masks"],
        "total_lengths": batch["total_lengths"],
        "response_lengths": batch["response_lengths"],
    }
    out, masks, metrics = getattr(loss_mod, function)(args, **kwargs)
    return {
        "id": f"tis_{name}",
        "description": f"slime {function}, flags {flags}",
        "function": function,
        "args": dict(vars(args)),
        "inputs": kwargs,
        "pg_loss": out,
        "masks": masks,
        "metrics": metrics,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, required=True, help="a checkout of THUDM/slime at " + COMMIT[:8])
    parser.add_argument("--out", type=Path, default=Path("tests/data/golden/slime"))
    ns = parser.parse_args(argv)
    head = subprocess.run(["git", "-C", str(ns.repo), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0 and head.stdout.strip() != COMMIT:
        print(f"warning: {ns.repo} is at {head.stdout.strip()}, the goldens are defined at {COMMIT}", file=sys.stderr)
    loss_mod = load_slime(ns.repo.resolve())
    for suite in ("policy", "tis"):
        (ns.out / suite).mkdir(parents=True, exist_ok=True)
        for old in (ns.out / suite).glob("case_*.pt"):
            old.unlink()
    for i, (name, flags, options) in enumerate(POLICY_CASES):
        torch.save(policy_case(loss_mod, name, flags, options, seed=i), ns.out / "policy" / f"case_{i:03d}.pt")
    for i, (name, flags) in enumerate(TIS_CASES):
        torch.save(tis_case(loss_mod, name, flags, seed=100 + i), ns.out / "tis" / f"case_{i:03d}.pt")
    print(f"wrote {len(POLICY_CASES)} policy and {len(TIS_CASES)} tis cases to {ns.out}")


if __name__ == "__main__":
    main()
