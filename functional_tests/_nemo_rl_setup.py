"""NeMo-RL's own GRPO ``setup`` run up to the loss it builds, in a fresh interpreter (the test starts it as NeMo-RL
would start its driver, with or without the plugin's start-up hook); prints one ``RESULT`` JSON line.

    python _nemo_rl_setup.py <scratch dir> '<loss_fn section as JSON>' <path> ...   (paths put first on sys.path)

``nemo_rl.algorithms.grpo.setup`` (NVIDIA-NeMo/RL @7ea279ab) runs as written -- seed, logger, checkpoint manager,
dataloader, the fused-path checks, the loss at grpo.py:695, the force-on-policy checks -- until its compute-cluster
section, whose first call (``extract_necessary_env_names``, grpo.py:728) is replaced by one that stops the run; the
loss is then read from ``setup``'s frame. The master config is NeMo-RL's ``MasterConfig`` with its ``loss_fn``
validated by the class ``MasterConfig`` declares for it (``ClippedPGLossConfig``: extra keys allowed, as from a YAML);
the other sections hold what ``setup`` reads before the cluster. The same section then goes through the names the
single-controller setup (single_controller_utils/setup.py:787) and PPO (ppo.py:476) build their loss with, and the
built loss is pickled and unpickled as Ray ships it to the workers. Losses on one batch: the built one, NeMo-RL's own
``ClippedPGLossFn`` (the section without ``name``) and, where the plugin imports, its ``NeMoRLLossFn``.
"""

import json
import os
import pickle
import sys
import traceback

sys.path[:0] = sys.argv[3:]

import torch  # noqa: E402
from host_shims import nemo_rl_setup  # noqa: E402

nemo_rl_setup.install()

from nemo_rl.algorithms import grpo, ppo  # noqa: E402
from nemo_rl.algorithms.loss import loss_functions  # noqa: E402
from nemo_rl.algorithms.single_controller_utils import setup as single_controller  # noqa: E402

SCRATCH, SECTION = sys.argv[1], json.loads(sys.argv[2])


class StopAtCluster(Exception):
    pass


def _stop(*args, **kwargs):
    raise StopAtCluster


def master_config(section: dict) -> grpo.MasterConfig:
    loss_config = grpo.MasterConfig.model_fields["loss_fn"].annotation.model_validate(section)
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": None}
    return grpo.MasterConfig.model_construct(
        policy={
            "generation": {
                **sampling,
                **{f"val_{k}": v for k, v in sampling.items()},
                "backend": "megatron",
                "colocated": {"enabled": True},
            },
            "megatron_cfg": {"enabled": False},
            "sequence_packing": {"enabled": False},
            "train_global_batch_size": 8,
        },
        loss_fn=loss_config,
        env={},
        data={"use_multiple_dataloader": False, "shuffle": False, "num_workers": 0},
        grpo=grpo.GRPOConfig(num_prompts_per_step=2, num_generations_per_prompt=4, val_period=0, seed=7),
        logger={
            "log_dir": os.path.join(SCRATCH, "logs"),
            **dict.fromkeys(("wandb_enabled", "swanlab_enabled", "tensorboard_enabled", "mlflow_enabled"), False),
            "wandb": {},
            "monitor_gpus": False,
            "gpu_monitoring": {"collection_interval": 10, "flush_interval": 10},
        },
        cluster={"num_nodes": 1, "gpus_per_node": 1},
        checkpointing={
            "enabled": False,
            "checkpoint_dir": os.path.join(SCRATCH, "checkpoints"),
            "metric_name": None,
            "higher_is_better": True,
            "keep_top_k": 1,
            "save_period": 1,
            "save_optimizer": False,
        },
        reward_penalties=grpo.RewardPenaltyConfig(),
    )


def loss_built_by_setup(config: grpo.MasterConfig):
    grpo.extract_necessary_env_names = _stop
    prompts = [{"idx": i} for i in range(4)]
    try:
        grpo.setup(config, tokenizer=None, dataset=prompts, val_dataset=None)
    except StopAtCluster:
        frames = [f for f, _ in traceback.walk_tb(sys.exc_info()[2]) if f.f_code is grpo.setup.__code__]
        return frames[0].f_locals["loss_fn"]
    raise AssertionError("grpo.setup did not reach its cluster section")


def batch_loss(loss_fn) -> float:
    g = torch.Generator().manual_seed(0)
    b, s = 4, 7
    data = {
        "token_mask": torch.ones(b, s),
        "sample_mask": torch.ones(b),
        "advantages": torch.randn(b, s, generator=g),
        "prev_logprobs": -torch.rand(b, s, generator=g),
        "generation_logprobs": -torch.rand(b, s, generator=g),
        "reference_policy_logprobs": -torch.rand(b, s, generator=g),
    }
    data["token_mask"][1, 5:] = 0
    x = -torch.rand(b, s - 1, generator=g, dtype=torch.float32)
    counts = {"global_valid_seqs": torch.tensor(4.0), "global_valid_toks": data["token_mask"][:, 1:].sum()}
    loss, _ = loss_fn(next_token_logprobs=x, data=data, **counts)
    return float(loss)


def kind(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


config = master_config(SECTION)
built = loss_built_by_setup(config)
out = {
    "built": kind(built),
    "plugin_imported": "nemo_is_plugin" in sys.modules,  # before anything below could import it
    "single_controller": kind(single_controller.ClippedPGLossFn(config.loss_fn)),
    "ppo": kind(ppo.ClippedPGLossFn(config.loss_fn)),
    "unpickled": kind(pickle.loads(pickle.dumps(built))),
    "same_class_everywhere": grpo.ClippedPGLossFn
    is single_controller.ClippedPGLossFn
    is ppo.ClippedPGLossFn
    is loss_functions.ClippedPGLossFn,
    "loss": batch_loss(built),
    "nemo_rl_loss": batch_loss(
        loss_functions.ClippedPGLossFn(master_config({k: v for k, v in SECTION.items() if k != "name"}).loss_fn)
    ),
}
try:
    import nemo_is_plugin
    from nemo_is_plugin.adapters.nemo_rl import NeMoRLLossFn

    out["plugin_file"] = nemo_is_plugin.__file__
    out["plugin_loss"] = batch_loss(NeMoRLLossFn(config.loss_fn))
except ImportError as exc:
    out["plugin_loss"] = f"ImportError: {exc}"
print("RESULT " + json.dumps(out))
