"""Score-centering problems for the entry points' tests: a fused-path problem (tests/distributed/_fused_cases.py)
with a sampler head per position, and the float64 reference loss on a plain full log-softmax.

The sampler is the trainer's softmax with noise on its logits (so q differs from p and the term is not 0); its head
is q's top-k ids with q's log-probs at them; slots 1 and 2 of a few rows are padding the way samplers send it: id 0
with -inf (SkyRL's), id -1 with -inf. ``data`` holds the head at ``[B, S, k]``, column s the head of token s."""

from __future__ import annotations

import torch
from helpers.head_reference import head_reference

from nemo_is_plugin import build_loss_fn

from ._fused_cases import TIGHT_TIS, pg_problem

K = 6
CONFIGS = {
    "tis": dict(score_centering=True, **TIGHT_TIS),
    "icepop": dict(
        score_centering=True,
        score_centering_top_k=K,
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="icepop",
        truncated_importance_sampling_ratio=1.1,
        truncated_importance_sampling_ratio_min=0.9,
        reference_policy_kl_penalty=0.05,
        reference_policy_kl_type="k3",
    ),
    "no_is": dict(score_centering=True, loss_aggregation="seq-mean-token-mean"),
}


def centering_problem(dtype=torch.float32, seed=0, vocab=38):
    """``pg_problem`` plus ``rollout_topk_ids`` / ``rollout_topk_logprobs`` ``[B, S, K]`` in ``p.data``."""
    p = pg_problem(dtype=dtype, seed=seed, vocab=vocab)
    g = torch.Generator().manual_seed(200 + seed)
    logits = p.hidden.double() @ p.weight.double().t()  # [B, T, V]
    q = torch.log_softmax(logits + 0.7 * torch.randn(logits.shape, generator=g, dtype=torch.float64), -1)
    lps, ids = q.topk(K, dim=-1)
    ids[0, 2, 1], lps[0, 2, 1] = 0, float("-inf")  # SkyRL's padding
    ids[1, 3, 2], lps[1, 3, 2] = -1, float("-inf")  # a -1 id
    ids[1, 4, 1], lps[1, 4, 1] = -1, float("-inf")
    pad_ids, pad_lps = ids.new_zeros(ids.shape[0], 1, K), lps.new_full((lps.shape[0], 1, K), float("-inf"))
    p.data["rollout_topk_ids"] = torch.cat([pad_ids, ids], 1)
    p.data["rollout_topk_logprobs"] = torch.cat([pad_lps, lps], 1).float()
    return p


def reference(p, config: dict, temperature: float = 1.0):
    """float64 ``(loss, metrics, dX, dW)``: the label's and the head's log-probs gathered from one full log-softmax
    of ``hidden @ W^T / T`` (``helpers.head_reference``), then the plain loss on them."""
    h, w = p.hidden.double().requires_grad_(True), p.weight.double().requires_grad_(True)
    label, head = head_reference(h @ w.t() / temperature, p.target, p.data["rollout_topk_ids"][:, 1:])
    data = {k: v.double() if v.is_floating_point() else v for k, v in p.data.items()}
    data["curr_topk_logprobs"] = head
    loss, metrics = build_loss_fn(config)(label, data, p.global_valid_seqs, p.global_valid_toks)
    loss.backward()
    return loss.detach(), metrics, h.grad, w.grad


__all__ = ["CONFIGS", "K", "centering_problem", "reference"]
