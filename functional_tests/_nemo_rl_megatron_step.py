"""NeMo-RL's Megatron policy worker's own ``train`` (``MegatronPolicyWorkerImpl.train``,
nemo_rl/models/policy/workers/megatron_policy_worker.py:749-1060 @7ea279ab) on CPU gloo processes.

The worker is built with ``object.__new__`` (its ``__init__`` builds the model through Megatron-Bridge, which this
tier cannot install: docs/testing.md); the attributes ``train`` reads are set here to what ``__init__`` would set
for this model (:func:`build_worker`). Everything ``train`` calls is NeMo-RL's or megatron-core's own:
``process_global_batch`` (the normalisers ``global_valid_seqs`` / ``global_valid_toks``), ``get_microbatch_iterator``
(micro-batching, sequence packing), ``LossPostProcessor`` (NeMo-RL's packing wrappers, the counter-scaling of
Megatron's loss averaging), ``megatron_forward_backward`` (megatron-core's schedule for the layout: no pipelining, or
1F1B at PP 2), the megatron-core optimizer's ``step`` and ``aggregate_training_statistics``.

The model: a megatron-core ``GPTModel`` MoE (2 layers, 4 experts top-2, the allgather token dispatcher, the local
layer spec with an RMSNorm that takes sequence parallelism and a causal attention for packed sequences:
host_shims/megatron_cpu.py), fp32, in megatron-core's ``DistributedDataParallel``, with megatron-core's optimizer
(``calculate_per_token_loss`` and ``average_in_collective=False``, as NeMo-RL's setup sets them:
nemo_rl/models/megatron/setup.py:1322, :1433). The driver's part of ``Policy.train`` (lm_policy.py,
``_shard_for_train``: ``BatchedDataDict.shard_by_batch_size`` with NeMo-RL's sequence-packing arguments) is done here.

A layout is one :class:`Layout`; a spawn runs every (layout, loss) of a job whose layouts have its world size, the
model-parallel state rebuilt between layouts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from _nemo_rl_step import build_loss
from _ranks import gather_objects, publish, run_job, the_job

VOCAB, HIDDEN, LAYERS, HEADS, EXPERTS, TOPK, EXPERT_FFN = 64, 32, 2, 4, 4, 2, 64
LR = 0.5


@dataclass(frozen=True)
class Layout:
    """One parallel layout of the step: the sizes NeMo-RL's ``megatron_cfg`` names, and its packing switches."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    packing: bool = False
    fuse_loss: bool = False
    router_replay: bool = False

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def name(self) -> str:
        parts = [f"{k}{v}" for k, v in (("tp", self.tp), ("pp", self.pp), ("cp", self.cp), ("ep", self.ep)) if v > 1]
        parts.append(f"dp{self.dp}")
        if self.packing:
            parts.append("packed_fused" if self.fuse_loss else "packed")
        if self.router_replay:
            parts.append("router_replay")
        return "_".join(parts)


def policy_config(layout: Layout, gbs: int, mbs: int) -> dict[str, Any]:
    """The ``policy`` keys ``train`` and the functions it calls read (NeMo-RL's PolicyConfig names)."""
    return {
        "train_global_batch_size": gbs,
        "train_micro_batch_size": mbs,
        "make_sequence_length_divisible_by": layout.tp * layout.cp * 2 if layout.cp > 1 else layout.tp,
        "logprob_chunk_size": None,
        "sequence_packing": {
            "enabled": layout.packing,
            "fuse_loss": layout.fuse_loss,
            "algorithm": "modified_first_fit_decreasing",
            "train_mb_tokens": 48,
        },
        "dynamic_batching": {"enabled": False},
        "router_replay": {"enabled": layout.router_replay},
        "megatron_cfg": {
            "tensor_model_parallel_size": layout.tp,
            "pipeline_model_parallel_size": layout.pp,
            "context_parallel_size": layout.cp,
            "expert_model_parallel_size": layout.ep,
            "sequence_parallel": layout.tp > 1,
            "empty_unused_memory_level": 0,
            "moe_per_layer_logging": False,
            "use_fused_linear_logprobs": False,
        },
    }


def init_parallel_state(layout: Layout) -> None:
    """megatron-core's model-parallel groups for ``layout`` on the spawn's gloo world (rebuilt when it changes)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
    )


def build_model(layout: Layout, seed: int):
    """The tiny MoE GPT of this rank's pipeline stage in megatron-core's DDP, its optimizer and scheduler."""
    import torch.nn.functional as F
    from host_shims.megatron_cp_attention import cp_core_attention_cls
    from host_shims.megatron_cpu import packed_causal_attention_cls
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from nemo_is_plugin.apps.demo.model import SPRMSNorm

    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=EXPERT_FFN,
        moe_ffn_hidden_size=EXPERT_FFN,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_token_dispatcher_type="allgather",  # NeMo-RL's default (setup.py:2284); alltoall makes a CUDA stream
        moe_router_load_balancing_type="none",  # NeMo-RL's default (setup.py:2287)
        moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp32",
        moe_enable_routing_replay=layout.router_replay,  # as NeMo-RL's setup.py:1023 sets it
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        sequence_parallel=layout.tp > 1,  # megatron-core refuses MoE + TP without it
        pipeline_dtype=torch.float32,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        perform_initialization=True,
        calculate_per_token_loss=True,  # NeMo-RL's setup.py:1322
        init_method_std=0.05,
        params_dtype=torch.float32,
        bf16=False,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
    )
    layer = get_gpt_layer_local_spec(num_experts=EXPERTS, normalization="RMSNorm")
    layer.submodules.input_layernorm = SPRMSNorm
    layer.submodules.pre_mlp_layernorm = SPRMSNorm
    # at CP > 1 the core attention that takes CP (the local one refuses it): host_shims/megatron_cp_attention.py
    attention = cp_core_attention_cls() if layout.cp > 1 else packed_causal_attention_cls()
    layer.submodules.self_attention.submodules.core_attention = attention
    local_layers = LAYERS // layout.pp
    block = TransformerBlockSubmodules(layer_specs=[layer] * local_layers, layer_norm=SPRMSNorm)
    torch.manual_seed(seed + parallel_state.get_pipeline_model_parallel_rank())
    model = GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=VOCAB,
        max_sequence_length=64,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, average_in_collective=False
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    # what Megatron-Bridge's get_pg_collection reads from the model ``train`` holds (megatron_policy_worker.py:961);
    # megatron-core 0.19.2's DDP does not carry it: the wrapped GPTModel's
    model.pg_collection = model.module.pg_collection
    from megatron.core.distributed import finalize_model_grads

    config.finalize_model_grads_func = finalize_model_grads  # as Megatron-Bridge's setup sets it
    # SGD with momentum: Adam's first step is lr * sign(g) wherever |g| >> eps, so a rounding-level difference in a
    # near-zero gradient entry (two losses summing the same terms in another order) becomes an lr-sized one
    opt_config = OptimizerConfig(
        optimizer="sgd",
        lr=0.5,
        sgd_momentum=0.9,
        weight_decay=0.01,
        clip_grad=1.0,
        bf16=False,
        params_dtype=torch.float32,
    )
    optimizer = get_megatron_optimizer(opt_config, [model])
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=LR,
        max_lr=LR,
        min_lr=LR,
        lr_warmup_steps=0,
        lr_decay_steps=100,
        lr_decay_style="constant",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=100,
        wd_incr_style="constant",
    )
    return model, optimizer, scheduler


def build_worker(layout: Layout, gbs: int, mbs: int, seed: int):
    """``MegatronPolicyWorkerImpl`` without its ``__init__``: the attributes ``train`` reads, as ``__init__`` sets them
    for this model (megatron_policy_worker.py:416-670)."""
    from megatron.core import parallel_state
    from nemo_rl.models.megatron.router_replay import router_replay_enabled
    from nemo_rl.models.policy.workers.megatron_policy_worker import MegatronPolicyWorkerImpl
    from nemo_rl.utils.timer import Timer

    model, optimizer, scheduler = build_model(layout, seed)
    worker = object.__new__(MegatronPolicyWorkerImpl)
    cfg = policy_config(layout, gbs, mbs)
    worker.__dict__.update(
        cfg=cfg,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        dtype=torch.float32,
        dp_size=parallel_state.get_data_parallel_world_size(),
        rank=dist.get_rank(),
        timer=Timer(context={"worker": "megatron_policy", "rank": dist.get_rank()}),
        mcore_state=SimpleNamespace(straggler_timer=None),  # no straggler detection (data.py:272, train.py:182)
        # read by _uses_mxfp8_overlap_shared_param_buffer (megatron_policy_worker.py:724): no MXFP8 overlap here
        megatron_cfg=SimpleNamespace(optimizer=optimizer.config, ddp=model.ddp_config),
        sampling_params=None,
        draft_model=None,
        defer_fp32_logits=False,
        fp8_cfg=None,
        delegate_pack_to_model=False,
        delegate_mtp_loss_mask_to_model=False,
        model_slices_context_parallel_inputs=False,
        media_placeholder_token_id=None,
        should_disable_forward_pre_hook=False,
        _first_train_step_forward_pre_hook_disabled=False,
        _router_replay_enabled=router_replay_enabled(cfg),
    )
    return worker


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.double().reshape(-1).tolist() if value.numel() != 1 else float(value)
    return value


def record_routes(model, input_ids: torch.Tensor) -> list:
    """``routed_experts [B, S, layers, top-k]`` of the model's own router on ``input_ids`` at its current weights, as
    vLLM records them at rollout: megatron-core's ``RouterReplayAction.RECORD`` on each MoE layer's replay instance
    (NeMo-RL's ``_router_replay_instances_for_model``) over one forward with the inputs NeMo-RL's unpacked path builds
    (data.py:597, ``get_ltor_masks_and_position_ids``). Under sequence parallelism each TP rank's router sees its
    slice of the ``[S, B]`` tokens: the slices are gathered over the TP group."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router_replay import RouterReplayAction
    from nemo_rl.models.megatron.data import get_ltor_masks_and_position_ids
    from nemo_rl.models.megatron.router_replay import _router_replay_instances_for_model, clear_router_replay

    instances = sorted(_router_replay_instances_for_model(model), key=lambda pair: pair[1])
    for replay, _ in instances:
        replay.set_router_replay_action(RouterReplayAction.RECORD)
    mask, _, positions = get_ltor_masks_and_position_ids(
        data=input_ids,
        eod_token=0,
        pad_token=0,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        pad_mask_loss=False,
    )
    with torch.no_grad():
        model.module(input_ids=input_ids, position_ids=positions, attention_mask=mask)
    per_layer = [replay.get_recorded_indices() for replay, _ in instances]  # each [tokens on this rank, top-k]
    clear_router_replay(model)
    routes = torch.stack(per_layer, dim=1)  # [tokens, layers, top-k], tokens s-major ([S, B] flattened)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    if model.config.sequence_parallel and dist.get_world_size(tp_group) > 1:
        parts = [torch.empty_like(routes) for _ in range(dist.get_world_size(tp_group))]
        dist.all_gather(parts, routes.contiguous(), group=tp_group)
        routes = torch.cat(parts, dim=0)
    b, s = input_ids.shape
    return routes.reshape(s, b, *routes.shape[1:]).transpose(0, 1).tolist()


def packing_args(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """NeMo-RL's ``SequencePackingArgs`` as ``Policy`` builds them (lm_policy.py:343-348, :523-525)."""
    if not cfg["sequence_packing"]["enabled"]:
        return None
    return {
        "algorithm": cfg["sequence_packing"]["algorithm"],
        "input_key": "input_ids",
        "input_lengths_key": "input_lengths",
        "sequence_length_pad_multiple": cfg["make_sequence_length_divisible_by"],
        "max_tokens_per_microbatch": cfg["sequence_packing"]["train_mb_tokens"],
    }


def run_one(layout: Layout, spec: dict[str, Any], batches: list[dict[str, Any]], mbs: int, seed: int) -> dict:
    """One optimizer step of ``train`` per batch for one loss (the spec's ``"extra"``: per batch, data keys added
    to it); this rank's results."""
    from megatron.core import parallel_state
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    gbs = len(batches[0]["input_ids"])
    worker = build_worker(layout, gbs, mbs, seed)
    loss_fn = build_loss(spec)
    dp, dp_rank = worker.dp_size, parallel_state.get_data_parallel_rank()
    steps = []
    extras = spec.get("extra") or [{} for _ in batches]
    if spec.get("record_routes"):  # the rollout policy's routes: the initial weights', for every batch
        extras = [{"routed_experts": record_routes(worker.model, torch.tensor(b["input_ids"]))} for b in batches]
    for batch, extra in zip(batches, extras, strict=True):
        data = BatchedDataDict({k: torch.tensor(v) for k, v in {**batch, **extra}.items()})
        args = packing_args(worker.cfg)
        if args is None:
            shard = data.shard_by_batch_size(dp, batch_size=gbs)[dp_rank]
        else:
            shard = data.shard_by_batch_size(dp, batch_size=gbs, sequence_packing_args=args)[0][dp_rank]
        result = worker.train(shard, loss_fn)
        steps.append(
            {
                "global_loss": _plain(result["global_loss"]),
                "grad_norm": _plain(result["grad_norm"]),
                "all_mb_metrics": {k: [_plain(x) for x in v] for k, v in result["all_mb_metrics"].items()},
            }
        )
    params = {n: p.detach().double().reshape(-1).tolist() for n, p in worker.model.module.named_parameters()}
    ranks = {
        "tp": parallel_state.get_tensor_model_parallel_rank(),
        "pp": parallel_state.get_pipeline_model_parallel_rank(),
        "dp": dp_rank,
    }
    return {"steps": steps, "params": params, "ranks": ranks}


def setup_workers(rank: int, world_size: int) -> None:
    """NeMo-RL on the path and the shims, before any of NeMo-RL's modules is imported."""
    import sys

    job = the_job()
    sys.path.insert(0, job["nemo_rl_path"])
    from host_shims import nemo_rl_megatron as shims

    shims.install(job["nemo_rl_path"])


def _train(rank: int, world_size: int) -> None:
    job = the_job()
    results = []
    current = None
    for run in job["runs"]:
        layout = Layout(**run["layout"])
        if layout != current:
            init_parallel_state(layout)
            current = layout
        out = run_one(layout, run["spec"], job["batches"], job["mbs"], job["seed"])
        results.append(gather_objects(out))
    publish("results", results)


CHECKS = [("train", _train)]


def run_steps(
    nemo_rl_path: str,
    world_size: int,
    runs: list[tuple[Layout, dict[str, Any]]],
    batches: list[dict[str, torch.Tensor]],
    mbs: int,
    seed: int = 0,
) -> list[list[dict[str, Any]]]:
    """Spawn ``world_size`` ranks running every (layout, spec) of ``runs`` (a spec: ``_nemo_rl_step.build_loss``'s,
    plus ``"extra"`` data keys per batch); per run, every rank's results."""
    assert all(layout.world == world_size for layout, _ in runs)
    job = {
        "nemo_rl_path": nemo_rl_path,
        "mbs": mbs,
        "seed": seed,
        "runs": [{"layout": asdict(layout), "spec": spec} for layout, spec in runs],
        "batches": [{k: v.tolist() for k, v in b.items()} for b in batches],
    }
    return run_job(__name__, world_size, job)
