"""Run by test_clean_install.py with the interpreter of a virtual environment that holds torch and `pip install .`
of the plugin, nothing else (no megatron-core, no app stack, no verl): reports, as one JSON object on stdout, what is
installed, which of the plugin's modules import, the loss, the kernels' log-probs and the verl adapter's loss next to
float64 references written here in plain torch, and the one-line errors of what needs an extra (the apps,
megatron-core's groups)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
import traceback
from pathlib import Path

import torch

# The top-level modules of the extras (megatron-core's included): none may be installed by the plugin's own
# dependencies.
EXTRA_MODULES = ("ray", "matplotlib", "typer", "rich", "pyarrow", "megatron")
# Modules only optional paths import (inside the commands and adapters that need them).
OPTIONAL_MODULES = {*EXTRA_MODULES, "click", "verl", "vllm", "triton", "liger_kernel", "cut_cross_entropy"}
# What a trainer imports: the loss, the kernels, the distributed entry points, the host adapters (verl's without verl
# installed: its modules import verl where they call it) and recipes.
CORE_MODULES = (
    "nemo_is_plugin",
    "nemo_is_plugin.recipes",
    "nemo_is_plugin.kernels.chunk_math",
    "nemo_is_plugin.adapters.nemo_rl.loss_fn",
    "nemo_is_plugin.adapters.verl",
    "nemo_is_plugin.adapters.verl.head",
    "nemo_is_plugin.adapters.verl.fsdp_head",
    "nemo_is_plugin.adapters.slime",
    "nemo_is_plugin.distributed.entry_points.logit_loss",
    "nemo_is_plugin.distributed.head.fused_linear",
    "nemo_is_plugin.distributed.entry_points.fused_linear_loss",
)
# Each app and the extra it imports with.
APP_EXTRAS = {"cli": "cli", "compat": "cli", "demo": "demo", "diagnose": "cli", "evidence": "cli", "bench": "cli"}
CONFIGS = {
    "ppo": {"reference_policy_kl_penalty": 0.0, "ratio_clip_min": 0.2, "ratio_clip_max": 0.2},
    "token_tis": {
        "reference_policy_kl_penalty": 0.0,
        "ratio_clip_min": 0.2,
        "ratio_clip_max": 0.2,
        "use_importance_sampling_correction": True,
        "is_correction_level": "token",
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 1.05,
    },
}


def missing_optional(exc: BaseException) -> str | None:
    """The optional module whose absence raised ``exc`` (or an exception it was raised from), else None."""
    while exc is not None:
        if isinstance(exc, ModuleNotFoundError) and exc.name and exc.name.split(".")[0] in OPTIONAL_MODULES:
            return exc.name.split(".")[0]
        exc = exc.__cause__ or exc.__context__
    return None


def import_every_module() -> dict[str, str]:
    """Import every module of the installed package; the modules that fail, with why."""
    import nemo_is_plugin

    root = Path(nemo_is_plugin.__file__).parent
    failures = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - every failure is reported and judged by the test
            optional = missing_optional(exc)
            failures[name] = f"optional:{optional}" if optional else "".join(traceback.format_exception(exc))[-2000:]
    return failures


def batch(B: int = 3, S: int = 9) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A float64 NeMo-RL batch ([B, S] tensors, sample_mask [B]); response tokens from position 2 on."""
    g = torch.Generator().manual_seed(0)
    prev = -torch.rand(B, S, generator=g, dtype=torch.float64) * 2.0 - 0.05
    data = {
        "prev_logprobs": prev,
        "generation_logprobs": prev - 0.05 * torch.randn(B, S, generator=g, dtype=torch.float64),
        "reference_policy_logprobs": prev.clone(),
        "advantages": torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, S).contiguous(),
        "token_mask": torch.ones(B, S, dtype=torch.float64),
        "sample_mask": torch.ones(B, dtype=torch.float64),
    }
    data["token_mask"][:, :2] = 0.0
    data["token_mask"][0, 6:] = 0.0  # a shorter response
    curr = (prev + 0.2 * torch.randn(B, S, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    return curr[:, 1:].contiguous(), data


def reference_loss(curr: torch.Tensor, data: dict[str, torch.Tensor], cfg: dict) -> torch.Tensor:
    """PPO's clipped surrogate times the truncated token IS weight (if enabled), token-mean over the valid tokens with
    NeMo-RL's masked mean, which adds 1e-8 to the token count."""
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    prev, gen, adv = data["prev_logprobs"][:, 1:], data["generation_logprobs"][:, 1:], data["advantages"][:, 1:]
    ratio = torch.exp(curr - prev)
    clipped = ratio.clamp(1.0 - cfg["ratio_clip_min"], 1.0 + cfg["ratio_clip_max"])
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    if cfg.get("use_importance_sampling_correction"):
        per_token = per_token * torch.exp(prev - gen).clamp(max=cfg["truncated_importance_sampling_ratio"])
    return (per_token * mask).sum() / (mask.sum() + 1e-8)


def loss_cases() -> dict[str, dict]:
    from nemo_is_plugin import build_loss_fn

    out = {}
    for name, cfg in CONFIGS.items():
        curr, data = batch()
        x = curr.clone().requires_grad_(True)
        valid_toks = (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()
        loss, metrics = build_loss_fn(cfg)(
            next_token_logprobs=x, data=data, global_valid_seqs=data["sample_mask"].sum(), global_valid_toks=valid_toks
        )
        (grad,) = torch.autograd.grad(loss, x)
        y = curr.clone().requires_grad_(True)
        ref = reference_loss(y, data, cfg)
        (ref_grad,) = torch.autograd.grad(ref, y)
        out[name] = {
            "loss": loss.item(),
            "reference": ref.item(),
            "grad": grad.flatten().tolist(),
            "reference_grad": ref_grad.flatten().tolist(),
            **{k: metrics[k] for k in ("clip_fraction", "is_truncated_fraction")},
        }
    return out


def kernel_logprobs() -> dict[str, float]:
    """The kernels' chunked log-probs (and entropy) from logits and from hidden states + the LM-head weight, one
    process, against float64 log_softmax: the largest absolute errors."""
    from nemo_is_plugin.distributed.head.fused_linear import fused_linear_logprobs
    from nemo_is_plugin.distributed.head.vocab_parallel import vocab_parallel_logprobs

    g = torch.Generator().manual_seed(1)
    n, h, v = 37, 16, 101
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * 0.5
    target = torch.randint(0, v, (n,), generator=g)
    logits = hidden @ weight.T
    logp = torch.log_softmax(logits, -1)
    want = logp.gather(-1, target[:, None])[:, 0]
    want_entropy = -(logp.exp() * logp).sum(-1)
    got, entropy = vocab_parallel_logprobs(logits.float(), target, None, chunk_size=8, with_entropy=True)
    fused = fused_linear_logprobs(hidden.float(), weight.float(), target, None, chunk_size=8)
    fused = fused[0] if isinstance(fused, tuple) else fused
    return {
        "vocab_parallel": float((got.double() - want).abs().max()),
        "entropy": float((entropy.double() - want_entropy).abs().max()),
        "fused_linear": float((fused.double() - want).abs().max()),
        "scale": float(want.abs().max()),
    }


def verl_case() -> dict[str, float]:
    """The verl adapter's loss (verl's policy-loss signature, verl not installed) with no plugin keys: verl's vanilla
    PPO (clip 0.2, dual clip 3.0 on negative advantages), token-mean, against a float64 reference."""
    from nemo_is_plugin.adapters.verl import VerlPolicyLoss

    g = torch.Generator().manual_seed(2)
    b, t = 3, 7
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) - 0.05
    new = (old + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, t).contiguous()
    mask = torch.ones(b, t, dtype=torch.float64)
    mask[0, 5:] = 0
    x = new.clone().requires_grad_(True)
    loss, _ = VerlPolicyLoss(config={})(old, x, adv, mask, loss_agg_mode="token-mean", config=None)
    (grad,) = torch.autograd.grad(loss, x)
    y = new.clone().requires_grad_(True)
    ratio = torch.exp(y - old)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    pg = torch.where(adv < 0, torch.minimum(pg, -adv * 3.0), pg)
    ref = (pg * mask).sum() / (mask.sum() + 1e-8)  # verl's masked mean, as NeMo-RL's, adds 1e-8 to the count
    (ref_grad,) = torch.autograd.grad(ref, y)
    return {
        "loss": loss.item(),
        "reference": ref.item(),
        "grad_error": float((grad - ref_grad).abs().max()),
        "grad_scale": float(ref_grad.abs().max()),
    }


def extra_errors() -> dict[str, dict[str, str]]:
    """What each app's import, megatron-core's groups and slime's default groups raise here: type and message."""

    def error(fn) -> dict[str, str]:
        try:
            fn()
        except ImportError as exc:
            return {"type": type(exc).__name__, "message": str(exc)}
        return {"type": "none", "message": ""}

    from nemo_is_plugin.adapters.slime import tis_function
    from nemo_is_plugin.distributed.parallel.groups import ParallelGroups

    out = {
        f"apps.{app}": error(lambda app=app: importlib.import_module(f"nemo_is_plugin.apps.{app}"))
        for app in APP_EXTRAS
    }
    out["parallel_state"] = error(ParallelGroups.from_parallel_state)
    out["slime"] = error(tis_function.groups)
    return out


def dump_lines() -> int:
    """The rollout-dump hook a trainer calls (imported when called): the lines it writes for one batch."""
    import tempfile

    from nemo_is_plugin.adapters.nemo_rl import dump_rollouts

    _, data = batch()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rollouts.jsonl"
        assert dump_rollouts(data, 0, path) == len(data["sample_mask"])
        return len(path.read_text().splitlines())


def main() -> None:
    report = {
        "installed": {m: importlib.util.find_spec(m) is not None for m in EXTRA_MODULES},
    }
    for name in CORE_MODULES:
        importlib.import_module(name)
    import nemo_is_plugin

    report["plugin_file"] = nemo_is_plugin.__file__
    report["imported_extras"] = sorted(m for m in EXTRA_MODULES if m in sys.modules)
    report["cases"] = loss_cases()
    report["kernels"] = kernel_logprobs()
    report["verl"] = verl_case()
    report["extra_errors"] = extra_errors()
    report["dumped"] = dump_lines()
    report["import_failures"] = import_every_module()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
