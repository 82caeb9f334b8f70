"""Memory of the chunked log-prob kernel: what it saves for backward and its peak extra allocation.

The claim under test: the extra memory is O(chunk_size x V) plus O(N) per-token vectors, so with the chunk size fixed
it does not grow with the number of chunks (i.e. with the number of tokens N beyond the O(N) vectors), unlike a
log_softmax that keeps an [N, V] fp32 tensor for backward.
"""

from __future__ import annotations

import pytest
import torch

from nemo_is_plugin.distributed.head.vocab_parallel import vocab_parallel_logprobs

from ._memory import LiveStorageBytes, SavedTensorBytes

V = 128
CHUNK = 16
PER_TOKEN = 64  # generous bound, bytes per token, for the O(N) vectors (partials, lse, target ids, masks)


def _measure(n_tokens: int, chunk: int, dtype=torch.float32, with_entropy=False):
    g = torch.Generator().manual_seed(n_tokens)
    x = torch.randn(n_tokens, V, generator=g).to(dtype).requires_grad_(True)
    t = torch.randint(0, V, (n_tokens,), generator=g)
    saved = SavedTensorBytes(x)
    with LiveStorageBytes() as mem:
        with saved:
            out = vocab_parallel_logprobs(x, t, chunk_size=chunk, with_entropy=with_entropy)
        fwd_peak = mem.peak
        loss = sum(o.sum() for o in out) if with_entropy else out.sum()
        loss.backward()
    grad_bytes = x.grad.untyped_storage().nbytes()  # the gradient itself is an output, not overhead
    return {"saved": saved.nbytes, "fwd_peak": fwd_peak, "bwd_extra": mem.peak - grad_bytes}


def test_saved_tensors_are_per_token_vectors_only():
    n = 8 * CHUNK
    # lse fp32 + local target int64 + owned bool (+ entropy fp32): 13 (17) bytes a token, whatever the chunk size
    for chunk in (CHUNK, n):
        assert _measure(n, chunk)["saved"] == 13 * n
        assert _measure(n, chunk, with_entropy=True)["saved"] == 17 * n

    # the naive path keeps the [N, V] fp32 log_softmax
    x = torch.randn(n, V, requires_grad=True)
    naive = SavedTensorBytes(x)
    with naive:
        torch.log_softmax(x, -1).gather(-1, torch.zeros(n, 1, dtype=torch.long))
    assert naive.nbytes >= n * V * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_peak_extra_memory_does_not_grow_with_the_number_of_chunks(dtype, with_entropy):
    chunk_bytes = CHUNK * V * 4  # one fp32 chunk
    few, many = 4 * CHUNK, 32 * CHUNK  # 4 chunks vs 32 chunks
    a = _measure(few, CHUNK, dtype, with_entropy)
    b = _measure(many, CHUNK, dtype, with_entropy)
    for m, n in ((a, few), (b, many)):
        # at most three fp32 chunk buffers live at once (upcast copy for bf16, shifted / log p, exp / p)
        assert m["fwd_peak"] <= 3 * chunk_bytes + PER_TOKEN * n, m
        assert m["bwd_extra"] <= 3 * chunk_bytes + PER_TOKEN * n, m
    # 8x the chunks: the growth is only the O(N) vectors, far below one more [N, V] tensor
    assert b["fwd_peak"] - a["fwd_peak"] <= PER_TOKEN * (many - few)
    assert b["bwd_extra"] - a["bwd_extra"] <= PER_TOKEN * (many - few)
    assert PER_TOKEN * (many - few) < (many - few) * V * 4 / 4  # the bound is a quarter of a full fp32 row


def test_one_big_chunk_costs_a_full_fp32_copy():
    """Sanity check of the accounting: with chunk = N the same kernel does allocate O(N x V)."""
    n = 32 * CHUNK
    m = _measure(n, n)
    assert m["fwd_peak"] >= n * V * 4
