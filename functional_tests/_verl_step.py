"""verl 0.9.1's own actor update, run in process on gloo ranks: one ``TrainingWorker`` per run, its
``train_mini_batch`` -> ``BaseEngine.train_batch`` -> the engine's ``forward_backward_batch`` -> ``ppo_loss``
(``verl/workers/utils/losses.py``) -> ``get_policy_loss_fn(actor.policy_loss.loss_mode)``.

The worker is built as verl's ``ActorRolloutRefWorker`` builds its actor (``verl/workers/engine_workers.py``,
"build actor model": ``TrainingWorkerConfig`` from the actor's engine / optimizer config, the loss
``partial(ppo_loss, config=actor_config)``), and fed what verl's trainer sends (``RayPPOTrainer._update_actor``,
``verl/trainer/ppo/ray_trainer.py``: the padded batch through ``left_right_2_no_padding``, ``mini_batch_size`` =
``global_batch_size`` = the mini-batch's rows, no shuffle), each rank its DP chunk as verl's dispatch deals it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _ranks import whole
from host_shims import verl as verl_shims
from host_shims.plugin_settings import CTPO

# Global batch: ROWS sequences of PROMPT + RESPONSE tokens; two mini-batches (two optimizer steps) of ROWS // 2 rows.
ROWS, PROMPT, RESPONSE = 8, 6, 8
MINI_BATCH = ROWS // 2
MICRO_BATCH_PER_RANK = 1
VOCAB = 256
MODEL_DIR_ENV = "NEMO_IS_VERL_STEP_DIR"


def setup_rank(rank: int, world_size: int) -> None:
    """verl's CPU platform and the environment ``Worker.__init__`` reads (``verl/single_controller/base/worker.py``)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "0")
    verl_shims.register_cpu_platform()


def model_dir(tied: bool = False) -> Path:
    """The tiny random model (its LM head tied to the embedding with ``tied``), written once by rank 0 into
    ``$NEMO_IS_VERL_STEP_DIR`` (the test module's temporary directory; the same bytes for every run)."""
    root = Path(os.environ[MODEL_DIR_ENV]) / ("tiny_qwen2_tied" if tied else "tiny_qwen2")
    if dist.get_rank() == 0 and not (root / "config.json").exists():
        verl_shims.tiny_model_dir(root, vocab_size=VOCAB, tied=tied)
    dist.barrier()
    return root


def global_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """The padded batch verl's trainer holds before ``_update_actor``: left-padded prompts, right-padded responses,
    old / rollout log-probs near the tiny model's (about -log V), per-sequence advantages."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (ROWS, PROMPT + RESPONSE), generator=g)
    prompt_len = torch.randint(2, PROMPT + 1, (ROWS,), generator=g)
    response_len = torch.randint(1, RESPONSE + 1, (ROWS,), generator=g)
    response_len[0] = RESPONSE
    attention_mask = torch.zeros(ROWS, PROMPT + RESPONSE, dtype=torch.long)
    for i in range(ROWS):
        attention_mask[i, PROMPT - int(prompt_len[i]) : PROMPT + int(response_len[i])] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    response_mask = attention_mask[:, PROMPT:].clone()
    old = -math.log(VOCAB) + 0.3 * torch.randn(ROWS, RESPONSE, generator=g)
    rollout = old + 0.15 * torch.randn(ROWS, RESPONSE, generator=g)
    advantages = torch.randn(ROWS, 1, generator=g).expand(ROWS, RESPONSE).contiguous()
    return {
        "input_ids": input_ids,
        "prompts": input_ids[:, :PROMPT],
        "responses": input_ids[:, PROMPT:],
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": response_mask,
        "old_log_probs": old * response_mask,
        "rollout_log_probs": rollout * response_mask,
        "advantages": advantages * response_mask,
    }


@dataclass
class StepResult:
    """What verl's ``train_mini_batch`` returned (metrics, as verl's trainer receives them) and the parameters after."""

    metrics: dict[str, Any]
    params: dict[str, torch.Tensor] = field(repr=False)


def actor_config(strategy: str, loss_mode: str, nemo_is: dict | None, **actor_keys):
    """verl's ``ActorConfig`` for the engine (``FSDPActorConfig`` / ``McoreActorConfig``) with its policy-loss
    section; ``nemo_is`` the plugin's section (``nemo_is_plugin.adapters.verl.hydra.PolicyLossConfig``)."""
    from verl.workers.config.actor import FSDPActorConfig, McoreActorConfig

    from nemo_is_plugin.adapters.verl.hydra import PolicyLossConfig

    cls = McoreActorConfig if strategy == "megatron" else FSDPActorConfig
    keys = dict(
        strategy=strategy,
        rollout_n=1,
        ppo_mini_batch_size=MINI_BATCH,
        ppo_micro_batch_size_per_gpu=MICRO_BATCH_PER_RANK,
        use_dynamic_bsz=False,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        loss_agg_mode="token-mean",
        entropy_coeff=0.0,
        use_kl_loss=False,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode, nemo_is=nemo_is),
    )
    keys.update(actor_keys)
    return cls(**keys)


def run_step(
    engine: str,
    *,
    loss_mode: str = "vanilla",
    nemo_is: dict | None = None,
    remove_padding: bool = True,
    model_keys: dict | None = None,
    engine_keys: dict | None = None,
    rollout_is_weights: bool = False,
    optim_keys: dict | None = None,
    seed: int = 0,
    tied: bool = False,
) -> StepResult:
    """Two optimizer steps of verl's actor update on this rank's DP chunk of ``global_batch(seed)``."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import HFModelConfig
    from verl.workers.engine_workers import TrainingWorker, TrainingWorkerConfig
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding

    model_config = HFModelConfig(
        path=str(model_dir(tied)),
        use_remove_padding=remove_padding,
        override_config={"attn_implementation": "sdpa"},
        **(model_keys or {}),
    )
    config = actor_config(
        "megatron" if engine == "megatron" else engine,
        loss_mode,
        nemo_is,
        **_actor_engine_keys(engine, engine_keys, optim_keys),
    )
    config.model_config = model_config
    worker_config = TrainingWorkerConfig(
        model_type="language_model",
        model_config=model_config,
        engine_config=config.engine,
        optimizer_config=config.optim,
        checkpoint_config=config.checkpoint,
    )
    worker_config.engine_config.use_dynamic_bsz = False
    worker_config.engine_config.micro_batch_size_per_gpu = MICRO_BATCH_PER_RANK
    worker_config.engine_config.infer_micro_batch_size_per_gpu = MICRO_BATCH_PER_RANK
    worker_config.engine_config.use_remove_padding = remove_padding
    worker = TrainingWorker(config=worker_config)
    worker.reset()
    worker.set_loss_fn(partial(ppo_loss, config=config))

    batch = global_batch(seed)
    if rollout_is_weights:
        log_w = (batch["old_log_probs"] - batch["rollout_log_probs"]).clamp(-20, 20)
        batch["rollout_is_weights"] = log_w.exp() * batch["response_mask"]
    dp_rank, dp_size = worker.engine.get_data_parallel_rank(), worker.engine.get_data_parallel_size()
    rows = slice(dp_rank * ROWS // dp_size, (dp_rank + 1) * ROWS // dp_size)
    td = TensorDict({k: v[rows] for k, v in batch.items()}, batch_size=[ROWS // dp_size])
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(
        td,
        temperature=1.0,
        calculate_entropy=False,
        distillation_use_topk=False,
        distillation_only=False,
        global_batch_size=MINI_BATCH,
        mini_batch_size=MINI_BATCH,
        epochs=1,
        seed=42,
        dataloader_kwargs={"shuffle": False},
        compute_loss=True,
    )
    output = worker.train_mini_batch(td)
    metrics = tu.get(output, "metrics") if output is not None else {}
    params = _full_params(worker.engine)
    del worker
    return StepResult(metrics=dict(metrics), params=params)


def _actor_engine_keys(engine: str, engine_keys: dict | None, optim_keys: dict | None = None) -> dict:
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, McoreEngineConfig, McoreOptimizerConfig

    optim = dict(lr=1e-2, clip_grad=1.0, weight_decay=0.0, **(optim_keys or {}))
    if engine == "megatron":
        engine_config = McoreEngineConfig(forward_only=False, dtype="bfloat16", **(engine_keys or {}))
        verl_shims.megatron_fp32(engine_config)
        keys = dict(megatron=engine_config, optim=McoreOptimizerConfig(**optim, lr_decay_steps=10))
    else:
        keys = dict(
            fsdp_config=FSDPEngineConfig(
                forward_only=False,
                strategy=engine,
                dtype="float32",
                model_dtype="fp32",
                use_torch_compile=False,
                **(engine_keys or {}),
            ),
            optim=FSDPOptimizerConfig(**optim),
        )
    return keys


def _full_params(engine) -> dict[str, torch.Tensor]:
    """Every parameter, gathered whole (FSDP2's DTensor shards; Megatron's TP shards stay per rank)."""
    out = {}
    module = engine.module
    modules = module if isinstance(module, list) else [module]
    for i, m in enumerate(modules):
        for name, p in m.named_parameters():
            out[f"{i}.{name}"] = whole(p).detach().clone().float()
    return out


def assert_same_update(a: StepResult, b: StepResult, rtol: float = 1e-6) -> None:
    """The same loss and grad norm (on the ranks verl returns metrics from: its ``is_mp_src_rank_with_outputs``;
    relative ``rtol``, with ``rtol`` as the absolute floor for values below 1) and the same parameters after the two
    optimizer steps (this rank's, each within ``rtol`` of its largest entry)."""
    errors = []
    for key in ("loss", "grad_norm"):
        if key not in a.metrics and key not in b.metrics:
            continue
        va, vb = _as_list(a.metrics[key]), _as_list(b.metrics[key])
        if len(va) != len(vb) or not all(math.isclose(x, y, rel_tol=rtol, abs_tol=rtol) for x, y in zip(va, vb)):
            errors.append(f"{key}: {va} != {vb}")
    assert a.params.keys() == b.params.keys()
    for name, p in a.params.items():
        q = b.params[name]
        scale = p.abs().max().item() + 1e-12
        err = (p - q).abs().max().item()
        if err > rtol * scale:
            errors.append(f"{name}: max |diff| {err:.3e} against max |p| {scale:.3e}")
    assert not errors, "\n".join(errors)
    assert a.params


def _as_list(value) -> list[float]:
    if isinstance(value, list | tuple):
        return [float(v) for v in value]
    return [float(value)]


# ------------------------------------------------------------------------------------------- the plugin's settings

# The plugin's own settings, each through verl's config (``policy_loss.nemo_is``); ``weights``: verl passes raw token
# ratios as ``rollout_is_weights`` (docs/verl.md, "Who owns the rollout correction"), from which the plugin recovers
# log mu. Each with the metric names docs/verl.md documents for it (beyond the plugin's ``actor/nemo_is/`` set).
NO_KL = {"reference_policy_kl_penalty": 0.0}
OWN_SETTINGS: dict[str, tuple[dict, tuple[str, ...]]] = {
    "seqmean_is_tis": (
        {
            **NO_KL,
            "use_importance_sampling_correction": True,
            "is_correction_level": "sequence_mean",
            "truncated_importance_sampling_type": "tis",
            "truncated_importance_sampling_ratio": 1.05,
        },
        (
            "rollout_corr/rollout_is_mean",
            "rollout_corr/rollout_is_eff_sample_size",
            "rollout_corr/rollout_is_seq_max_micro_batch_mean",
            "rollout_corr/kl",
            "rollout_corr/chi2_seq",
            "actor/nemo_is/is_weight_mean",
            "actor/nemo_is/is_weight_max_micro_batch_mean",
        ),
    ),
    "ctpo": (
        {
            **NO_KL,
            **CTPO,
            "use_importance_sampling_correction": True,
            "is_correction_level": "sequence_mean",
            "truncated_importance_sampling_type": "tis",
            "truncated_importance_sampling_ratio": 5.0,
        },
        ("rollout_corr/rollout_is_mean", "actor/pg_clipfrac", "actor/ppo_kl", "actor/nemo_is/clip_fraction"),
    ),
    "m2po": (
        {**NO_KL, "policy_objective": "m2po", "m2po_budget": 0.04},
        (
            "actor/nemo_is/m2po_m2",
            "actor/nemo_is/m2po_m2_after",
            "actor/nemo_is/m2po_harmful_fraction",
            "actor/nemo_is/m2po_clip_high_max_micro_batch_mean",
            "actor/nemo_is/m2po_clip_low_min_micro_batch_mean",
        ),
    ),
    "rejection_prob_diff": (
        {
            **NO_KL,
            "use_importance_sampling_correction": True,
            "importance_sampling_rejection_rules": [{"statistic": "prob_diff", "aggregation": "token", "max": 0.0005}],
        },
        ("actor/nemo_is/is_rejection_token_prob_diff_rejected_fraction", "actor/nemo_is/is_rejected_fraction"),
    ),
    "preset_decoupled_k3_rs_token_tis": (
        {**NO_KL, "rollout_correction": "decoupled_k3_rs_token_tis"},
        (
            "rollout_corr/rollout_rs_seq_mean_k3_mean",
            "rollout_corr/rollout_rs_masked_fraction",
            "rollout_corr/rollout_is_mean",
            "rollout_corr/rollout_is_ratio_fraction_high",
        ),
    ),
}


class LossSpy:
    """Counts and records the calls verl's ``ppo_loss`` makes to the plugin's registered loss (the class's
    ``__call__``, so the object verl fetched from its registry is the one observed)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __enter__(self) -> LossSpy:
        from nemo_is_plugin.adapters.verl.policy_loss import VerlPolicyLoss

        self._cls, self._orig = VerlPolicyLoss, VerlPolicyLoss.__call__
        spy = self

        def recording(obj, **kwargs):
            result = spy._orig(obj, **kwargs)
            spy.calls.append(
                {"inputs": {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}, "out": result}
            )
            return result

        VerlPolicyLoss.__call__ = recording  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc) -> None:
        self._cls.__call__ = self._orig  # type: ignore[method-assign]


def assert_metrics_reach_verl(result: StepResult, spy: LossSpy, documented: tuple[str, ...]) -> None:
    """Every metric the plugin's loss returned reaches verl's step metrics under its name, the documented ones
    included, one value per optimizer step, all finite; and nothing of verl's own step is non-finite."""
    returned = set().union(*(call["out"][1].keys() for call in spy.calls))
    if not result.metrics:  # not a rank verl collects metrics from (TP rank > 0 on the Megatron engine)
        assert not [n for n in result.params if not torch.isfinite(result.params[n]).all()]
        return
    missing = sorted((returned | set(documented)) - set(result.metrics))
    assert not missing, f"not in verl's metrics: {missing}"
    for name, value in result.metrics.items():
        values = _as_list(value)
        assert all(math.isfinite(v) for v in values), f"{name}: {values}"
        if name in returned:
            assert len(values) == 2, (name, values)  # one per optimizer step
    assert not [n for n in result.params if not torch.isfinite(result.params[n]).all()]
