"""Training steps of a megatron-core MoE GPT model with the naive loss and with the plugin's fused hidden-state loss.

The question it answers: what share of a real MoE training step is the LM head + log-prob + loss, and what does the
fused path change in time and memory. One process, world size 1 (NCCL on CUDA, gloo on CPU), TP = PP = 1.

Model: ``GPTModel`` with the local layer spec (no Transformer Engine / Apex), RMSNorm, RoPE, SwiGLU experts with a
top-k softmax router and the all-gather dispatcher, untied LM head; bf16 parameters on CUDA. The default shape keeps
Qwen3-30B-A3B's head (hidden 2048, vocab 151,936, expert FFN 768, 32 heads / 4 KV groups as 16 x 128 here) and scales
the body down to fit one GPU (2 layers, 16 experts top-4 instead of 48 layers, 128 experts top-8).

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
import socket
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nemo_is_plugin.apps.bench.device import BenchDevice, dtype_name
from nemo_is_plugin.apps.bench.jobs import BENCH_LOSS_CONFIG, bench_loss_fn
from nemo_is_plugin.apps.bench.problem import RLBatch, make_rl_batch


@dataclass(frozen=True)
class StepShape:
    """A GPT MoE model and its batch (``batch`` sequences of ``seq_len`` tokens)."""

    name: str
    hidden: int
    vocab: int
    layers: int
    heads: int
    query_groups: int
    experts: int
    topk: int
    expert_ffn: int
    batch: int
    seq_len: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len


GPU_STEP_SHAPE = StepShape(
    "Qwen3-30B-A3B head, scaled body",
    hidden=2048,
    vocab=151936,
    layers=2,
    heads=16,
    query_groups=4,
    experts=16,
    topk=4,
    expert_ffn=768,
    batch=4,
    seq_len=2048,
)
QUICK_STEP_SHAPE = StepShape(
    "tiny",
    hidden=64,
    vocab=512,
    layers=2,
    heads=4,
    query_groups=2,
    experts=4,
    topk=2,
    expert_ffn=128,
    batch=2,
    seq_len=33,
)
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def single_process_parallel(dev: BenchDevice, seed: int):
    """torch.distributed with world size 1 (NCCL on CUDA, gloo on CPU) and Megatron's parallel state at TP = PP = 1;
    torn down on exit if this context created it. CPU: the demo's patches for megatron-core without a GPU."""
    from megatron.core import parallel_state, tensor_parallel

    created = not dist.is_initialized()
    if created:
        if dev.is_cuda:
            torch.cuda.set_device(dev.device)
        dist.init_process_group(
            "nccl" if dev.is_cuda else "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
        )
    made_state = not parallel_state.model_parallel_is_initialized()
    if made_state:
        parallel_state.initialize_model_parallel(1, 1)
    if dev.is_cuda:
        import megatron.core.transformer.moe.moe_utils as moe_utils

        if not hasattr(moe_utils, "te_general_gemm"):  # without Transformer Engine the router would hit a NameError
            moe_utils.te_general_gemm = None
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        from nemo_is_plugin.apps.demo.model import apply_cpu_patches

        apply_cpu_patches()
    try:
        yield
    finally:
        if made_state:
            parallel_state.destroy_model_parallel()
        if created:
            dist.destroy_process_group()


def build_model(shape: StepShape, dev: BenchDevice, seed: int):
    """The MoE ``GPTModel`` on ``dev`` in ``dev.dtype`` (see the module docstring)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    half = dev.dtype in (torch.bfloat16, torch.float16)
    settings = dict(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        num_query_groups=shape.query_groups,
        ffn_hidden_size=shape.expert_ffn,
        moe_ffn_hidden_size=shape.expert_ffn,
        num_moe_experts=shape.experts,
        moe_router_topk=shape.topk,
        moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        params_dtype=dev.dtype,
        bf16=dev.dtype == torch.bfloat16,
        fp16=dev.dtype == torch.float16,
        use_cpu_initialization=not dev.is_cuda,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        moe_router_dtype="fp32" if half else None,
    )
    known = {f.name for f in dataclasses.fields(TransformerConfig)}  # megatron-core versions differ in their fields
    config = TransformerConfig(**{k: v for k, v in settings.items() if k in known and v is not None})
    spec = get_gpt_layer_local_spec(num_experts=shape.experts, moe_grouped_gemm=False, normalization="RMSNorm")
    torch.manual_seed(seed)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=shape.vocab,
        max_sequence_length=shape.seq_len,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )
    return model.to(device=dev.device)  # parameters are already in params_dtype; buffers keep theirs


@contextlib.contextmanager
def head_bypassed(model):
    """The output layer returns its input: the model's output is the final-normed hidden states ``[B, S, H]``."""

    def identity(hidden, weight=None, runtime_gather_output=None, **_unused):
        return hidden, None

    model.output_layer.forward = identity
    try:
        yield
    finally:
        del model.output_layer.forward


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
        device=dev.device.type,
        dtype=dtype_name(dev.dtype),
        repeats=cfg.repeats,
        warmup=cfg.warmup,
        chunk_size=cfg.chunk_size,
        quick=cfg.quick,
        statistic=dev.statistic,
        loss=BENCH_LOSS_CONFIG,
        diff_base=diff_base,
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
    "GPU_STEP_SHAPE",
    "QUICK_STEP_SHAPE",
    "STEP_VARIANTS",
    "StepConfig",
    "StepShape",
    "build_model",
    "count_model_steps",
    "head_bypassed",
    "run_model_step",
    "single_process_parallel",
    "variant_loss",
]
