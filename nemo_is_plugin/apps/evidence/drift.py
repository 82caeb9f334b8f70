"""Experiment 6 (docs/evidence.md, 6): drift of the trainer away from its sampler, with and without score centering.

A closed RL loop small enough for a CPU: a tiny autoregressive policy (an MLP over the previous token and the
position, :class:`TinyPolicy`) trained in fp32 with the plugin's :class:`~nemo_is_plugin.loss.ClippedPGLoss`, and a
rollout engine that is the *same weights* served in emulated low precision (the demo engine's layers,
:mod:`nemo_is_plugin.apps.demo.decoder`: W8A8 fp8 with bf16 outputs, or weight-only int4 with bf16 activations; the LM
head in bf16). Every step the engine is re-synced from the trainer, samples a fresh batch of B sequences of L tokens
(recording each token's log-prob q_y and its top-k head), and the trainer takes one optimiser step on it. The task:
reward = the share of positions whose token equals a fixed random target sequence, GRPO-normalised over the batch.

The measured drift is the trainer-sampler log-prob gap on the fresh rollouts before each update,
``gap = mean_t |log p_train(y_t) - log q(y_t)|`` over every generated token (p: the fp32 trainer, q: the engine's
recorded log-prob), step by step, for two base losses (:data:`BASE_LOSSES`: plain PG with IS off, where score
centering's calibration is f = 1; the demo's ``token_tis`` setting, f = min(r, 2)) with and without
``score_centering`` (top-k head k = :data:`TOP_K`; the head's log-probs and the label's from one log-softmax).
Conditions are paired: the same initial weights, target and sampling seed for each SC on / off pair, so the two
runs of a pair differ only by the term.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from nemo_is_plugin.apps.demo.decoder import _Linear, _round
from nemo_is_plugin.loss import ClippedPGLoss
from nemo_is_plugin.loss.mismatch_metrics import finalize_metrics
from nemo_is_plugin.loss.score_centering import label_and_head_logprobs

PRECISIONS = ("fp8", "int4")
TOP_K = 8
VOCAB = 16
LENGTH = 16
HIDDEN = 64
LR = 3e-3
BASE_LOSSES: dict[str, dict[str, object]] = {
    "plain": {"reference_policy_kl_penalty": 0.0, "use_importance_sampling_correction": False},
    "token_tis": {
        "reference_policy_kl_penalty": 0.0,
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 2,
    },
}
SC_METRICS = ("score_centering_drift", "score_centering_tail_ratio", "score_centering_share")


class TinyPolicy(torch.nn.Module):
    """logits(prev token, position) = W3 silu(W2 silu(W1 [onehot(prev); onehot(pos)])): [B, T] tokens -> [B, T, V]."""

    def __init__(self, vocab: int = VOCAB, length: int = LENGTH, hidden: int = HIDDEN, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.vocab, self.length = vocab, length
        d_in = vocab + length

        def init(out_f: int, in_f: int, scale: float) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.randn(out_f, in_f, generator=g) * scale / in_f**0.5)

        self.w1, self.w2, self.w3 = init(hidden, d_in, 2.0), init(hidden, hidden, 2.0), init(vocab, hidden, 3.0)

    def features(self, prev: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        onehot = torch.nn.functional.one_hot
        return torch.cat([onehot(prev, self.vocab), onehot(pos, self.length)], dim=-1).to(self.w1.dtype)

    def forward(self, prev: torch.Tensor) -> torch.Tensor:
        """``prev [B, T]``: the token before each position (BOS = token 0 at position 0)."""
        pos = torch.arange(prev.shape[1], device=prev.device).expand_as(prev)
        act = torch.nn.functional.silu
        return act(act(self.features(prev, pos) @ self.w1.t()) @ self.w2.t()) @ self.w3.t()


class Engine:
    """The trainer's weights served in ``precision`` by the demo engine's emulated layers (LM head in bf16)."""

    def __init__(self, policy: TinyPolicy, precision: str) -> None:
        self.policy, self.precision = policy, precision
        self.l1 = _Linear.make(policy.w1, precision)
        self.l2 = _Linear.make(policy.w2, precision)
        self.head = _Linear.make(policy.w3, "bf16")

    def logits(self, prev: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = self.policy.features(prev, pos).detach().float()
        act = torch.nn.functional.silu
        h = _round(act(self.l1(x)), self.precision)
        return self.head(_round(act(self.l2(h)), self.precision))

    @torch.no_grad()
    def sample(self, batch: int, top_k: int, generator: torch.Generator) -> Rollout:
        """B sequences of L tokens from BOS (token 0): tokens, q_y and the top-k head per token."""
        length = self.policy.length
        tokens = torch.zeros(batch, length + 1, dtype=torch.long)
        q = torch.zeros(batch, length)
        ids = torch.zeros(batch, length, top_k, dtype=torch.long)
        head = torch.full((batch, length, top_k), float("-inf"))
        for t in range(length):
            lp = torch.log_softmax(self.logits(tokens[:, t], torch.full((batch,), t)), dim=-1)
            y = torch.multinomial(lp.exp(), 1, generator=generator).squeeze(-1)
            tokens[:, t + 1] = y
            q[:, t] = lp.gather(-1, y[:, None]).squeeze(-1)
            top, idx = lp.topk(min(top_k, lp.shape[-1]), dim=-1)
            ids[:, t, : top.shape[-1]], head[:, t, : top.shape[-1]] = idx, top
        return Rollout(tokens, q, ids, head)


@dataclass
class Rollout:
    """``tokens [B, L+1]`` (BOS first), ``q [B, L]`` the engine's log-probs of tokens[:, 1:], the head
    ``ids`` / ``logprobs [B, L, k]``."""

    tokens: torch.Tensor
    q: torch.Tensor
    ids: torch.Tensor
    logprobs: torch.Tensor


def trainer_logprobs(policy: TinyPolicy, tokens: torch.Tensor) -> torch.Tensor:
    """The fp32 trainer's log-probs of tokens[:, 1:] (teacher forcing): [B, L+1] -> [B, L]."""
    logits = policy(tokens[:, :-1])
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def nemo_rl_batch(rollout: Rollout, advantages: torch.Tensor, prev: torch.Tensor) -> dict[str, torch.Tensor]:
    """The rollout in NeMo-RL's layout: [B, S] tensors with column 0 for BOS, the head [B, S, k] (BOS row empty)."""
    b, s = rollout.tokens.shape
    col0 = torch.zeros(b, 1)
    empty = torch.full((b, 1, rollout.ids.shape[-1]), float("-inf"))
    return {
        "input_ids": rollout.tokens,
        "token_mask": torch.cat([col0, torch.ones(b, s - 1)], dim=1),
        "sample_mask": torch.ones(b),
        "advantages": advantages[:, None].expand(b, s).contiguous(),
        "prev_logprobs": torch.cat([col0, prev], dim=1),
        "generation_logprobs": torch.cat([col0, rollout.q], dim=1),
        "reference_policy_logprobs": torch.cat([col0, prev], dim=1),
        "rollout_topk_ids": torch.cat([torch.zeros_like(rollout.ids[:, :1]), rollout.ids], dim=1),
        "rollout_topk_logprobs": torch.cat([empty, rollout.logprobs], dim=1),
    }


@dataclass
class DriftRun:
    """One (base loss, precision, score centering, seed) run: per step the gap, the mean reward and the loss's
    score-centering metrics (:data:`SC_METRICS`, empty lists without the term)."""

    base: str
    precision: str
    score_centering: bool
    seed: int
    gap: list[float]
    reward: list[float]
    metrics: dict[str, list[float]]


def run_condition(
    base: str,
    precision: str,
    score_centering: bool,
    *,
    steps: int,
    batch: int,
    seed: int,
    lr: float = LR,
    on_step: Callable[[int, TinyPolicy, Rollout], None] | None = None,
) -> DriftRun:
    """Train one condition for ``steps`` rollout batches; ``on_step(step, policy, rollout)`` sees each fresh rollout
    before the update (the test recomputes the gap from it)."""
    policy = TinyPolicy(seed=3 * seed)  # three streams per seed: weights, target, sampling
    target = torch.randint(0, VOCAB, (LENGTH,), generator=torch.Generator().manual_seed(3 * seed + 1))
    sampling = torch.Generator().manual_seed(3 * seed + 2)
    opt = torch.optim.Adam(policy.parameters(), lr=lr)
    cfg = dict(BASE_LOSSES[base], score_centering=score_centering)
    if score_centering:
        cfg["score_centering_top_k"] = TOP_K
    loss_fn = ClippedPGLoss(cfg)
    run = DriftRun(base, precision, score_centering, seed, [], [], {m: [] for m in SC_METRICS if score_centering})
    for step in range(steps):
        rollout = Engine(policy, precision).sample(batch, TOP_K, sampling)
        if on_step is not None:
            on_step(step, policy, rollout)
        reward = (rollout.tokens[:, 1:] == target).float().mean(-1)
        adv = (reward - reward.mean()) / (reward.std() + 1e-6)
        with torch.no_grad():
            prev = trainer_logprobs(policy, rollout.tokens)
        run.gap.append(float((prev - rollout.q).abs().mean()))
        run.reward.append(float(reward.mean()))
        data = nemo_rl_batch(rollout, adv, prev)
        # the label's and the head's log-probs from one log-softmax of the logits (what the loss's logits path does)
        curr, data["curr_topk_logprobs"] = label_and_head_logprobs(
            policy(rollout.tokens[:, :-1]), rollout.tokens[:, 1:], rollout.ids
        )
        opt.zero_grad(set_to_none=True)
        loss, metrics = loss_fn(curr, data, batch, float(batch * LENGTH))
        loss.backward()
        opt.step()
        if score_centering:
            final = finalize_metrics(metrics)
            for name in SC_METRICS:
                run.metrics[name].append(float(final[name]))
    return run


def step_count(precisions: Sequence[str] = PRECISIONS) -> int:
    """Progress messages :func:`run_drift` emits: one per (base, precision, SC) condition."""
    return len(BASE_LOSSES) * len(precisions) * 2


def run_drift(
    *,
    steps: int = 100,
    batch: int = 64,
    seeds: Sequence[int] = (0, 1, 2),
    precisions: Sequence[str] = PRECISIONS,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Every (base loss, precision, SC off / on) condition over ``seeds``; per condition the per-seed runs and the
    seed-mean gap per step. The JSON-ready result also holds the paired SC-minus-no-SC gap difference."""
    say = progress or (lambda _msg: None)
    conditions = []
    for base in BASE_LOSSES:
        for precision in precisions:
            for sc in (False, True):
                runs = [run_condition(base, precision, sc, steps=steps, batch=batch, seed=s) for s in seeds]
                conditions.append(
                    {
                        "base": base,
                        "precision": precision,
                        "score_centering": sc,
                        "runs": [asdict(r) for r in runs],
                        "gap_mean": torch.tensor([r.gap for r in runs], dtype=torch.float64).mean(0).tolist(),
                        "reward_mean": torch.tensor([r.reward for r in runs], dtype=torch.float64).mean(0).tolist(),
                    }
                )
                say(f"drift: {base}, {precision}, score centering {'on' if sc else 'off'}")
    return {
        "steps": steps,
        "batch": batch,
        "seeds": list(seeds),
        "top_k": TOP_K,
        "lr": LR,
        "vocab": VOCAB,
        "length": LENGTH,
        "conditions": conditions,
    }


def _windows(steps: int) -> list[tuple[int, int]]:
    """The first, middle and last fifth of the steps (the gap falls as the policy sharpens: one number hides it)."""
    w = max(1, steps // 5)
    mid = (steps - w) // 2
    return [(0, w), (mid, mid + w), (steps - w, steps)]


def headline(result: dict) -> dict:
    """Per (base, precision): the seed-mean gap over the first / middle / last fifth of the steps with and without
    SC, their paired difference (SC minus off, per seed, mean and standard error over seeds), the final reward, and
    the SC run's mean score_centering_drift / share."""
    out: dict = {}
    by_key = {(c["base"], c["precision"], c["score_centering"]): c for c in result["conditions"]}
    for (base, precision, sc), on in by_key.items():
        if not sc:
            continue
        off = by_key[(base, precision, False)]
        row: dict = {}
        for name, (a, b) in zip(("early", "mid", "late"), _windows(result["steps"])):
            g_off = torch.tensor([r["gap"][a:b] for r in off["runs"]], dtype=torch.float64).mean(1)
            g_on = torch.tensor([r["gap"][a:b] for r in on["runs"]], dtype=torch.float64).mean(1)
            diff = g_on - g_off
            se = float(diff.std() / len(diff) ** 0.5) if len(diff) > 1 else float("nan")
            row[f"gap_{name}_off"] = float(g_off.mean())
            row[f"gap_{name}_on"] = float(g_on.mean())
            row[f"gap_{name}_diff"] = float(diff.mean())
            row[f"gap_{name}_diff_se"] = se if se == se else 0.0  # one seed: no spread (JSON has no NaN)
        row["reward_last_off"] = off["reward_mean"][-1]
        row["reward_last_on"] = on["reward_mean"][-1]
        for m in ("score_centering_drift", "score_centering_share"):
            vals = [v for r in on["runs"] for v in r["metrics"][m]]
            row[f"{m}_mean"] = sum(vals) / len(vals)
        out[f"{base}/{precision}"] = row
    return out
