"""The demo's run configuration (pydantic; the only place its defaults live) and the loss settings it compares.

Loss settings are NeMo-RL ``loss_fn`` YAML files in ``configs/demo/`` (one per setting, named by file stem), loaded
and validated with :mod:`nemo_is_plugin.adapters.recipes`. ``--configs`` takes setting names or paths to other YAML
files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nemo_is_plugin.apps.demo.model import ModelShape

DEFAULT_LOSS_SETTINGS = ("gspo_exp_sum", "gspo_seq_mean", "token_tis", "ctpo")


def configs_dir() -> Path:
    """The demo's loss settings: ``nemo_is_plugin/apps/demo/configs``, a symlink to the repository's ``configs/demo`` in
    a source tree, and a copy of those files in an installed wheel (package data)."""
    return Path(__file__).parent / "configs"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSection(_Section):
    # The architecture's defaults are ModelShape's (demo/model.py); this section only exposes them to the YAML.
    hidden: int = ModelShape.hidden
    layers: int = ModelShape.layers
    heads: int = ModelShape.heads
    experts: int = ModelShape.experts
    topk: int = ModelShape.topk
    expert_ffn: int = ModelShape.expert_ffn
    tensor_parallel: int = Field(2, ge=1, description="TP size of the policy (one Ray actor per rank, gloo).")
    micro_batch_tokens: int = Field(8192, description="Tokens per Megatron forward (bounds the S^2 attention memory).")


class RolloutSection(_Section):
    backend: Literal["cpu", "vllm"] = "cpu"
    precision: Literal["fp32", "bf16", "fp8", "int4"] = Field(
        "fp8", description="Rollout engine numerics (cpu backend); the mismatch knob. fp32 = no mismatch."
    )
    temperature: float = 1.0


class WarmStartSection(_Section):
    steps: int = 95
    batch: int = 64
    lr: float = 2e-3
    free_tail: int = Field(8, description="Random digits after EOS in the SFT data (what long responses look like).")


class PhaseSection(_Section):
    """One response-length setting: ``short`` (stop at EOS) or ``long`` (ignore EOS, fixed length)."""

    steps: int
    prompts_per_step: int
    group_size: int
    response_length: int | None = Field(None, description="None: the answer length + 2, stopping at EOS.")
    ignore_eos: bool = False


class GRPOSection(_Section):
    lr: float = 2e-4
    max_grad_norm: float = 1.0
    minibatches: int = Field(4, description="Optimizer steps per rollout batch (>1 makes the policy ratio move).")


class EvalSection(_Section):
    prompts: int = 128


class DemoConfig(_Section):
    """Everything one ``nemo-is demo`` run needs. CLI options override single fields."""

    output_dir: str = "runs/demo"
    seed: int = 0
    num_digits: int = 6
    ray_address: str | None = None
    loss_settings: list[str] = Field(default_factory=lambda: list(DEFAULT_LOSS_SETTINGS))
    model: ModelSection = Field(default_factory=ModelSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    warm_start: WarmStartSection = Field(default_factory=WarmStartSection)
    grpo: GRPOSection = Field(default_factory=GRPOSection)
    short: PhaseSection = Field(default_factory=lambda: PhaseSection(steps=12, prompts_per_step=16, group_size=8))
    long: PhaseSection | None = Field(
        default_factory=lambda: PhaseSection(
            steps=2, prompts_per_step=4, group_size=4, response_length=1024, ignore_eos=True
        )
    )
    eval: EvalSection = Field(default_factory=EvalSection)

    @model_validator(mode="after")
    def _batches_split_evenly(self) -> DemoConfig:
        for name, phase in self.phases():
            batch = phase.prompts_per_step * phase.group_size
            if batch % self.grpo.minibatches:
                raise ValueError(
                    f"{name}: prompts_per_step * group_size = {batch} must divide by grpo.minibatches = "
                    f"{self.grpo.minibatches}"
                )
        return self

    def phases(self) -> list[tuple[str, PhaseSection]]:
        out = [("short", self.short)]
        if self.long is not None and self.long.steps > 0:
            out.append(("long", self.long))
        return out

    def short_response_length(self) -> int:
        return self.short.response_length or self.num_digits + 3


def quick(cfg: DemoConfig) -> DemoConfig:
    """The functional test's short run: 6 GRPO steps, one long batch (16 x 1024 tokens) per setting."""
    data = cfg.model_dump()
    data["short"].update(steps=6)
    data["long"] = dict(
        data["long"] or {}, steps=1, response_length=1024, prompts_per_step=4, group_size=4, ignore_eos=True
    )
    return DemoConfig(**data)


def load_loss_settings(names: list[str]) -> dict[str, dict[str, Any]]:
    """Setting name -> validated ``loss_fn`` mapping. A name is a file stem in configs/demo or a YAML path."""
    from nemo_is_plugin.adapters.recipes import load_recipe_config

    out: dict[str, dict[str, Any]] = {}
    for name in names:
        path = Path(name)
        if path.suffix not in (".yaml", ".yml"):
            path = configs_dir() / f"{name}.yaml"
        if not path.exists():
            known = sorted(p.stem for p in configs_dir().glob("*.yaml")) if configs_dir().exists() else []
            raise FileNotFoundError(f"loss setting {name!r}: no file {path}; known settings: {known}")
        cfg = load_recipe_config(str(path))
        out[path.stem] = cfg.model_dump(exclude_unset=True)
    return out
