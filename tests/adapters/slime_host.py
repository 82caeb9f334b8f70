"""A model of how slime (THUDM/slime, commit 624b824a) calls its custom loss and TIS functions; slime itself cannot be
installed from the package registry, so the tests run the adapter through this model.

Written from slime's documented behaviour (not its code): a micro-batch is per-sample lists (``unconcat_tokens`` of
prompt + response, ``total_lengths``, ``response_lengths``, whole-response ``loss_masks``, CP-local ``advantages`` /
``log_probs`` / ``rollout_log_probs`` / ``ref_log_probs``, per-sample denominators ``rollout_mask_sums``); under
context parallelism each sample is cut into ``2 * cp`` chunks of ``ceil(L / (2 * cp))`` positions and rank r holds
chunks r and ``2 * cp - 1 - r``; ``sum_of_sample_mean(x) = sum_i sum_t x_it m_it / max(denom_i, 1)`` over the rank's
own tokens (``--calculate-per-token-loss``: ``sum_i sum_t x_it m_it``); ``loss_function`` rescales the custom loss by
``num_microbatches / step_global_batch_size * dp_cp_size`` (per-token loss: by ``cp_size``).

The sharding here is written position by position, independently of the adapter's ``ResponseShard``.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

SHARDED_KEYS = (
    "advantages",
    "log_probs",
    "rollout_log_probs",
    "ref_log_probs",
    "rollout_topk_token_ids",  # upstream slime's score-centering head (THUDM/slime 2e5cd7cd), [R_i, k] per sample
    "rollout_topk_log_probs",
)


def chunk_size(total: int, cp: int) -> int:
    return -(-total // (2 * cp))


def owner(total: int, response: int, pos: int, cp: int) -> int:
    """The CP rank holding response position ``pos`` (its logit sits at position prompt - 1 + pos)."""
    chunk = (total - response - 1 + pos) // chunk_size(total, cp)
    return chunk if chunk < cp else 2 * cp - 1 - chunk


def local_positions(total: int, response: int, rank: int, cp: int) -> list[int]:
    if cp == 1:
        return list(range(response))
    return [pos for pos in range(response) if owner(total, response, pos, cp) == rank]


def shard_logits(logits: torch.Tensor, totals: list[int], rank: int, cp: int) -> torch.Tensor:
    """This rank's ``[1, T_local, V]`` of the packed single-process logits ``[1, sum(totals), V]``."""
    if cp == 1:
        return logits
    parts, start = [], 0
    for total in totals:
        cs = chunk_size(total, cp)
        seg = logits[0, start : start + total]
        seg = torch.cat([seg, seg.new_zeros(2 * cp * cs - total, seg.shape[-1])])
        parts += [seg[rank * cs : (rank + 1) * cs], seg[(2 * cp - 1 - rank) * cs : (2 * cp - rank) * cs]]
        start += total
    return torch.cat(parts).unsqueeze(0)


def shard_vocab(logits: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    width = logits.shape[-1] // tp
    return logits[..., rank * width : (rank + 1) * width]


def local_batch(batch: dict[str, Any], rank: int, cp: int) -> dict[str, Any]:
    """The micro-batch a CP rank sees: per-token lists cut to its positions, masks and tokens whole."""
    out = dict(batch)
    for key in SHARDED_KEYS:
        if batch.get(key):
            out[key] = [
                x[local_positions(t, r, rank, cp)]
                for x, t, r in zip(batch[key], batch["total_lengths"], batch["response_lengths"])
            ]
    return out


def sum_of_sample_mean(batch: dict[str, Any], rank: int, cp: int, per_token: bool, masks=None):
    """slime's reducer over this rank's tokens (``masks``: replace the loss masks, as slime does after RS)."""
    masks = batch["loss_masks"] if masks is None else masks
    local = [
        m[local_positions(t, r, rank, cp)] for m, t, r in zip(masks, batch["total_lengths"], batch["response_lengths"])
    ]
    denoms = batch.get("rollout_mask_sums") or [m.sum() for m in batch["loss_masks"]]

    def reduce(x: torch.Tensor) -> torch.Tensor:
        total = x.new_zeros(())
        for x_i, m_i, d_i in zip(x.split([len(m) for m in local]), local, denoms):
            s = (x_i * m_i).sum()
            total = total + (s if per_token else s / torch.clamp_min(torch.as_tensor(d_i, dtype=x.dtype), 1))
        return total

    return reduce


def loss_function(
    entry,
    args: argparse.Namespace,
    batch: dict[str, Any],
    logits: torch.Tensor,
    *,
    num_microbatches: int,
    step_global_batch_size: int,
    rank: int = 0,
    cp: int = 1,
    dp: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """slime's ``loss_function`` with ``--loss-type custom_loss``: (rescaled loss, unscaled loss, metrics) of a rank
    that holds ``logits`` (already CP / TP sharded) and the single-process ``batch`` (sharded here)."""
    mine = local_batch(batch, rank, cp)
    reducer = sum_of_sample_mean(batch, rank, cp, args.calculate_per_token_loss)
    loss, metrics = entry(args, mine, logits, reducer)
    if args.calculate_per_token_loss:
        scaled = loss * cp
    else:
        scaled = loss * num_microbatches / step_global_batch_size * (dp * cp)
    return scaled, loss, metrics


def tis_call(entry, args, inputs: dict[str, Any], rank: int = 0, cp: int = 1):
    """slime's call of a TIS function on a rank: CP-local ``pg_loss`` and log-probs, whole masks."""
    totals, responses = inputs["total_lengths"], inputs["response_lengths"]
    positions = [local_positions(t, r, rank, cp) for t, r in zip(totals, responses)]
    pg = inputs["pg_loss"].split(list(responses))
    kwargs = dict(inputs)
    kwargs["pg_loss"] = torch.cat([x[p] for x, p in zip(pg, positions)])
    for key in ("train_log_probs", "rollout_log_probs"):
        kwargs[key] = [x[p] for x, p in zip(inputs[key], positions)]
    return entry(args=args, **kwargs)


def namespace(args: dict[str, Any], **overrides: Any) -> argparse.Namespace:
    """slime's args from a golden case's dict, as a custom-loss run: ``loss_type`` custom_loss, ``nemo_is`` set."""
    values = {**args, "loss_type": "custom_loss", "nemo_is": {}, **overrides}
    return argparse.Namespace(**values)
