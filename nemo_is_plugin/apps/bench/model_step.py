"""Training steps of a megatron-core MoE GPT model with the naive loss and with the plugin's fused hidden-state loss.

The question it answers: what share of a real MoE training step is the LM head + log-prob + loss, and what does the
fused path change in time and memory. One process, world size 1 (NCCL on CUDA, gloo on CPU), TP = PP = 1.

Model: a megatron-core MoE ``GPTModel``, its shapes and its world-size-1 parallel state (``moe_model``).

Variants (``STEP_VARIANTS``; one step = forward + loss + ``backward()``, gradients reset before each step):
- ``body``: the decoder alone (LM head bypassed) with a fixed random upstream gradient on its output: the cost every
  variant shares, subtracted to get each variant's head + loss time;
- ``naive``: logits ``[B, S, V]`` from the output layer -> fp32 ``log_softmax`` -> gather -> plugin loss;
- ``fused`` / ``fused_2pass``: output layer bypassed; ``fused_linear_pg_loss`` on the decoder output and
  ``output_layer.weight`` (single pass where the config allows it / forced two-pass).
The loss is the head benchmark's (``BENCH_LOSS_CONFIG``), on an RL batch whose old / reference log-probs are random.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nemo_is_plugin.apps.bench.device import BenchDevice
from nemo_is_plugin.apps.bench.jobs import BENCH_LOSS_CONFIG, bench_loss_fn
from nemo_is_plugin.apps.bench.moe_model import (
    GPU_STEP_SHAPE,
    QUICK_STEP_SHAPE,
    StepShape,
    build_model,
    head_bypassed,
    single_process_parallel,
)
from nemo_is_plugin.apps.bench.problem import RLBatch, make_rl_batch

STEP_VARIANTS = {
    "body": "decoder only (LM head bypassed), fixed upstream gradient: the part every variant shares",
    "naive": "logits [B, S, V] -> fp32 log_softmax -> gather -> plugin loss",
    "fused": "fused_linear_pg_loss on the decoder output and output_layer.weight (single pass)",
    "fused_2pass": "the same, forced two-pass schedule (what sequence-level ratios cost)",
}


@dataclass
class StepConfig:
    shape: StepShape = QUICK_STEP_SHAPE
    device: str = "cpu"
    dtype: str | None = None
    repeats: int = 3
    warmup: int = 1
    chunk_size: int | None = None
    variants: tuple[str, ...] = tuple(STEP_VARIANTS)
    quick: bool = True
    seed: int = 0

    @classmethod
    def for_device(
        cls,
        device: str = "cpu",
        quick: bool = False,
        tokens: int | None = None,
        layers: int | None = None,
        experts: int | None = None,
        **overrides,
    ) -> StepConfig:
        """CUDA: ``GPU_STEP_SHAPE`` unless ``quick``; CPU: only the tiny quick shape (a real one would take hours)."""
        cuda = device.startswith("cuda")
        if not cuda and not quick:
            raise ValueError("--model-step on CPU runs only the tiny --quick model (add --quick, or use --device cuda)")
        shape = QUICK_STEP_SHAPE if quick else GPU_STEP_SHAPE
        changes: dict = {}
        if tokens is not None:
            if tokens % shape.seq_len:
                raise ValueError(f"--tokens {tokens} must be a multiple of the sequence length {shape.seq_len}")
            changes["batch"] = tokens // shape.seq_len
        if layers is not None:
            changes["layers"] = layers
        if experts is not None:
            changes.update(experts=experts, topk=min(shape.topk, experts))
        if cuda:
            overrides.setdefault("repeats", 5)
            overrides.setdefault("warmup", 2)
        return cls(shape=dataclasses.replace(shape, **changes), device=device, quick=quick, **overrides)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [B, S]
    position_ids: torch.Tensor  # [B, S]
    attention_mask: torch.Tensor  # [1, 1, S, S] bool, True = masked
    batch: RLBatch  # target [B, S-1] and the RL data
    probe: torch.Tensor  # [B, S, H] the body variant's upstream gradient


def step_inputs(shape: StepShape, dev: BenchDevice, seed: int) -> StepInputs:
    rl = make_rl_batch(shape.batch, shape.seq_len, shape.vocab, seed=seed, device=dev.device)
    ids = rl.data["input_ids"]
    s = shape.seq_len
    pos = torch.arange(s, device=dev.device).expand(shape.batch, s)
    mask = torch.ones(s, s, dtype=torch.bool, device=dev.device).triu(1)[None, None]
    g = torch.Generator(dev.device).manual_seed(seed + 1)
    probe = torch.randn(shape.batch, s, shape.hidden, generator=g, device=dev.device, dtype=dev.dtype)
    return StepInputs(ids, pos, mask, rl, probe)


def variant_loss(name: str, model, inputs: StepInputs, loss_fn, chunk_size: int | None) -> torch.Tensor:
    """One forward + loss of variant ``name`` (the output layer must already be bypassed for all but ``naive``)."""
    from nemo_is_plugin.distributed.entry_points.fused_linear_loss import fused_linear_pg_loss

    out = model(inputs.input_ids, inputs.position_ids, inputs.attention_mask)
    rl = inputs.batch
    if name == "body":
        return (out * inputs.probe).float().sum()
    if name == "naive":
        logp = torch.log_softmax(out[:, :-1].float(), dim=-1)
        lp = logp.gather(-1, rl.target.unsqueeze(-1)).squeeze(-1)
        return loss_fn(lp, rl.data, rl.global_valid_seqs, rl.global_valid_toks)[0]
    loss, _ = fused_linear_pg_loss(
        loss_fn,
        out[:, :-1],
        model.output_layer.weight,
        rl.target,
        rl.data,
        rl.global_valid_seqs,
        rl.global_valid_toks,
        chunk_size=chunk_size,
        single_pass=None if name == "fused" else False,
    )
    return loss


def _watched_grad(model) -> torch.Tensor:
    """A body weight whose gradient every variant must agree on: the first layer's attention input projection."""
    return model.decoder.layers[0].self_attention.linear_qkv.weight


def run_model_step(cfg: StepConfig, progress: Callable[[str], None] | None = None) -> dict:
    """Build the model once, then per variant: warm-up steps, one memory-tracked step, ``repeats`` timed steps."""
    from nemo_is_plugin.apps.bench.reference import rel_err

    progress = progress or (lambda _label: None)
    dev = BenchDevice.resolve(cfg.device, cfg.dtype)
    shape, rows, skipped = cfg.shape, [], {}
    with single_process_parallel(dev, cfg.seed):
        progress("building the model")
        model = build_model(shape, dev, cfg.seed)
        params = sum(p.numel() for p in model.parameters())
        inputs, loss_fn = step_inputs(shape, dev, cfg.seed), bench_loss_fn()
        reference: dict = {}
        for name in cfg.variants:
            values: dict = dict(variant=name, description=STEP_VARIANTS[name])

            def step(name=name) -> torch.Tensor:
                model.zero_grad(set_to_none=True)
                loss = variant_loss(name, model, inputs, loss_fn, cfg.chunk_size)
                loss.backward()
                return loss.detach()

            bypass = head_bypassed(model) if name != "naive" else contextlib.nullcontext()
            try:
                with bypass:
                    progress(f"{name}: warm-up + memory")
                    for _ in range(cfg.warmup):
                        step()
                    model.zero_grad(set_to_none=True)
                    out: dict[str, torch.Tensor] = {}

                    def tracked_step(out: dict[str, torch.Tensor] = out) -> None:
                        out["loss"] = step()

                    measured = dev.measure_memory(tracked_step)
                    values.update(peak_bytes=measured.peak_bytes, loss=out["loss"].float().item())
                    if name != "body":
                        grad = _watched_grad(model).grad
                        if grad is None:
                            raise RuntimeError(f"{name}: the step left no gradient on the watched body weight")
                        if "grad" not in reference:
                            first = grad.detach().to(torch.float32, copy=True)
                            reference.update(grad=first, loss=values["loss"], variant=name)
                        values["grad_rel_diff"] = rel_err(grad, reference["grad"])
                        values["loss_rel_diff"] = abs(values["loss"] - reference["loss"]) / max(
                            abs(reference["loss"]), 1e-30
                        )
                    times = []
                    for r in range(cfg.repeats):
                        progress(f"{name}: step {r + 1}/{cfg.repeats}")
                        times.append(dev.time_call(step))
            except Exception as exc:  # an out-of-memory at this shape: reported, the other variants still run
                skipped[name] = f"failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
                model.zero_grad(set_to_none=True)
                dev.release_cached()
                continue
            model.zero_grad(set_to_none=True)
            dev.release_cached()
            values["step_s"] = dev.summarise(times)
            values["tokens_per_s"] = shape.tokens / values["step_s"]
            rows.append(values)
        diff_base = reference.get("variant")
    body = next((r["step_s"] for r in rows if r["variant"] == "body"), None)
    for row in rows:
        if body is not None and row["variant"] != "body":
            row["head_loss_s"] = row["step_s"] - body
            row["head_loss_share"] = row["head_loss_s"] / row["step_s"]
    config = dict(
        shape=dataclasses.asdict(shape),
        tokens=shape.tokens,
        params=params,
        repeats=cfg.repeats,
        warmup=cfg.warmup,
        chunk_size=cfg.chunk_size,
        quick=cfg.quick,
        loss=BENCH_LOSS_CONFIG,
        diff_base=diff_base,
        **dev.recorded(),
    )
    machine = dict(dev.describe(), megatron_core=_megatron_version())
    return dict(kind="model_step", config=config, machine=machine, rows=rows, skipped=skipped)


def _megatron_version() -> str | None:
    try:
        from megatron.core import package_info

        return package_info.__version__
    except Exception:
        return None


def count_model_steps(cfg: StepConfig) -> int:
    return 1 + len(cfg.variants) * (1 + cfg.repeats)


__all__ = [
    "STEP_VARIANTS",
    "StepConfig",
    "StepInputs",
    "count_model_steps",
    "run_model_step",
    "step_inputs",
    "variant_loss",
]
