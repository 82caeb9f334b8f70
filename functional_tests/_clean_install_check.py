"""Run by test_clean_install.py with the interpreter of a virtual environment that holds torch and `pip install .`
of the plugin, nothing else: reports, as one JSON object on stdout, what is installed, which of the plugin's modules
import, and a loss and its gradient next to a float64 reference written here in plain torch."""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
import traceback
from pathlib import Path

import torch

# The top-level modules of the extras: none may be installed by the plugin's own dependencies.
EXTRA_MODULES = ("ray", "matplotlib", "typer", "rich", "pyarrow")
# A core dependency that importing the package must not load (it costs seconds; read only where the host has it).
LAZY_CORE_MODULES = ("megatron",)
# Modules only optional paths import (inside the commands and adapters that need them).
OPTIONAL_MODULES = {*EXTRA_MODULES, "click", "verl", "vllm", "triton", "liger_kernel", "cut_cross_entropy"}
# What a trainer imports: the loss, the distributed entry points, the host adapters and recipes.
CORE_MODULES = (
    "nemo_is_plugin",
    "nemo_is_plugin.recipes",
    "nemo_is_plugin.adapters.nemo_rl",
    "nemo_is_plugin.adapters.verl",
    "nemo_is_plugin.distributed.entry_points.logit_loss",
    "nemo_is_plugin.distributed.head.fused_linear",
    "nemo_is_plugin.distributed.entry_points.fused_linear_loss",
)
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
        "lazy_core_installed": {m: importlib.util.find_spec(m) is not None for m in LAZY_CORE_MODULES},
    }
    for name in CORE_MODULES:
        importlib.import_module(name)
    import nemo_is_plugin

    report["plugin_file"] = nemo_is_plugin.__file__
    report["imported_extras"] = sorted(m for m in (*EXTRA_MODULES, *LAZY_CORE_MODULES) if m in sys.modules)
    report["cases"] = loss_cases()
    report["dumped"] = dump_lines()
    report["import_failures"] = import_every_module()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
