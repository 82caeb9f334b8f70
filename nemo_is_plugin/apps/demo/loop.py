"""The GRPO driver: warm start once, then every loss setting from the same warm-start weights, side by side.

One step (synchronous GRPO, as NeMo-RL's ``grpo_train``):

1. weight sync: the policy's unsharded weights go to the rollout worker;
2. rollout: ``prompts_per_step`` prompts x ``group_size`` samples; the engine's own log-probs are kept
   (``generation_logprobs``);
3. reward (exact match) and GRPO group advantages;
4. ``prev_logprobs`` from Megatron (fp32, TP=2) on the same tokens;
5. ``minibatches`` optimizer steps with the plugin's loss, built from the setting's ``loss_fn`` section.

The IS weights at every level are also computed for every batch with the plugin's ``is_weights`` (the loss itself
only reports its own level), so one plot compares exp(sum), sequence_mean, token and cumulative on the same tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from nemo_is_plugin.apps.demo import task
from nemo_is_plugin.apps.demo.level_stats import level_stats
from nemo_is_plugin.apps.demo.model import ModelShape
from nemo_is_plugin.apps.demo.records import RunRecords
from nemo_is_plugin.apps.demo.settings import DemoConfig, PhaseSection

DEFAULT_HEAD = 8  # score centering's head size for a setting without score_centering_top_k (half the vocabulary)

Hook = Callable[[str, dict[str, Any]], None]  # (event, payload): "phase", "step", "info"


@dataclass
class DemoResult:
    warm_start_reward: float
    final_reward: dict[str, float]
    rows: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    headline: dict[str, Any] = field(default_factory=dict)  # demo.summary.headline: the numbers the docs quote


def combine_minibatches(metrics: list[dict[str, float]]) -> dict[str, float]:
    """One row per step from the per-optimizer-step metrics: mean of additive metrics (equal-size minibatches),
    min / max of the extrema, then the derived statistics (std, ESS) via ``finalize_metrics``."""
    from nemo_is_plugin import finalize_metrics

    out: dict[str, float] = {}
    for key in metrics[0]:
        values = [m[key] for m in metrics if key in m]
        if key.endswith("_min"):
            out[key] = min(values)
        elif key.endswith("_max"):
            out[key] = max(values)
        else:
            out[key] = sum(values) / len(values)
    return finalize_metrics(out)


def head_size(loss_settings: dict[str, dict]) -> int:
    """The sampler head the rollout must return: the largest ``score_centering_top_k`` of the score-centering settings
    (a setting without one gets :data:`DEFAULT_HEAD`), 0 when no setting centres."""
    ks = [s.get("score_centering_top_k") or DEFAULT_HEAD for s in loss_settings.values() if s.get("score_centering")]
    return max(ks, default=0)


class GRPODemo:
    """Owns the workers for one run. ``run()`` returns a :class:`DemoResult` and fills ``records``."""

    def __init__(self, cfg: DemoConfig, loss_settings: dict[str, dict], records: RunRecords, hook: Hook) -> None:
        from nemo_is_plugin.apps.demo import workers

        self.cfg, self.settings, self.records, self.hook = cfg, loss_settings, records, hook
        longest = max(cfg.short_response_length(), *(p.response_length or 0 for _, p in cfg.phases()))
        m = cfg.model
        architecture = m.model_dump(exclude={"tensor_parallel", "micro_batch_tokens"})  # ModelShape's fields
        max_seq_len = cfg.num_digits + 2 + longest + 8
        self.shape = ModelShape(vocab_size=task.VOCAB_SIZE, max_seq_len=max_seq_len, **architecture)
        self.started_ray = workers.start_ray(cfg.ray_address)
        hook(
            "info",
            {
                "message": f"starting workers (Megatron TP={m.tensor_parallel} over gloo, "
                f"rollout {cfg.rollout.backend} {cfg.rollout.precision})"
            },
        )
        policy_kwargs = dict(
            seed=cfg.seed, lr=cfg.grpo.lr, max_grad_norm=cfg.grpo.max_grad_norm, micro_batch_tokens=m.micro_batch_tokens
        )
        self.policy = workers.PolicyGroup(self.shape, m.tensor_parallel, policy_kwargs, num_cpus=0.5)
        gpu = 1.0 if cfg.rollout.backend == "vllm" else 0.0
        self.rollout = workers.rollout_actor(
            self.shape,
            cfg.rollout.backend,
            cfg.rollout.precision,
            cfg.rollout.temperature,
            cfg.seed,
            num_cpus=0.5,
            num_gpus=gpu,
            top_k=head_size(loss_settings),
        )

    # ------------------------------------------------------------------ pieces
    def _sync(self) -> None:
        import ray

        ray.get(self.rollout.load_weights.remote(self.policy.call("full_state_dict")))

    def _generate(self, prompts: torch.Tensor, phase: PhaseSection, seed: int):
        import ray

        length = phase.response_length or self.cfg.short_response_length()
        return ray.get(self.rollout.generate.remote(prompts, length, phase.ignore_eos, seed))

    def evaluate(self, seed: int) -> float:
        """Mean exact-match reward of the current policy (one sample per prompt, short phase, fixed prompts)."""
        self._sync()
        prompts = task.make_prompts(self.cfg.eval.prompts, self.cfg.num_digits, torch.Generator().manual_seed(seed))
        tokens, *_ = self._generate(prompts, self.cfg.short.model_copy(update={"ignore_eos": False}), seed)
        return float(task.rewards(prompts, tokens).mean())

    def _step(self, name: str, phase_name: str, phase: PhaseSection, step: int, gen: torch.Generator) -> dict:
        t0 = time.perf_counter()
        self._sync()
        prompts = task.make_prompts(phase.prompts_per_step, self.cfg.num_digits, gen)
        prompts = prompts.repeat_interleave(phase.group_size, dim=0)  # groups are consecutive rows
        tokens, gen_lp, mask, head_ids, head_lp = self._generate(
            prompts, phase, seed=int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
        )
        t_rollout = time.perf_counter() - t0
        reward = task.rewards(prompts, tokens)
        adv = task.group_advantages(reward, phase.group_size)
        b, p = prompts.shape
        full = torch.cat([prompts, tokens], dim=1)
        prev = self.policy.call("score", full)  # [B, S], column j = log p(token j | < j)
        zeros = torch.zeros(b, p)
        data = {
            "input_ids": full,
            "token_mask": torch.cat([zeros, mask.float()], dim=1),
            "sample_mask": torch.ones(b),
            "advantages": adv[:, None].expand(b, full.shape[1]).contiguous(),
            "prev_logprobs": prev,
            "generation_logprobs": torch.cat([zeros, gen_lp], dim=1),
            "reference_policy_logprobs": prev,  # no reference model: KL penalty is 0 in every demo setting
        }
        if self.settings[name].get("score_centering"):  # the sampler's head, [B, S, k]: prompt rows empty (-inf)
            k = self.settings[name].get("score_centering_top_k") or DEFAULT_HEAD  # ranked: the top k are the first k
            head_ids, head_lp = head_ids[..., :k], head_lp[..., :k]
            data["rollout_topk_ids"] = torch.cat([torch.zeros(b, p, k, dtype=head_ids.dtype), head_ids], dim=1)
            data["rollout_topk_logprobs"] = torch.cat([torch.full((b, p, k), float("-inf")), head_lp], dim=1)
        t1 = time.perf_counter()
        metrics = self.policy.train(data, name, self.settings[name], self.cfg.grpo.minibatches)
        t_train = time.perf_counter() - t1
        self.records.rollouts(
            config=name,
            phase=phase_name,
            step=step,
            generation_logprobs=gen_lp,
            prev_logprobs=prev[:, p:],
            mask=mask,
            advantages=adv,
            rewards=reward,
        )
        row = {
            "config": name,
            "phase": phase_name,
            "step": step,
            "reward": float(reward.mean()),
            "response_length": float(mask.sum(1).float().mean()),
            "time_rollout_s": t_rollout,
            "time_train_s": t_train,
            **level_stats(prev[:, p:], gen_lp, mask),
            **combine_minibatches(metrics),
        }
        return row

    # ------------------------------------------------------------------ run
    def run(self) -> DemoResult:
        cfg = self.cfg
        t0 = time.perf_counter()
        ws = cfg.warm_start
        self.hook("phase", {"name": "warm start", "total": 1})
        self.policy.call("warm_start", ws.steps, ws.batch, cfg.num_digits, cfg.seed, ws.lr, ws.free_tail)
        self.policy.call("snapshot")
        warm = self.evaluate(seed=cfg.seed + 999)
        self.hook("step", {"message": f"warm-start reward {warm:.3f}"})
        result = DemoResult(warm_start_reward=warm, final_reward={})
        for phase_name, phase in cfg.phases():
            for name in self.settings:
                self.hook("phase", {"name": f"{name} [{phase_name}]", "total": phase.steps})
                self.policy.call("restore")
                gen = torch.Generator().manual_seed(cfg.seed * 1000 + 17)  # same prompts for every setting
                for step in range(phase.steps):
                    row = self._step(name, phase_name, phase, step, gen)
                    self.records.metrics_row(row)
                    result.rows.append(row)
                    self.hook("step", row)
                if phase_name == "short":
                    result.final_reward[name] = self.evaluate(seed=cfg.seed + 999)
                    self.hook("info", {"message": f"{name}: reward {warm:.3f} -> {result.final_reward[name]:.3f}"})
        result.seconds = time.perf_counter() - t0
        return result

    def shutdown(self) -> None:
        import ray

        for actor in [*self.policy.actors, self.rollout]:
            ray.kill(actor)
        if self.started_ray:
            ray.shutdown()


def run_demo(cfg: DemoConfig, loss_settings: dict[str, dict], hook: Hook | None = None) -> DemoResult:
    """Run the whole demo into ``cfg.output_dir``: metrics.jsonl/csv, rollouts.jsonl, summary.json."""
    import json

    records = RunRecords(cfg.output_dir)
    demo = None
    try:
        demo = GRPODemo(cfg, loss_settings, records, hook or (lambda *_: None))
        result = demo.run()
    finally:
        records.close()
        if demo is not None:
            demo.shutdown()
        else:
            import ray

            if ray.is_initialized():
                ray.shutdown()
    from nemo_is_plugin.apps.demo.summary import headline

    result.headline = headline(result.rows, records.dir, result.final_reward)
    summary = {
        "warm_start_reward": result.warm_start_reward,
        "final_reward": result.final_reward,
        "seconds": result.seconds,
        "headline": result.headline,
        "config": cfg.model_dump(),
    }
    (records.dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return result
