"""kernels.chunk_inplace, the torch implementation of the chunk math, against float64 softmax algebra.

Pass 1 (chunk_partials_) and pass 2 (logits_grad_) on a vocab shard with targets the shard does not own; the single
pass's softmax_grad_from_exp_ (dL/dz = g (onehot - p) from e = exp(z - m) and scale = exp(m - lse), in place) on the
whole vocab and on a vocab shard whose local max m is not the global one, where it equals logits_grad_ (which
recomputes p from z and lse)."""

from __future__ import annotations

import pytest
import torch

from nemo_is_plugin.kernels.chunk_inplace import chunk_partials_, logits_grad_, softmax_grad_from_exp_
from nemo_is_plugin.kernels.vocab_shard import local_vocab_range, localize_target

F64 = torch.float64


def _case(n=9, vocab=30, seed=0, logit_std=4.0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, vocab, dtype=F64, generator=g) * logit_std
    target = torch.randint(0, vocab, (n,), generator=g)
    grad_logprob = torch.randn(n, dtype=F64, generator=g)
    return z, target, grad_logprob


def _analytic(z, target, grad_logprob):
    """g (onehot - softmax(z)) over the full vocab, float64."""
    p = torch.softmax(z, dim=-1)
    onehot = torch.nn.functional.one_hot(target, z.shape[-1]).to(F64)
    return grad_logprob.unsqueeze(-1) * (onehot - p)


def test_inplace_chunk_math_equals_the_float64_softmax():
    """Pass 1 and pass 2 on a vocab shard [3, 22) of a larger vocab, with targets the shard does not own."""
    g = torch.Generator().manual_seed(7)
    z = torch.randn(6, 25, generator=g, dtype=torch.float64) * 4
    target = torch.randint(-2, 25, (6,), generator=g)
    local_t, owned = localize_target(target, 3, 22)
    shard = z[:, 3:22].contiguous()
    assert owned.any() and (~owned).any()
    got = chunk_partials_(shard.clone(), local_t, owned, True, torch.empty(8, 19, dtype=torch.float64))
    m = shard.amax(-1)
    e = torch.exp(shard - m[:, None])
    want = (
        m,
        e.sum(-1),
        torch.where(owned, shard.gather(1, local_t[:, None]).squeeze(1), 0.0),
        (e * (shard - m[:, None])).sum(-1),
    )
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)
    lse = torch.logsumexp(z, -1)  # the global lse (all shards)
    logp = shard - lse[:, None]
    p = logp.exp()
    ent, g_lp, g_h = (
        torch.rand(6, generator=g, dtype=torch.float64),
        *torch.randn(2, 6, generator=g, dtype=torch.float64),
    )
    onehot = torch.zeros_like(shard)
    onehot[owned, local_t[owned]] = 1.0
    for args, want in (
        ((g_lp, ent, g_h), g_lp[:, None] * (onehot - p) - g_h[:, None] * p * (logp + ent[:, None])),
        ((g_lp, None, None), g_lp[:, None] * (onehot - p)),
        ((None, ent, g_h), -g_h[:, None] * p * (logp + ent[:, None])),
    ):
        have = logits_grad_(shard.clone(), local_t, owned, lse, *args, scratch=torch.empty_like(shard), scale=0.5)
        torch.testing.assert_close(have, 0.5 * want, rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="scratch"):
        chunk_partials_(shard.clone(), local_t, owned, True, torch.empty(6, 18, dtype=torch.float64))


def test_full_vocab_equals_logits_grad_and_the_analytic_gradient():
    z, target, g = _case()
    m, lse = z.amax(-1), torch.logsumexp(z, -1)
    owned = torch.ones_like(target, dtype=torch.bool)
    e = torch.exp(z - m.unsqueeze(-1))
    got = softmax_grad_from_exp_(e, torch.exp(m - lse), target, owned, g)
    torch.testing.assert_close(got, logits_grad_(z.clone(), target, owned, lse, g), rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(got, _analytic(z, target, g), rtol=1e-13, atol=1e-15)
    # each row of g (onehot - p) sums to 0
    torch.testing.assert_close(got.sum(-1), torch.zeros_like(g), rtol=0, atol=1e-14)


def test_in_place_in_the_exp_buffer():
    z, target, g = _case(seed=1)
    m, lse = z.amax(-1), torch.logsumexp(z, -1)
    e = torch.exp(z - m.unsqueeze(-1))
    ptr = e.data_ptr()
    got = softmax_grad_from_exp_(e, torch.exp(m - lse), target, torch.ones_like(target, dtype=torch.bool), g)
    assert got.data_ptr() == ptr and torch.equal(got, e)


@pytest.mark.parametrize("tp_rank", [0, 1, 2])
def test_vocab_shard_with_local_max_and_global_lse(tp_rank):
    """Rank r of 3 holds vocab columns [10 r, 10 (r+1)): m is the shard's max (below the global one on some rows),
    lse the global one; rows whose target lies on another shard get only the -g p part."""
    z, target, g = _case(n=12, vocab=30, seed=2 + tp_rank)
    start, end = local_vocab_range(10, tp_rank)
    shard = z[:, start:end]
    local_t, owned = localize_target(target, start, end)
    assert owned.any() and (~owned).any()
    m_local, lse = shard.amax(-1), torch.logsumexp(z, -1)
    assert (m_local < z.amax(-1)).any()  # the shard's max is not the global max on some rows
    e = torch.exp(shard - m_local.unsqueeze(-1))
    got = softmax_grad_from_exp_(e, torch.exp(m_local - lse), local_t, owned, g)
    torch.testing.assert_close(got, logits_grad_(shard.clone(), local_t, owned, lse, g), rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(got, _analytic(z, target, g)[:, start:end], rtol=1e-13, atol=1e-15)
    # not-owned rows: exactly -g p (no onehot term anywhere in the row)
    p_shard = torch.softmax(z, -1)[:, start:end]
    torch.testing.assert_close(got[~owned], -(g.unsqueeze(-1) * p_shard)[~owned], rtol=1e-13, atol=1e-15)


def test_from_chunk_partials_buffer():
    """The way fused_linear_loss uses it: chunk_partials_ leaves e = exp(z - m_local) in z's buffer."""
    z, target, g = _case(n=7, vocab=24, seed=5)
    start, end = local_vocab_range(12, 1)
    shard = z[:, start:end]
    local_t, owned = localize_target(target, start, end)
    buf = shard.clone()
    parts = chunk_partials_(buf, local_t, owned, False)
    lse = torch.logsumexp(z, -1)
    got = softmax_grad_from_exp_(buf, torch.exp(parts.max - lse), local_t, owned, g)
    torch.testing.assert_close(got, _analytic(z, target, g)[:, start:end], rtol=1e-13, atol=1e-15)


def test_zero_upstream_rows_and_extreme_logits():
    """g = 0 gives an exactly zero row; logits that underflow exp (z - m = -800) give p = 0, not NaN."""
    z, target, g = _case(n=6, vocab=16, seed=6)
    z[1, :8] -= 800.0
    g[3] = 0.0
    m, lse = z.amax(-1), torch.logsumexp(z, -1)
    owned = torch.ones_like(target, dtype=torch.bool)
    got = softmax_grad_from_exp_(torch.exp(z - m.unsqueeze(-1)), torch.exp(m - lse), target, owned, g)
    assert torch.isfinite(got).all()
    assert (got[3] == 0).all()
    torch.testing.assert_close(got, _analytic(z, target, g), rtol=1e-13, atol=1e-15)


def test_float32_matches_float64():
    z, target, g = _case(n=10, vocab=50, seed=7)
    m, lse = z.amax(-1), torch.logsumexp(z, -1)
    owned = target < 40
    want = softmax_grad_from_exp_(torch.exp(z - m.unsqueeze(-1)), torch.exp(m - lse), target, owned, g)
    z32, g32 = z.float(), g.float()
    m32, lse32 = z32.amax(-1), torch.logsumexp(z32, -1)
    got = softmax_grad_from_exp_(torch.exp(z32 - m32.unsqueeze(-1)), torch.exp(m32 - lse32), target, owned, g32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_out_scale_multiplies_the_gradient_without_a_pass():
    """``out_scale`` (1 / temperature in the fused paths) scales the per-token factors: s g (onehot - p)."""
    z, target, g = _case(n=5, vocab=12, seed=8)
    m, lse = z.amax(-1), torch.logsumexp(z, -1)
    owned = target < 9
    got = softmax_grad_from_exp_(torch.exp(z - m.unsqueeze(-1)), torch.exp(m - lse), target, owned, g, out_scale=0.7)
    want = _analytic(z, target, g)
    want[~owned] = -(g.unsqueeze(-1) * torch.softmax(z, -1))[~owned]
    torch.testing.assert_close(got, 0.7 * want, rtol=1e-13, atol=1e-15)
