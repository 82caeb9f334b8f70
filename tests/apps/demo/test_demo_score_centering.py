"""The demo's score-centering path without Ray / Megatron: the trainer's head log-probs from the vocab-parallel pass
(the label's normaliser, ids on either shard) against a float64 log-softmax, values and gradients; the head size the
rollout is asked for; the score_centering setting loads and validates."""

import pytest
import torch

from nemo_is_plugin.apps.demo.loop import DEFAULT_HEAD, head_size
from nemo_is_plugin.apps.demo.policy import owned_logits, vocab_parallel_head
from nemo_is_plugin.apps.demo.settings import load_loss_settings


def case(seed=0, b=3, t=5, v=16, k=6):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(b, t, v, generator=g, dtype=torch.float64)).requires_grad_()
    labels = torch.randint(0, v, (b, t), generator=g)
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(b * t)]).view(b, t, k)
    return logits, labels, ids


def test_head_at_tp1_is_the_float64_log_softmax_with_its_gradient():
    logits, labels, ids = case()
    full = torch.log_softmax(logits, -1)
    label = full.gather(-1, labels[..., None])[..., 0]  # stands in for vocab_parallel_cross_entropy's -loss
    head = vocab_parallel_head(owned_logits(logits, labels, ids, 0), label, lambda x: x)
    ref = full.gather(-1, ids)
    torch.testing.assert_close(head, ref, rtol=0, atol=1e-12)
    # at the label's own id the head's value is the label's, bit for bit (fp32 too)
    h32 = vocab_parallel_head(owned_logits(logits.float(), labels, labels[..., None], 0), label.float(), lambda x: x)
    assert torch.equal(h32[..., 0], label.float())
    w = torch.randn(head.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    (g,) = torch.autograd.grad((w * head).sum() + label.sum(), logits, retain_graph=True)
    (g_ref,) = torch.autograd.grad((w * ref).sum() + label.sum(), logits)
    torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("rank", [0, 1])
def test_head_at_tp2_sums_the_owning_shards_logits(rank):
    logits, labels, ids = case(seed=1)
    v = logits.shape[-1] // 2
    shards = [logits[..., :v], logits[..., v:]]
    full = torch.log_softmax(logits, -1)
    label = full.gather(-1, labels[..., None])[..., 0]
    other = 1 - rank
    # the all-reduce's other addend (its backward is the identity: no gradient to the other rank)
    other_part = owned_logits(shards[other], labels, ids, other * v).detach()
    head = vocab_parallel_head(owned_logits(shards[rank], labels, ids, rank * v), label, lambda x: x + other_part)
    torch.testing.assert_close(head, full.gather(-1, ids), rtol=0, atol=1e-12)
    assert {int(i) // v for i in ids.flatten()} == {0, 1}  # the head's ids fall on both shards


def test_head_size_is_the_largest_centering_setting_k():
    assert head_size({"token_tis": {"use_importance_sampling_correction": True}}) == 0
    assert head_size({"a": {"score_centering": True, "score_centering_top_k": 4}, "b": {}}) == 4
    assert head_size({"a": {"score_centering": True}, "b": {"score_centering": True, "score_centering_top_k": 3}}) == (
        DEFAULT_HEAD
    )


def test_score_centering_setting_validates():
    cfg = load_loss_settings(["score_centering"])["score_centering"]
    assert cfg["score_centering"] is True and cfg["score_centering_top_k"] == DEFAULT_HEAD
    assert cfg["use_importance_sampling_correction"] is False
