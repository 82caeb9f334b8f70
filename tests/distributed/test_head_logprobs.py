"""Single-process checks of the head log-probs (score centering's sampler top-k ids, kernels/head_ids.py) on every
log-prob path: the logits path (vocab_parallel_logprobs), the fused hidden-state two-pass head (fused_linear_logprobs),
the fused single pass (the loss's chunk loop with a per-chunk token gradient) and the Megatron-layout head
(sequence_head.next_token_logprobs, padded and packed). Values and gradients against a float64 full log-softmax
gathered at the label and the head ids (tests/helpers/head_reference.py); the head and the label share one lse (a head
slot holding the label equals the label's log-prob bit for bit); padding ids give -inf and take no gradient. The TP /
CP versions: test_head_logprobs_parallel.py."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.device_guard import assert_identical, count_host_syncs, run_guarded_and_plain
from helpers.head_reference import head_ids_with_padding, head_loss, head_reference

from nemo_is_plugin.distributed.entry_points.fused_linear_loss import _SinglePassFusedLoss, token_grad_step
from nemo_is_plugin.distributed.head.fused_linear import HeadOptions, fused_linear_logprobs
from nemo_is_plugin.distributed.head.sequence_head import SequenceLayout, next_token_logprobs
from nemo_is_plugin.distributed.head.vocab_parallel import vocab_parallel_logprobs

N, H, V, K = 11, 8, 29, 5


def _problem(seed: int, dtype=torch.float64, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(N, H, generator=g, dtype=torch.float64) * scale).to(dtype)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64).to(dtype)
    target = torch.randint(0, V, (N,), generator=g)
    c_label = torch.randn(N, generator=g, dtype=torch.float64)
    c_head = torch.randn(N, K, generator=g, dtype=torch.float64)
    return hidden, weight, target, head_ids_with_padding((N,), K, V, seed + 100), c_label, c_head


def _ref_grads(hidden, weight, target, ids, c_label, c_head, temperature=1.0):
    h, w = hidden.double().clone().requires_grad_(True), weight.double().clone().requires_grad_(True)
    label, head = head_reference(h @ w.t() / temperature, target, ids)
    head_loss(label, head, c_label, c_head).backward()
    return label.detach(), head.detach(), h.grad, w.grad


def _close(got, want, tol):
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite)
    torch.testing.assert_close(got[finite].double(), want[finite], rtol=tol, atol=tol)


# ------------------------------------------------------------------------------------------------ the logits path
@pytest.mark.parametrize("chunk_size", [1, 4, 1024])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_logits_path_head_matches_float64_log_softmax(chunk_size, with_entropy):
    hidden, weight, target, ids, c_label, c_head = _problem(0)
    logits = (hidden @ weight.t()).requires_grad_(True)
    out = vocab_parallel_logprobs(logits, target, chunk_size=chunk_size, with_entropy=with_entropy, head_ids=ids)
    assert len(out) == (3 if with_entropy else 2) and out[-1].shape == (N, K) and out[-1].dtype == torch.float64
    head_loss(out[0], out[-1], c_label, c_head).backward()
    x = logits.detach().clone().requires_grad_(True)
    label, head = head_reference(x, target, ids)
    head_loss(label, head, c_label, c_head).backward()
    _close(out[0], label, 1e-12)
    _close(out[-1], head, 1e-12)
    torch.testing.assert_close(logits.grad, x.grad, rtol=1e-12, atol=1e-12)
    assert (out[-1][:1, -1] == -math.inf).all() and (out[-1][1, 0] == -math.inf)  # -1 and V + 3


def test_head_gradient_is_the_one_hot_of_each_slot_minus_softmax():
    """Hand-computed: logits [0, log 3] -> p = [1/4, 3/4]; head [1, 0, 1, -1] with upstream [1, 2, 3, NaN]: the
    padding's NaN is dropped, dz = 1 (e_1 - p) + 2 (e_0 - p) + 3 (e_1 - p) = [2 - 6/4, 4 - 18/4] = [0.5, -0.5]."""
    logits = torch.tensor([[0.0, math.log(3.0)]], dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[1, 0, 1, -1]])
    lp, head = vocab_parallel_logprobs(logits, torch.tensor([1]), head_ids=ids)
    torch.testing.assert_close(head[0, :3], torch.tensor([math.log(0.75), math.log(0.25), math.log(0.75)]).double())
    assert head[0, 3] == -math.inf
    head.backward(torch.tensor([[1.0, 2.0, 3.0, math.nan]], dtype=torch.float64))
    torch.testing.assert_close(logits.grad, torch.tensor([[0.5, -0.5]], dtype=torch.float64), rtol=0, atol=1e-15)


def test_head_and_label_share_one_normaliser():
    """A head slot holding the label gives the label's log-prob bit for bit (same lse, same gathered logit), and a
    head of the whole vocabulary sums to probability 1."""
    hidden, weight, target, _, _, _ = _problem(1, dtype=torch.float32, scale=3.0)
    perm = torch.stack([torch.randperm(V, generator=torch.Generator().manual_seed(i)) for i in range(N)])
    for fn in (
        lambda ids: vocab_parallel_logprobs(hidden @ weight.t(), target, chunk_size=3, head_ids=ids),
        lambda ids: fused_linear_logprobs(hidden, weight, target, chunk_size=3, temperature=0.7, head_ids=ids),
    ):
        lp, head = fn(perm)
        at_label = head.gather(1, (perm == target[:, None]).long().argmax(1, keepdim=True)).squeeze(1)
        assert torch.equal(at_label, lp)
        torch.testing.assert_close(head.double().exp().sum(-1), torch.ones(N, dtype=torch.float64), rtol=0, atol=1e-5)


def test_bf16_logits_give_a_bf16_gradient_and_fp32_head():
    hidden, weight, target, ids, c_label, c_head = _problem(2)
    logits = (hidden @ weight.t()).to(torch.bfloat16).requires_grad_(True)
    lp, head = vocab_parallel_logprobs(logits, target, chunk_size=4, head_ids=ids)
    head_loss(lp, head, c_label, c_head).backward()
    assert head.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16
    x = logits.detach().float().requires_grad_(True)  # exact on the bf16 values, upcast
    label, ref = head_reference(x, target, ids)
    head_loss(label, ref, c_label, c_head).backward()
    _close(head, ref, 1e-6)
    torch.testing.assert_close(logits.grad.double(), x.grad.double(), rtol=1e-2, atol=1e-2)  # one bf16 rounding of dz


def test_head_ids_are_checked():
    logits, target = torch.zeros(3, 5), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="integer token ids"):
        vocab_parallel_logprobs(logits, target, head_ids=torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r"must be \[3, k\]"):
        vocab_parallel_logprobs(logits, target, head_ids=torch.zeros(4, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"must be \[3, k\]"):
        fused_linear_logprobs(torch.zeros(3, 2), torch.zeros(5, 2), target, head_ids=torch.zeros(3, dtype=torch.long))


# ------------------------------------------------------------------------------------------------ the fused head
@pytest.mark.parametrize("chunk_size", [1, 4, 1024])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_fused_two_pass_head_matches_float64(chunk_size, with_entropy):
    hidden, weight, target, ids, c_label, c_head = _problem(3)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    out = fused_linear_logprobs(
        h, w, target, chunk_size=chunk_size, temperature=0.7, with_entropy=with_entropy, head_ids=ids
    )
    loss = head_loss(out[0], out[-1], c_label, c_head) + (out[1].sum() if with_entropy else 0.0)
    loss.backward()
    hr, wr = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logits = hr @ wr.t() / 0.7
    label, head = head_reference(logits, target, ids)
    logp = torch.log_softmax(logits, -1)
    ref = head_loss(label, head, c_label, c_head) + ((-(logp.exp() * logp).sum()) if with_entropy else 0.0)
    ref.backward()
    _close(out[0], label, 1e-12)
    _close(out[-1], head, 1e-12)
    torch.testing.assert_close(h.grad, hr.grad, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(w.grad, wr.grad, rtol=1e-11, atol=1e-11)


def _single_pass(hidden, weight, target, ids, c_label, c_head, chunk_size, temperature=0.7):
    """The fused single pass with the loss ``sum c_y log p_y + sum c_v log p_v``: its per-chunk token gradient is
    ``(c_y, c_v)``; ``finish`` also records the log-probs it is handed."""
    seen = {}

    def token_grad(sl, c, c_head_chunk):
        seen.setdefault("chunks", []).append(c_head_chunk.shape[0])
        return c_label[sl].to(c.dtype), c_head[sl].to(c.dtype)

    def finish(lp, head):
        seen["lp"], seen["head"] = lp, head
        return head_loss(lp, head, c_label, c_head).detach()

    opts = HeadOptions(None, chunk_size, 1.0 / temperature)
    return _SinglePassFusedLoss.apply(hidden, weight, target, ids, token_grad_step(token_grad), finish, opts), seen


@pytest.mark.parametrize("chunk_size", [1, 4, 1024])
def test_fused_single_pass_head_matches_float64(chunk_size):
    hidden, weight, target, ids, c_label, c_head = _problem(4)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss, seen = _single_pass(h, w, target, ids, c_label, c_head, chunk_size)
    (3.0 * loss).backward()  # the upstream gradient scales dX, dW
    label, head, dx, dw = _ref_grads(hidden, weight, target, ids, c_label, c_head, 0.7)
    _close(seen["lp"], label, 1e-12)
    _close(seen["head"], head, 1e-12)
    assert sum(seen["chunks"]) == N
    torch.testing.assert_close(loss, head_loss(label, head, c_label, c_head), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h.grad, 3.0 * dx, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(w.grad, 3.0 * dw, rtol=1e-11, atol=1e-11)


def test_fused_single_pass_equals_the_two_pass_head_in_fp32():
    hidden, weight, target, ids, c_label, c_head = _problem(5, dtype=torch.float32, scale=2.0)
    c_label, c_head = c_label.float(), c_head.float()
    grads = []
    for single in (True, False):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        if single:
            loss, _ = _single_pass(h, w, target, ids, c_label, c_head, 4)
        else:
            lp, head = fused_linear_logprobs(h, w, target, chunk_size=4, temperature=0.7, head_ids=ids)
            loss = head_loss(lp, head, c_label, c_head)
        loss.backward()
        grads.append((loss.detach(), h.grad, w.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_head_paths_are_device_clean_and_sync_free():
    """Under the CPU device guard every head path gives the plain run's result bit for bit, with no host sync in
    the head."""
    hidden, weight, target, ids, c_label, c_head = _problem(6, dtype=torch.float32)
    c_label, c_head = c_label.float(), c_head.float()

    def run():
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        logits = (hidden @ weight.t()).requires_grad_(True)
        with count_host_syncs() as syncs:
            lp, head = fused_linear_logprobs(h, w, target, chunk_size=4, head_ids=ids)
            head_loss(lp, head, c_label, c_head).backward()
            lp2, head2 = vocab_parallel_logprobs(logits, target, chunk_size=4, head_ids=ids)
            head_loss(lp2, head2, c_label, c_head).backward()
            h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
            loss, _ = _single_pass(h1, w1, target, ids, c_label, c_head, 4)
            loss.backward()
        return (head, h.grad, w.grad, head2, logits.grad, loss, h1.grad, w1.grad), syncs

    (got, syncs), (want, _) = run_guarded_and_plain(run)
    assert_identical(got, want)
    # the one read: the single pass's backward checks on the CPU whether the upstream gradient is 1 (free there)
    assert [r.function for r in syncs.records] == ["_is_one_on_cpu"], str(syncs)


# ------------------------------------------------------------------------------------------------ Megatron layout
def _rolled_reference(hidden_sbh, weight, labels, ids, temperature=1.0):
    """float64 log p of each position's next label and next head ids: labels / ids rolled by one along dim 1."""
    logits = torch.einsum("sbh,vh->bsv", hidden_sbh.double(), weight.double()) / temperature
    return head_reference(logits, labels.roll(-1, dims=1), ids.roll(-1, dims=1))


def test_sequence_head_padded_rolls_the_head_with_the_labels():
    S, B = 6, 2
    g = torch.Generator().manual_seed(7)
    hidden, weight = torch.randn(S, B, H, generator=g, dtype=torch.float64), torch.randn(V, H, generator=g).double()
    labels = torch.randint(0, V, (B, S), generator=g)
    ids = head_ids_with_padding((B, S), K, V, 8)
    c_label, c_head = torch.randn(B, S, generator=g).double(), torch.randn(B, S, K, generator=g).double()
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, head = next_token_logprobs(h, w, labels, None, temperature=0.9, chunk_size=5, head_ids=ids)
    assert lp.shape == (B, S) and head.shape == (B, S, K)
    head_loss(lp, head, c_label, c_head).backward()
    hr, wr = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    label, ref = _rolled_reference(hr, wr, labels, ids, 0.9)
    head_loss(label, ref, c_label, c_head).backward()
    _close(lp, label, 1e-12)
    _close(head, ref, 1e-12)
    torch.testing.assert_close(h.grad, hr.grad, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(w.grad, wr.grad, rtol=1e-11, atol=1e-11)


def test_sequence_head_packed_rolls_within_each_sequence():
    cu = [0, 4, 10, 12]
    T = cu[-1]
    g = torch.Generator().manual_seed(9)
    hidden, weight = torch.randn(T, 1, H, generator=g, dtype=torch.float64), torch.randn(V, H, generator=g).double()
    labels = torch.randint(0, V, (1, T), generator=g)
    ids = head_ids_with_padding((1, T), K, V, 10)
    lp, head = next_token_logprobs(hidden, weight, labels, None, SequenceLayout.build(cu), chunk_size=5, head_ids=ids)
    assert lp.shape == (T,) and head.shape == (T, K)
    nxt = torch.tensor([1, 2, 3, 0, 5, 6, 7, 8, 9, 4, 11, 10])  # each sequence's last position wraps to its first
    label, ref = head_reference(hidden[:, 0] @ weight.t(), labels[0, nxt], ids[0, nxt])
    _close(lp, label, 1e-12)
    _close(head, ref, 1e-12)


def test_sequence_head_refuses_the_head_with_the_training_filter():
    hidden, weight = torch.zeros(4, 1, H), torch.zeros(V, H)
    labels, ids = torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, K, dtype=torch.long)
    with pytest.raises(ValueError, match="not available with top-k / top-p"):
        next_token_logprobs(hidden, weight, labels, None, top_k=3, head_ids=ids)


def test_empty_rows_and_an_empty_head():
    """No tokens (an empty micro-batch) and k = 0 both give empty head log-probs and the plain gradient."""
    hidden, weight, target, _, c_label, _ = _problem(11)
    for n, k in ((0, K), (N, 0)):
        ids = torch.zeros(n, k, dtype=torch.long)
        h, w = hidden[:n].clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lp, head = fused_linear_logprobs(h, w, target[:n], chunk_size=4, head_ids=ids)
        lp2, head2 = vocab_parallel_logprobs((h @ w.t()).detach(), target[:n], chunk_size=4, head_ids=ids)
        assert head.shape == head2.shape == (n, k)
        (lp * c_label[:n]).sum().backward()
        _, _, dx, dw = _ref_grads(hidden[:n], weight, target[:n], ids, c_label[:n], torch.zeros(n, k).double())
        torch.testing.assert_close(h.grad, dx, rtol=1e-11, atol=1e-11)
        torch.testing.assert_close(w.grad, dw, rtol=1e-11, atol=1e-11)
