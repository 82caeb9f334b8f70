"""slime's own training step, run on gloo ranks: ``train_one_step`` (slime/backends/megatron_utils/model.py @624b824a)
with slime's batch iterator (``DataIterator`` / ``get_batch``, data.py), slime's ``loss_function`` (loss.py: its
``policy_loss_function`` or the ``--custom-loss-function-path`` one) and slime's metric reduction
(``reduce_train_step_metrics``), on a megatron-core DDP model and optimizer (``get_megatron_optimizer``).

What is built here, as slime builds it: the per-rank rollout data and micro-batch schedule from slime's own
``build_dp_schedule`` (slime/utils/dp_schedule.py: fixed-size micro-batches over each step's samples, dealt
round-robin to the DP ranks), the model's config hooks as slime's ``train`` sets them (model.py:749-767), the
optimizer from an ``OptimizerConfig`` (model.py:300-315) and slime's ``OptimizerParamScheduler`` helper. The model is
a tiny megatron-core module of tensor-parallel layers (a vocab-parallel embedding, a column-parallel MLP and a
column-parallel output layer, ``logits [1, T, V/TP]`` as slime's GPT model returns them), its weights cut from one
seeded full set, so every layout starts from the same parameters.
"""

from __future__ import annotations

from argparse import Namespace
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from _ranks import whole
from host_shims import slime as slime_shims

VOCAB, HIDDEN = 32, 16
SAMPLES, STEP_SAMPLES = 8, 4  # one rollout of 8 samples, two training steps of 4 (two optimizer steps)
ARGS: dict[str, Namespace] = {}
_CPU: list[Any] = []


def setup_rank() -> None:
    """The shims and slime's modules, once per process; megatron-core's CUDA names stay on the CPU from here on."""
    slime_shims.install(lambda: ARGS["args"])
    mode = slime_shims.cpu_device()
    mode.__enter__()
    _CPU.append(mode)


def slime_args(**overrides: Any) -> Namespace:
    """The slime arguments the step reads (slime/utils/arguments.py defaults for the ones left alone)."""
    values: dict[str, Any] = dict(
        # the step and its batch (model.py:550-700, data.py)
        custom_megatron_before_train_step_hook_path=None,
        custom_megatron_before_log_prob_hook_path=None,
        use_rollout_entropy=False,
        rollout_top_p=1.0,
        save_debug_train_data=None,
        data_pad_size_multiplier=1,
        allgather_cp=False,
        enable_mtp_training=False,
        seq_length=64,
        micro_batch_size=1,
        decoder_seq_length=None,
        check_for_nan_in_loss_and_grad=False,
        ci_test=False,
        calculate_per_token_loss=False,
        recompute_loss_function=False,
        use_dynamic_batch_size=False,
        max_tokens_per_gpu=None,
        balance_by_flops=False,
        balance_data=False,
        # slime's PPO loss (loss.py:934), GRPO with TIS and a KL term
        loss_type="policy_loss",
        custom_loss_function_path=None,
        advantage_estimator="grpo",
        eps_clip=0.2,
        eps_clip_high=0.28,
        eps_clip_c=None,
        use_kl_loss=True,
        kl_loss_coef=0.05,
        kl_loss_type="low_var_kl",
        use_unbiased_kl=False,
        entropy_coef=0.01,
        use_tis=True,
        tis_clip=1.5,
        tis_clip_low=0.0,
        custom_tis_function_path=None,
        get_mismatch_metrics=False,
        use_rollout_logprobs=False,
        use_opsm=False,
        custom_pg_loss_reducer_function_path=None,
        rollout_temperature=1.0,
        log_probs_chunk_size=-1,
        use_opd=False,
        # the optimizer (OptimizerConfig's fields, model.py:300) and slime's scheduler helper (model.py:181)
        optimizer="adam",
        lr=1e-2,
        min_lr=0.0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.98,
        adam_eps=1e-8,
        clip_grad=1.0,
        bf16=False,
        fp16=False,
        params_dtype=torch.float32,
        use_distributed_optimizer=False,
        num_rollout=1,
        rollout_batch_size=SAMPLES,
        n_samples_per_prompt=1,
        global_batch_size=STEP_SAMPLES,
        lr_decay_iters=None,
        lr_wsd_decay_iters=None,
        lr_warmup_fraction=None,
        lr_warmup_iters=0,
        lr_warmup_init=0.0,
        lr_decay_style="constant",
        start_weight_decay=0.0,
        end_weight_decay=0.0,
        weight_decay_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=False,
        lr_wsd_decay_style="exponential",
    )
    values.update(overrides)
    return Namespace(**values)


def plugin_args(nemo_is: dict[str, Any], **overrides: Any) -> Namespace:
    """The plugin through slime's own entry point: ``--loss-type custom_loss --custom-loss-function-path ...``, its
    keys in ``args.nemo_is`` (slime's ``--custom-config-path`` YAML)."""
    return slime_args(
        loss_type="custom_loss",
        custom_loss_function_path="nemo_is_plugin.adapters.slime.policy_loss",
        nemo_is=nemo_is,
        **overrides,
    )


def rollout(seed: int = 0) -> dict[str, list[Any]]:
    """One rollout's samples as slime's rollout manager sends them: tokens, lengths, response loss masks, per-sample
    GRPO advantages, and the offsets of three log-probs from the trainer's own (``log_probs``, which slime's actor
    computes with ``forward_only`` before training, :func:`run_steps`): pi_old one policy update away
    (``old_offset``), the rollout engine's (SGLang's, ``rollout_offset``) and the reference model's (``ref_offset``)."""
    g = torch.Generator().manual_seed(seed)
    data: dict[str, list[Any]] = {k: [] for k in ("tokens", "total_lengths", "response_lengths", "loss_masks")}
    data.update({k: [] for k in ("advantages", "old_offset", "rollout_offset", "ref_offset")})
    for i in range(SAMPLES):
        prompt, response = 2 + i % 3, 6 + (5 * i) % 7
        data["tokens"].append(torch.randint(0, VOCAB, (prompt + response,), generator=g))
        data["total_lengths"].append(prompt + response)
        data["response_lengths"].append(response)
        mask = torch.ones(response, dtype=torch.int)
        if i % 3 == 1:
            mask[-1] = 0
        data["loss_masks"].append(mask)
        data["advantages"].append(torch.full((response,), float(torch.randn((), generator=g))))
        # samples more and less off-policy, so that a batch statistic depends on which samples it spans
        for key, scale in (("old_offset", 0.05 + 0.05 * (i % 4)), ("rollout_offset", 0.25), ("ref_offset", 0.1)):
            data[key].append(scale * torch.randn(response, generator=g))
    return data


def rank_rollout(args: Namespace, data: dict[str, list[Any]]) -> dict[str, Any]:
    """This DP rank's share and micro-batch schedule, from slime's own ``build_dp_schedule`` (as slime's rollout
    manager splits the data, slime/ray/rollout.py:757-816)."""
    from megatron.core import parallel_state as mpu
    from slime.utils.dp_schedule import build_dp_schedule

    dp = mpu.get_data_parallel_world_size()
    config = {"dp_size": dp, "cp_size": 1, "vpp_size": 1, "microbatch_group_size_per_vp_stage": 1}
    partitions, indices, num_mbs, step_sizes = build_dp_schedule(
        args, config, data["total_lengths"], global_batch_size=args.global_batch_size, rollout_indices=range(SAMPLES)
    )
    rank = mpu.get_data_parallel_rank()
    own = {key: [values[j] for j in partitions[rank]] for key, values in data.items()}
    own.update(micro_batch_indices=indices[rank], num_microbatches=num_mbs, global_batch_sizes=step_sizes)
    return own


class TinyLM(torch.nn.Module):
    """A megatron-core module of tensor-parallel layers, called as slime calls its GPT model (model.py:624-639)."""

    def __init__(self, config: Any):
        from megatron.core import tensor_parallel
        from megatron.core.enums import ModelType

        super().__init__()
        self.config = config
        self.model_type = ModelType.encoder_or_decoder  # what slime's get_model builds (model.py:293)
        init = torch.nn.init.zeros_
        self.embedding = tensor_parallel.VocabParallelEmbedding(VOCAB, HIDDEN, init_method=init, config=config)
        self.up = tensor_parallel.ColumnParallelLinear(
            HIDDEN, 2 * HIDDEN, config=config, init_method=init, bias=False, gather_output=False
        )
        self.down = tensor_parallel.RowParallelLinear(
            2 * HIDDEN, HIDDEN, config=config, init_method=init, bias=False, input_is_parallel=True, skip_bias_add=True
        )
        self.output_layer = tensor_parallel.ColumnParallelLinear(
            HIDDEN, VOCAB, config=config, init_method=init, bias=False, gather_output=False
        )

    def set_input_tensor(self, tensor: Any) -> None:  # megatron-core's schedules set the previous stage's output
        return None

    def forward(self, input_ids: torch.Tensor, packed_seq_params: Any, **_: Any) -> torch.Tensor:
        h = self.embedding(input_ids)  # [1, T, H]
        up, _ = self.up(h)
        down, _ = self.down(torch.tanh(up))
        h = h + down
        # a causal mix within each packed sequence (slime's THD layout, cu_seqlens): each token also sees the running
        # mean of its sequence's earlier tokens, so a logit depends on its prefix and never on another sample
        cu = packed_seq_params.cu_seqlens_q.long()
        lengths = cu[1:] - cu[:-1]
        starts = torch.repeat_interleave(cu[:-1], lengths, output_size=h.shape[1])
        position = torch.arange(h.shape[1], device=h.device) - starts + 1
        total = torch.cat([h.new_zeros(1, 1, h.shape[2]), h.cumsum(1)], dim=1)
        prefix = (total[:, 1:] - total[:, starts]) / position.to(h.dtype).view(1, -1, 1)
        logits, _ = self.output_layer(h + 0.5 * prefix)
        return logits


def full_weights(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embedding.weight": torch.randn(VOCAB, HIDDEN, generator=g),
        "up.weight": 0.3 * torch.randn(2 * HIDDEN, HIDDEN, generator=g),
        "down.weight": 0.3 * torch.randn(HIDDEN, 2 * HIDDEN, generator=g),
        "output_layer.weight": 0.3 * torch.randn(VOCAB, HIDDEN, generator=g),
    }


def _shard_dim(name: str) -> int:
    return 1 if name == "down.weight" else 0  # RowParallelLinear cuts its input dimension


def _shard(name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    return full.chunk(tp, dim=_shard_dim(name))[rank]


def build(args: Namespace, tp: int) -> tuple[list[Any], Any, Any]:
    """megatron-core's groups (TP ``tp``, the rest DP), the DDP-wrapped model from the seeded weights, megatron-core's
    optimizer and slime's scheduler."""
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from slime.backends.megatron_utils.model import get_optimizer_param_scheduler

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        tensor_model_parallel_size=tp,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        gradient_accumulation_fusion=False,
        calculate_per_token_loss=args.calculate_per_token_loss,  # slime passes its flag to megatron's config
    )
    module = TinyLM(config)
    rank = mpu.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, full in full_weights().items():
            module.get_parameter(name).copy_(_shard(name, full, tp, rank))
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module)
    fields = {f: getattr(args, f) for f in OptimizerConfig.__dataclass_fields__ if hasattr(args, f)}
    optimizer = get_megatron_optimizer(OptimizerConfig(**fields), [ddp])
    scheduler = get_optimizer_param_scheduler(args, optimizer)
    config.grad_scale_func = optimizer.scale_loss  # slime's train (model.py:749-767) sets these before the steps
    config.finalize_model_grads_func = finalize_model_grads
    return [ddp], optimizer, scheduler


def full_parameters(model: list[Any], tp: int) -> dict[str, torch.Tensor]:
    """The full weights, gathered over the TP group (identical on every rank)."""
    from megatron.core import parallel_state as mpu

    group = mpu.get_tensor_model_parallel_group()
    assert dist.get_world_size(group) == tp
    return {name: whole(param.data, group, _shard_dim(name)) for name, param in model[0].module.named_parameters()}


@dataclass
class StepRun:
    """What slime's step returned: per step its logged metrics (``reduce_train_step_metrics``) and grad norm, then the
    full parameters after the last step."""

    metrics: list[dict[str, float]]
    grad_norms: list[float]
    params: dict[str, torch.Tensor]


def run_steps(args: Namespace, tp: int, seed: int = 0) -> StepRun:
    """slime's ``train_one_step`` once per training step of one rollout (two optimizer steps)."""
    from slime.backends.megatron_utils.data import get_data_iterator
    from slime.backends.megatron_utils.loss import get_log_probs_and_entropy
    from slime.backends.megatron_utils.model import forward_only, train_one_step

    ARGS["args"] = args
    model, optimizer, scheduler = build(args, tp)
    data = rank_rollout(args, rollout(seed))
    iterator = get_data_iterator(data)
    # the trainer's log-probs, as slime's actor computes them before training (actor.py:357-372)
    current = forward_only(
        get_log_probs_and_entropy, args, model, iterator, data["num_microbatches"], use_rollout_top_p_replay=True
    )["log_probs"]
    for key in ("log_probs", "rollout_log_probs", "ref_log_probs"):
        offset = {"log_probs": "old_offset", "rollout_log_probs": "rollout_offset", "ref_log_probs": "ref_offset"}[key]
        data[key] = [c.detach() + d for c, d in zip(current, data[offset], strict=True)]
    for it in iterator:
        it.reset()
    for module in model:
        module.train()
    metrics, norms = [], []
    for step, (num_mbs, step_size) in enumerate(zip(data["num_microbatches"], data["global_batch_sizes"], strict=True)):
        logged, norm = train_one_step(args, 0, step, iterator, model, optimizer, scheduler, num_mbs, step_size)
        metrics.append(dict(logged))
        norms.append(float(norm))
    return StepRun(metrics, norms, full_parameters(model, tp))


def relative(a: torch.Tensor | float, b: torch.Tensor | float) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def assert_same_update(
    got: StepRun, want: StepRun, rtol: float = 1e-6, keys: tuple[str, ...] = ("loss",), floor: float = 0.0
) -> None:
    """The same loss (and ``keys``), grad norm per step and parameters after the steps, to ``rtol`` relative; the
    logged values relative to max(|value|, ``floor``) (a loss near 0 is a difference of larger terms)."""
    assert len(got.metrics) == len(want.metrics) == 2
    for step, (g, w) in enumerate(zip(got.metrics, want.metrics, strict=True)):
        for key in keys:
            assert abs(g[key] - w[key]) <= rtol * max(abs(w[key]), floor), (step, key, g[key], w[key])
    for step, (g, w) in enumerate(zip(got.grad_norms, want.grad_norms, strict=True)):
        assert relative(g, w) < rtol, (step, "grad_norm", g, w)
    for name, w in want.params.items():
        assert relative(got.params[name], w) < rtol, (name, relative(got.params[name], w))
