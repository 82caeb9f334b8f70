"""Top-k / top-p filtered log-probs from hidden states (``distributed/head/filtered_head.py``), one process (TP = 2 with
sequence parallelism: tests/distributed/test_host_heads_tp.py), against a row-by-row float64 reference written from
NeMo-RL's documented filter (top-k: keep logits >= the k-th largest, ties kept; top-p after it: the kept logits sorted
ascending, softmax, keep where the cumulative sum exceeds 1 - p, and always the largest), with temperature:

- filtered log-probs (``-inf`` exactly where the target is filtered out), unfiltered ones, and the gradients of a loss
  on both (the mask constant) to 1e-12, over chunk sizes;
- a tie at the top-k threshold keeps every tied token; a tiny top-p keeps the largest only; bad arguments refused;
- NeMo-RL's drop-in returns ``(filtered, unfiltered)`` ``[B, S - 1]`` with the filter, one tensor without it.
"""

from __future__ import annotations

import pytest
import torch

from nemo_is_plugin.adapters.nemo_rl.head import from_parallel_hidden_states_to_logprobs
from nemo_is_plugin.distributed.head.filtered_head import filtered_linear_logprobs, filtering, keep_mask

N, H, V, T = 14, 8, 31, 0.8


def reference_keep(row: list[float], top_k: int | None, top_p: float | None) -> set[int]:
    """The kept token ids of one row of logits, written out with Python sorting."""
    keep = set(range(len(row)))
    if top_k:
        threshold = sorted(row, reverse=True)[top_k - 1]
        keep = {v for v in keep if row[v] >= threshold}
    if top_p is not None and top_p != 1.0:
        ascending = sorted(keep, key=lambda v: row[v])
        probs = torch.softmax(torch.tensor([row[v] for v in ascending], dtype=torch.float64), 0)
        cumulative = torch.cumsum(probs, 0).tolist()
        keep = {v for j, v in enumerate(ascending) if cumulative[j] > 1 - top_p or j == len(ascending) - 1}
    return keep


def reference(hidden, weight, target, top_k, top_p):
    """(filtered, unfiltered) log-probs by autograd-able float64 ops, the masks from :func:`reference_keep`."""
    z = hidden @ weight.t() / T
    masks = [[v in reference_keep(z[i].tolist(), top_k, top_p) for v in range(z.shape[1])] for i in range(z.shape[0])]
    keep = torch.tensor(masks)
    filtered = torch.log_softmax(torch.where(keep, z, float("-inf")), -1).gather(-1, target[:, None]).squeeze(-1)
    return filtered, torch.log_softmax(z, -1).gather(-1, target[:, None]).squeeze(-1)


def _problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64) * 0.4
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    target = torch.randint(0, V, (N,), generator=g)
    target[::2] = (hidden @ weight.t())[::2].argsort(-1, descending=True)[:, 1]  # half the targets near the top
    return hidden, weight, target, torch.randn(N, generator=g, dtype=torch.float64)


def _loss(filtered, unfiltered, coef):
    return (torch.where(torch.isfinite(filtered), filtered, 0.0) * coef).sum() + (unfiltered * coef.flip(0)).sum()


@pytest.mark.parametrize(("top_k", "top_p"), [(5, None), (None, 0.7), (8, 0.5), (1, None), (None, 0.999)])
@pytest.mark.parametrize("chunk", [3, None])
def test_filtered_and_unfiltered_log_probs_and_gradients_equal_the_reference(top_k, top_p, chunk):
    hidden, weight, target, coef = _problem()
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    got = filtered_linear_logprobs(h, w, target, top_k=top_k, top_p=top_p, temperature=T, chunk_size=chunk)
    got_grads = torch.autograd.grad(_loss(*got, coef), (h, w))
    hr, wr = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    want = reference(hr, wr, target, top_k, top_p)
    want_grads = torch.autograd.grad(_loss(*want, coef), (hr, wr))
    finite = torch.isfinite(want[0])
    if (top_k, top_p) in ((5, None), (None, 0.7), (8, 0.5)):
        assert 0 < int(finite.sum()) < N  # some targets filtered out, some kept
    assert torch.equal(torch.isfinite(got[0]), finite)
    torch.testing.assert_close(got[0][finite], want[0][finite], rtol=0, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-12)
    for g, r in zip(got_grads, want_grads):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-12)


def test_ties_at_the_top_k_threshold_are_kept_and_a_tiny_top_p_keeps_the_largest():
    z = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0], [0.0, 5.0, 1.0, 4.9, 2.0]], dtype=torch.float64)
    assert keep_mask(z, 2, None).tolist()[0] == [True, False, True, True, False]
    assert keep_mask(z, None, 1e-6).tolist() == [[True, False, False, False, False], [False, True, False, False, False]]
    assert keep_mask(z, 2, 0.6)[1].tolist() == [False, True, False, True, False]
    assert not filtering(None, 1.0) and not filtering(0, None) and filtering(3, None) and filtering(None, 0.9)
    with pytest.raises(ValueError, match="top_p must be in"):
        filtered_linear_logprobs(z[:, :2], z, torch.tensor([0, 1]), top_p=1.5)


def test_nemo_rl_drop_in_returns_filtered_and_unfiltered_with_the_filter():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(9, 2, H, generator=g, dtype=torch.float64) * 0.4
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (2, 9), generator=g)
    plain = from_parallel_hidden_states_to_logprobs(hidden, weight, None, labels, 0, V, None)
    filtered, unfiltered = from_parallel_hidden_states_to_logprobs(hidden, weight, None, labels, 0, V, None, top_k=4)
    assert filtered.shape == unfiltered.shape == plain.shape == (2, 8)
    torch.testing.assert_close(unfiltered, plain, rtol=0, atol=1e-12)
    flat_h, flat_t = hidden.permute(1, 0, 2)[:, :-1].reshape(-1, H), labels[:, 1:].reshape(-1)
    want = reference(flat_h * T, weight, flat_t, 4, None)[0].reshape(2, 8)  # temperature 1: undo reference's T
    assert torch.equal(torch.isfinite(filtered), torch.isfinite(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(filtered[finite], want[finite], rtol=0, atol=1e-12)
