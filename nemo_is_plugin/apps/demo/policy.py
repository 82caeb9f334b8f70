"""The training engine: one tensor-parallel rank of the Megatron MoE policy.

Computes the log-probs the loss consumes (``prev_logprobs`` before the update, current log-probs during it) with
Megatron's vocab-parallel cross entropy in fp32, runs the supervised warm start, and applies the plugin's loss in a
NeMo-RL-shaped update: minibatches of one rollout batch, micro-batches inside each, global token / sequence counts
for normalisation, additive metrics summed over micro-batches.

Every TP rank receives the same batch and calls the same methods in the same order (the collectives inside the
model require it); the rank's tensor-parallel group is an explicit attribute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from nemo_is_plugin.apps.demo import model as mdl
from nemo_is_plugin.apps.demo.task import PAD, sft_batch
from nemo_is_plugin.distributed.parallel.data_parallel import combine_metrics

LossFn = Callable[..., tuple[torch.Tensor, dict[str, Any]]]
HEAD_IDS = "rollout_topk_ids"  # score centering's sampler head ids in the batch, [B, S, k]; with them the loss gets
HEAD_LOGPROBS = "curr_topk_logprobs"  # the trainer's log-probs at those ids, [B, S-1, k]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def owned_logits(shard: torch.Tensor, labels: torch.Tensor, head_ids: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """This rank's addend of the logits at the label and the head ids: ``[B, T, 1 + k]``, its own logit where it owns
    the id (the shard holds ids vocab_start .. vocab_start + V/TP - 1), 0 elsewhere; summed over TP, the full logits.

    Megatron's vocab_parallel_cross_entropy overwrites its input in place (logits - max, then exp), and the gather
    keeps its input for backward: the cross entropy gets its own copy of the shard (:meth:`MegatronPolicy.
    logprobs_and_head`)."""
    ids = torch.cat([labels[..., None], head_ids], dim=-1)
    local = ids - vocab_start
    owned = (local >= 0) & (local < shard.shape[-1])
    picked = shard.gather(-1, local.clamp(0, shard.shape[-1] - 1))
    return torch.where(owned, picked, torch.zeros_like(picked))


def vocab_parallel_head(
    owned: torch.Tensor, label_logprobs: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """Log-probs at the head ids ``[B, T, k]`` from the vocab-parallel pass that gave ``label_logprobs [B, T]``;
    ``owned``: :func:`owned_logits` of this rank's shard.

    The normaliser is the label's own: log Z = logit_label - log p_label (no second log-softmax, which would skew the
    tail ratio rho), so log p_v = logit_v - logit_label + log p_label. Logits at ids the rank does not own are summed in
    over TP by ``reduce`` (Megatron's reduce_from_tensor_model_parallel_region: all-reduce forward, identity backward,
    so each rank's shard gets the gradient of the ids it owns; identity at TP = 1). The gradient through log Z is the
    softmax, as through a log-softmax: d(logit_label - log p_label) = onehot - (onehot - softmax).
    """
    both = reduce(owned)
    # (logit_v - logit_label) + log p_label: at v = label exactly log p_label, bit for bit (the loss's
    # score_centering_sampled_in_head compares the two)
    return (both[..., 1:] - both[..., :1]) + label_logprobs[..., None]


class MegatronPolicy:
    """One TP rank. ``tp_group`` is the explicit tensor-parallel process group (None when TP=1)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        shape: mdl.ModelShape,
        *,
        seed: int,
        lr: float,
        max_grad_norm: float,
        micro_batch_tokens: int,
        master_addr: str = "127.0.0.1",
        master_port: int = 29555,
    ) -> None:
        torch.set_num_threads(1)
        mdl.init_distributed(rank, world_size, world_size, master_addr, master_port)
        from megatron.core import parallel_state

        self.rank, self.shape = rank, shape
        self.tp_size = world_size
        self.tp_group = parallel_state.get_tensor_model_parallel_group() if world_size > 1 else None
        self.model = mdl.build_gpt(shape, world_size, seed)
        self.lr, self.max_grad_norm, self.micro_batch_tokens = lr, max_grad_norm, micro_batch_tokens
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr, betas=(0.9, 0.99))
        self._snapshot: dict[str, torch.Tensor] | None = None

    # ------------------------------------------------------------------ log-probs
    def _pad(self, tokens: torch.Tensor) -> torch.Tensor:
        """Right-pad [B, S] so S divides by TP (sequence parallelism splits the sequence); pads come last, so the
        causal mask keeps them out of every real token's context."""
        extra = (-tokens.shape[1]) % self.tp_size
        return torch.nn.functional.pad(tokens, (0, extra), value=PAD) if extra else tokens

    def _micro_batches(self, batch: int, seq: int) -> list[slice]:
        size = max(1, self.micro_batch_tokens // max(seq, 1))
        return [slice(i, min(i + size, batch)) for i in range(0, batch, size)]

    def logprobs(self, tokens: torch.Tensor) -> torch.Tensor:
        """Log-probs of tokens[:, 1:] given their prefixes: [B, S] -> [B, S-1] fp32, differentiable.

        Uses megatron's vocab_parallel_cross_entropy on the [B, S, V/TP] logits shard: every TP rank gets the full,
        identical values.
        """
        return self.logprobs_and_head(tokens)[0]

    def logprobs_and_head(
        self, tokens: torch.Tensor, head_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`logprobs` and, with ``head_ids [B, S-1, k]``, the log-probs at those ids (score centering's
        ``curr_topk_logprobs``) from the same logits shard and the same normaliser (:func:`vocab_parallel_head`)."""
        from megatron.core import tensor_parallel

        s = tokens.shape[1]
        padded = self._pad(tokens)
        sp = padded.shape[1]
        mask = torch.ones(sp, sp, dtype=torch.bool).triu(1)[None, None]  # True = masked (Megatron convention)
        pos = torch.arange(sp).expand_as(padded)
        logits = self.model(padded, pos, mask)  # [B, Sp, V/TP]
        target = padded[:, 1:s]
        shard = logits[:, : s - 1].float().contiguous()
        rank = self.rank if self.tp_size > 1 else 0
        if head_ids is None:
            return -tensor_parallel.vocab_parallel_cross_entropy(shard, target), None
        owned = owned_logits(shard, target, head_ids, rank * shard.shape[-1])
        # the cross entropy overwrites its input in place: a copy, so the gather's saved shard stays intact
        label = -tensor_parallel.vocab_parallel_cross_entropy(shard.clone(), target)
        reduce = tensor_parallel.reduce_from_tensor_model_parallel_region if self.tp_size > 1 else _identity
        return label, vocab_parallel_head(owned, label, reduce)

    @torch.no_grad()
    def score(self, tokens: torch.Tensor) -> torch.Tensor:
        """``prev_logprobs`` in NeMo-RL layout: [B, S] with column 0 = 0 and column j = log p(token_j | <j)."""
        self.model.eval()
        out = torch.zeros(tokens.shape, dtype=torch.float32)
        for sl in self._micro_batches(tokens.shape[0], tokens.shape[1]):
            out[sl, 1:] = self.logprobs(tokens[sl])
        return out

    # ------------------------------------------------------------------ optimisation
    def _step(self) -> float:
        mdl.allreduce_sequence_parallel_grads(self.model, self.tp_group)
        norm = mdl.grad_norm(self.model, self.tp_group)
        if self.max_grad_norm and norm > self.max_grad_norm:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(self.max_grad_norm / (norm + 1e-6))
        self.optimizer.step()
        return norm

    def warm_start(self, steps: int, batch: int, num_digits: int, seed: int, lr: float, tail: int = 0) -> list[float]:
        """Supervised warm start on correct answers (token-mean NLL); returns the loss per step."""
        gen = torch.Generator().manual_seed(seed)  # same stream on every rank -> same batches
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        losses = []
        self.model.train()
        for _ in range(steps):
            tokens, loss_mask = sft_batch(batch, num_digits, gen, tail)
            self.optimizer.zero_grad(set_to_none=True)
            lp = self.logprobs(tokens)
            m = loss_mask[:, 1:].float()
            loss = -(lp * m).sum() / m.sum()
            loss.backward()
            self._step()
            losses.append(float(loss.detach()))
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        return losses

    def train(self, data: dict[str, torch.Tensor], loss_fn: LossFn, minibatches: int) -> list[dict[str, float]]:
        """One GRPO update on a rollout batch: ``minibatches`` optimizer steps over its consecutive slices.

        ``data`` holds NeMo-RL's [B, S] tensors (input_ids, token_mask, advantages, prev_logprobs,
        generation_logprobs, reference_policy_logprobs), sample_mask [B] and, for a score-centering setting, the
        sampler head rollout_topk_ids / rollout_topk_logprobs [B, S, k]. Returns one metrics dict per optimizer
        step (additive metrics summed over micro-batches, plus grad_norm).
        """
        self.model.train()
        b = data["input_ids"].shape[0]
        per = b // minibatches
        out = []
        for k in range(minibatches):
            mb = {key: v[k * per : (k + 1) * per] for key, v in data.items()}
            # NeMo-RL normalisers: sequences and response tokens (after the [:, 1:] shift) in the whole minibatch
            valid_seqs = mb["sample_mask"].sum().float()
            valid_toks = (mb["token_mask"][:, 1:] * mb["sample_mask"][:, None]).sum().float()
            self.optimizer.zero_grad(set_to_none=True)
            per_micro = []
            for sl in self._micro_batches(per, mb["input_ids"].shape[1]):
                micro = {key: v[sl] for key, v in mb.items()}
                curr, head = self.logprobs_and_head(
                    micro["input_ids"], micro[HEAD_IDS][:, 1:] if HEAD_IDS in micro else None
                )
                if head is not None:  # a score-centering setting: the loss reads the trainer's head log-probs here
                    micro[HEAD_LOGPROBS] = head
                loss, m = loss_fn(
                    next_token_logprobs=curr, data=micro, global_valid_seqs=valid_seqs, global_valid_toks=valid_toks
                )
                loss.backward()
                per_micro.append(m)
            metrics = combine_metrics(per_micro)  # the plugin's rule: sums, min / max for *_min / *_max
            metrics["grad_norm"] = self._step()
            out.append(metrics)
        return out

    # ------------------------------------------------------------------ state
    def snapshot(self) -> None:
        """Remember the current (warm-start) weights; :meth:`restore` returns to them with a fresh optimizer."""
        self._snapshot = {
            k: v.detach().clone() for k, v in self.model.state_dict().items() if isinstance(v, torch.Tensor)
        }

    def restore(self) -> None:
        assert self._snapshot is not None, "snapshot() first"
        self.model.load_state_dict(self._snapshot, strict=False)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=self.lr, betas=(0.9, 0.99))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return mdl.full_state_dict(self.model, self.tp_group)
