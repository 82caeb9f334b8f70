"""Single-process checks of the chunked vocab-parallel log-prob kernel (the TP reductions are tested multi-process)."""

from __future__ import annotations

import pytest
import torch
from helpers.softmax_merge import merge_partials

from nemo_is_plugin.distributed.head.vocab_parallel import vocab_parallel_logprobs
from nemo_is_plugin.kernels.chunk_inplace import chunk_partials_
from nemo_is_plugin.kernels.softmax_partials import finalize_partials
from nemo_is_plugin.kernels.vocab_shard import local_vocab_range, localize_target


def _reference(logits: torch.Tensor, target: torch.Tensor):
    """float64 log p(target) and entropy through torch.log_softmax."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    return logp.gather(-1, target.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _inputs(shape=(3, 5), vocab=37, scale=3.0, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=g, dtype=torch.float64) * scale).to(dtype)
    target = torch.randint(0, vocab, shape, generator=g)
    return logits, target


@pytest.mark.parametrize("chunk_size", [1, 4, 15, 1024])
def test_logprob_and_entropy_match_log_softmax(chunk_size):
    logits, target = _inputs()
    lp, ent = vocab_parallel_logprobs(logits, target, chunk_size=chunk_size, with_entropy=True)
    ref_lp, ref_ent = _reference(logits, target)
    assert lp.dtype == torch.float32 and lp.shape == target.shape
    torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-6, atol=1e-6)
    assert (lp <= 0).all()  # verl #2656: a fused log-prob > 0 collapsed a run


@pytest.mark.parametrize("chunk_size", [2, 1024])
def test_gradient_matches_autograd_float64(chunk_size):
    logits, target = _inputs(seed=1)
    g = torch.Generator().manual_seed(2)
    w_lp, w_ent = torch.randn(target.shape, generator=g), torch.randn(target.shape, generator=g)

    x = logits.clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(x, target, chunk_size=chunk_size, with_entropy=True)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()

    x64 = logits.double().requires_grad_(True)
    ref_lp, ref_ent = _reference(x64, target)
    ((ref_lp * w_lp.double()).sum() + (ref_ent * w_ent.double()).sum()).backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-6)


def test_logprob_only_gradient_is_onehot_minus_softmax():
    logits, target = _inputs(shape=(4,), vocab=6, seed=3)
    x = logits.clone().requires_grad_(True)
    vocab_parallel_logprobs(x, target, chunk_size=3).sum().backward()
    expected = torch.nn.functional.one_hot(target, 6).double() - torch.softmax(logits.double(), -1)
    torch.testing.assert_close(x.grad.double(), expected, rtol=1e-6, atol=1e-7)


def test_hand_computed_case():
    # logits [0, log 3] -> p = [1/4, 3/4]; H = -(1/4 log 1/4 + 3/4 log 3/4)
    logits = torch.tensor([[0.0, torch.log(torch.tensor(3.0)).item()]])
    lp, ent = vocab_parallel_logprobs(logits, torch.tensor([1]), with_entropy=True)
    assert lp.item() == pytest.approx(torch.log(torch.tensor(0.75)).item(), abs=1e-7)
    h = -(0.25 * torch.log(torch.tensor(0.25)) + 0.75 * torch.log(torch.tensor(0.75))).item()
    assert ent.item() == pytest.approx(h, abs=1e-7)


def test_bf16_logits_give_bf16_gradient_and_fp32_logprobs():
    logits, target = _inputs(dtype=torch.bfloat16, seed=4)
    x = logits.clone().requires_grad_(True)
    lp = vocab_parallel_logprobs(x, target, chunk_size=4)
    lp.sum().backward()
    assert lp.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    ref_lp, _ = _reference(logits.float(), target)  # exact on the bf16 values, upcast
    torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-6, atol=1e-6)


def test_shard_partials_merge_to_the_full_vocab():
    """Splitting the vocab into 3 shards and merging the partials (what TP does) equals the unsharded result."""
    logits, target = _inputs(shape=(7,), vocab=12, scale=20.0, seed=5)  # large scale: shards have different maxima
    z, merged = logits.float(), None
    for rank in range(3):
        start, end = local_vocab_range(4, rank)
        local_t, owned = localize_target(target, start, end)
        shard = z[:, start:end].clone()
        part = chunk_partials_(shard, local_t, owned, True, torch.empty_like(shard))
        merged = part if merged is None else merge_partials(merged, part)
    lp, _, ent = finalize_partials(merged)
    ref_lp, ref_ent = _reference(logits, target)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)


def test_out_of_range_target_gives_minus_lse():
    logits, _ = _inputs(shape=(2,), vocab=5, seed=6)
    lp = vocab_parallel_logprobs(logits, torch.tensor([-100, 5]))
    torch.testing.assert_close(lp.double(), -torch.logsumexp(logits.double(), -1), rtol=1e-6, atol=1e-6)


def test_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match="disagree"):
        vocab_parallel_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


def test_backward_leaves_fp32_logits_untouched():
    logits, target = _inputs(seed=7)
    x = logits.clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(x, target, chunk_size=4, with_entropy=True)
    (lp.sum() + ent.sum()).backward()
    assert torch.equal(x.detach(), logits)
