"""NeMo-RL's DTensor v1 policy worker (``DTensorPolicyWorkerImpl``: its own ``__init__`` and ``train``) on CPU gloo
processes, with a tiny random Qwen2 model written to a folder (config, weights, tokenizer: nothing downloaded).

``run_steps(model_dir, world_size, tp, losses, batches)`` spawns ``world_size`` processes (tests/distributed/_spawn.py's
``run_checks`` with this module's one check); in each, for every loss in ``losses`` (built inside the worker process
from its description), a fresh worker is built from the same folder and ``train`` is called once per batch (one
optimizer step each: the global batch size is the batch). The driver's part of ``Policy.train``
(nemo_rl/models/policy/lm_policy.py, ``_shard_for_train`` and the aggregation of the workers' results) is done here
with NeMo-RL's own ``BatchedDataDict.shard_by_batch_size``. Returns, per loss: each step's
``global_loss``, ``grad_norm`` and the workers' ``all_mb_metrics`` concatenated over the DP ranks (what
``Policy.train`` returns), and the full parameters after the last step.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
from _ranks import gather_objects, publish, run_job, the_job, whole

from nemo_is_plugin.adapters.nemo_rl.step_metrics import NEMO_RL_EXTREMA

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, SEQ = 64, 32, 2, 4, 2, 12


def write_tiny_model(folder: Path, seed: int = 0) -> Path:
    """A random 2-layer Qwen2 (fp32) and a word-level tokenizer, saved as a Hugging Face model folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {f"t{i}": i for i in range(VOCAB - 2)} | {"<pad>": VOCAB - 2, "<eos>": VOCAB - 1}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=VOCAB - 2,
        eos_token_id=VOCAB - 1,
        bos_token_id=VOCAB - 1,
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def make_batch(seed: int, batch: int, noise: float = 0.3) -> dict[str, torch.Tensor]:
    """A GRPO training batch as the driver hands it to ``Policy.train`` (right-padded rows, a 3-token prompt).

    The old and generation log-probs sit near a uniform policy's (-log V) with independent noise, so the ratios clip
    and the IS weights vary; one sample is masked out and two rows are padded.
    """
    g = torch.Generator().manual_seed(seed)
    lengths = torch.full((batch,), SEQ, dtype=torch.long)
    lengths[1], lengths[batch - 2] = SEQ - 3, SEQ - 5
    positions = torch.arange(SEQ)
    in_row = positions[None, :] < lengths[:, None]
    token_mask = (in_row & (positions[None, :] >= 3)).float()
    base = -torch.log(torch.tensor(float(VOCAB)))
    prev = (base + noise * torch.randn(batch, SEQ, generator=g)) * in_row
    gen = (prev + noise * torch.randn(batch, SEQ, generator=g)) * in_row
    sample_mask = torch.ones(batch)
    sample_mask[3] = 0.0
    advantages = torch.randn(batch, 1, generator=g).expand(batch, SEQ).contiguous() * token_mask
    return {
        "input_ids": torch.randint(0, VOCAB - 2, (batch, SEQ), generator=g) * in_row + (VOCAB - 2) * ~in_row,
        "input_lengths": lengths,
        "token_mask": token_mask,
        "sample_mask": sample_mask,
        "advantages": advantages,
        "prev_logprobs": prev,
        "generation_logprobs": gen,
        "reference_policy_logprobs": prev + 0.05 * torch.randn(batch, SEQ, generator=g) * in_row,
    }


def policy_config(model_dir: str, tp: int, gbs: int, mbs: int) -> dict[str, Any]:
    """The ``policy`` keys the DTensor v1 worker reads (``__init__`` and ``train``), fp32, plain micro-batching."""
    return {
        "model_name": model_dir,
        "precision": "float32",
        "train_global_batch_size": gbs,
        "train_micro_batch_size": mbs,
        "max_grad_norm": 1.0,
        "offload_optimizer_for_logprob": False,
        "generation": None,
        "dtensor_cfg": {
            "cpu_offload": False,
            "tensor_parallel_size": tp,
            "context_parallel_size": 1,
            "sequence_parallel": False,
            "activation_checkpointing": False,
            "custom_parallel_plan": None,
        },
        "sequence_packing": {"enabled": False},
        "dynamic_batching": {"enabled": False},
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-2, "weight_decay": 0.01, "eps": 1e-8}},
    }


def build_loss(spec: dict[str, Any]) -> Any:
    """``{"host": "nemo_rl" | "plugin", "loss_fn": {...}}``: NeMo-RL's ``ClippedPGLossFn`` or the plugin's
    ``NeMoRLLossFn``, each given NeMo-RL's pydantic ``ClippedPGLossConfig`` built from the same section, as
    ``grpo.setup`` builds it (nemo_rl/algorithms/grpo.py). The plugin's takes ``"input_type"`` from the spec when
    given (``"logit"``: NeMo-RL's worker hands it the logits)."""
    from nemo_rl.algorithms.loss.loss_functions import ClippedPGLossConfig, ClippedPGLossFn

    config = ClippedPGLossConfig(**spec["loss_fn"])
    if spec["host"] == "nemo_rl":
        return ClippedPGLossFn(config)
    from nemo_is_plugin.adapters.nemo_rl import NeMoRLLossFn

    return NeMoRLLossFn(config, input_type=spec.get("input_type", "logprob"))


# What grpo_train averages instead of summing (nemo_rl/algorithms/grpo.py @7ea279ab, its metric reduction).
NEMO_RL_MEANS = {
    "lr",
    "wd",
    "reward",
    "filtered_reward",
    "global_valid_seqs",
    "global_valid_toks",
    "mean_prompt_length",
}


def nemo_rl_reduction(all_mb_metrics: dict[str, list[float]]) -> dict[str, float]:
    """A model of grpo_train's reduction of ``train_results["all_mb_metrics"]``: NeMo-RL's four extrema with min / max
    (infinities left out), the keys above averaged, every other key summed over the step's loss calls."""
    out = {}
    for k, v in all_mb_metrics.items():
        finite = [x for x in v if not math.isinf(x)]
        if k in NEMO_RL_EXTREMA:
            out[k] = (min if k.endswith("_min") else max)(finite) if finite else -1.0
        elif k in NEMO_RL_MEANS:
            out[k] = sum(v) / len(v)
        else:
            out[k] = sum(v)
    return out


def _to_plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.double().reshape(-1).tolist() if value.numel() != 1 else float(value)
    return value


def setup_workers(rank: int, world_size: int) -> None:
    """The environment NeMo-RL's worker group gives a worker (the DTensor worker reads ``LOCAL_RANK``; its
    ``init_process_group`` finds the harness's gloo group and keeps it, host_shims/nemo_rl.py), NeMo-RL on the path
    and the shims, before any of NeMo-RL's modules is imported."""
    import sys

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    sys.path.insert(0, the_job()["nemo_rl_path"])
    from host_shims import nemo_rl as shims

    shims.install()


def _train(rank: int, world_size: int) -> None:
    """Per loss of the job, a fresh worker trained on every batch; rank 0 publishes the results."""
    from host_shims import nemo_rl as shims
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    from nemo_rl.models.policy.workers.dtensor_policy_worker import DTensorPolicyWorkerImpl
    from transformers import AutoTokenizer

    job = the_job()
    tokenizer = AutoTokenizer.from_pretrained(job["model_dir"])
    cfg = policy_config(job["model_dir"], job["tp"], job["gbs"], job["mbs"])
    results = []
    for spec in job["losses"]:
        with shims.cpu_device():
            worker = DTensorPolicyWorkerImpl(cfg, tokenizer, init_reference_model=False)
        dp = worker.dp_size
        dp_rank = worker.dp_mesh.get_local_rank()
        loss_fn = build_loss(spec)
        steps = []
        for batch in job["batches"]:
            data = BatchedDataDict({k: torch.tensor(v) for k, v in batch.items()})
            shard = data.shard_by_batch_size(dp, batch_size=job["gbs"])[dp_rank]
            with shims.cpu_device():
                result = worker.train(BatchedDataDict(dict(shard)), loss_fn)
            mb_metrics: dict[str, list[Any]] = {}
            # one worker per DP rank (TP rank 0's), as Policy.train's output_is_replicated
            for tp_rank, metrics in gather_objects((worker.tp_mesh.get_local_rank(), result["all_mb_metrics"])):
                if tp_rank == 0:
                    for k, v in metrics.items():
                        mb_metrics.setdefault(k, []).extend(_to_plain(x) for x in v)
            steps.append(
                {
                    "global_loss": _to_plain(result["global_loss"]),
                    "grad_norm": _to_plain(result["grad_norm"]),
                    "all_mb_metrics": mb_metrics,
                }
            )
        params = {
            name: whole(tensor).detach().double().reshape(-1).tolist()
            for name, tensor in worker.model.state_dict().items()
        }
        results.append({"steps": steps, "params": params, "dp": dp})
        del worker
    publish("results", results)


CHECKS = [("train", _train)]


def run_steps(
    nemo_rl_path: str,
    model_dir: str,
    world_size: int,
    tp: int,
    losses: list[dict[str, Any]],
    batches: list[dict[str, torch.Tensor]],
    mbs: int,
) -> list[dict[str, Any]]:
    gbs = len(batches[0]["input_ids"])
    job = {
        "nemo_rl_path": nemo_rl_path,
        "model_dir": model_dir,
        "tp": tp,
        "gbs": gbs,
        "mbs": mbs,
        "losses": losses,
        "batches": [{k: v.tolist() for k, v in b.items()} for b in batches],
    }
    return run_job(__name__, world_size, job)
