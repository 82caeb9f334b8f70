"""TokenLayout: padded fast path, packed (THD) segment ops and unsorted layouts agree with float64 references."""

import torch

from nemo_is_plugin.loss.layout import TokenLayout


def _ref_prefix(x: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    for i in range(len(x)):
        same = (seq == seq[i]) & (pos <= pos[i])
        out[i] = x[same].sum()
    return out


def test_padded_sum_prefix_broadcast():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
    lay = TokenLayout.padded(2, 3)
    assert lay.seq_sum(x).tolist() == [6.0, 15.0]
    assert lay.prefix_sum(x).tolist() == [[1.0, 3.0, 6.0], [4.0, 9.0, 15.0]]
    assert lay.to_tokens(torch.tensor([7.0, 8.0])).tolist() == [[7.0] * 3, [8.0] * 3]
    assert lay.seq_max(x).tolist() == [3.0, 6.0] and lay.seq_min(x).tolist() == [1.0, 4.0]


def test_packed_matches_padded():
    torch.manual_seed(0)
    lengths = [3, 1, 5, 2]
    rows = [torch.randn(n, dtype=torch.float64) for n in lengths]
    packed = torch.cat(rows)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    lay = TokenLayout.packed(cu)
    sums = lay.seq_sum(packed)
    assert torch.allclose(sums, torch.stack([r.sum() for r in rows]))
    pre = lay.prefix_sum(packed)
    assert torch.allclose(pre, torch.cat([r.cumsum(0) for r in rows]))
    assert lay.seq_max(packed).tolist() == [r.max().item() for r in rows]


def test_unsorted_layout_prefix_sum_and_gradient():
    """Tokens in arbitrary order (as a CP shard or a permuted pack): prefix sums follow (sequence, position)."""
    g = torch.Generator().manual_seed(1)
    seq = torch.tensor([1, 0, 1, 0, 2, 1, 0])
    pos = torch.tensor([2, 0, 0, 2, 0, 1, 1])
    x = torch.randn(7, dtype=torch.float64, generator=g, requires_grad=True)
    lay = TokenLayout(seq, pos, 3)
    out = lay.prefix_sum(x)
    assert torch.allclose(out, _ref_prefix(x.detach(), seq, pos))
    w = torch.randn(7, dtype=torch.float64, generator=g)
    (grad,) = torch.autograd.grad((out * w).sum(), x)
    # d/dx_i sum_j w_j prefix_j = sum of w_j over tokens j of the same sequence at positions >= pos_i
    want = torch.stack([w[(seq == seq[i]) & (pos >= pos[i])].sum() for i in range(7)])
    assert torch.allclose(grad, want)


def test_prefix_sum_is_float64_accurate_in_float32():
    """Long float32 sequences: the prefix sum is accumulated in float64 (no drift over 32k tokens)."""
    x = torch.full((1, 32768), 0.1, dtype=torch.float32)
    out = TokenLayout.padded(1, 32768).prefix_sum(x)
    assert out.dtype == torch.float32
    assert abs(out[0, -1].item() - 3276.8) < 1e-3


def test_batch_statistics_span_the_batch_group():
    """reduce_batch_sums / _max: the layout's own (CP) reduction, then the batch group's (the DP ranks, attached by
    distributed.parallel.data_parallel.with_data_parallel); without a group, this process's batch alone."""

    class Doubling:  # a stand-in for the other DP rank holding the same partials
        def sum(self, t):
            return 2 * t

        def max(self, t):
            return t + 100.0

    lay = TokenLayout.padded(2, 3)
    assert lay.with_batch_group(None) is lay
    t = torch.tensor([1.0, 4.0])
    assert lay.reduce_batch_sums(t).tolist() == [1.0, 4.0] and lay.reduce_batch_max(t).tolist() == [1.0, 4.0]
    dp = lay.with_batch_group(Doubling())
    assert dp.reduce_batch_sums(t).tolist() == [2.0, 8.0] and dp.reduce_batch_max(t).tolist() == [101.0, 104.0]
    assert dp.seq_index is lay.seq_index and lay.reduce_batch_sums(t).tolist() == [1.0, 4.0]  # the original unchanged
