"""Score centering's inputs and wiring (float64): -inf padding of the head, a sampled token outside it, empty rows,
packed rows equal to padded ones, batch normalisation, NeMo-RL's call (data keys, logits), the single pass's chunk
gradients (label and head), the fused LM-head loss's head. The expectation property itself:
test_score_centering_exact.py; the config's refusals: test_score_centering_config.py; CP shards:
tests/distributed/test_score_centering_cp.py."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from nemo_is_plugin.loss import ClippedPGLoss, LossInputs
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.score_centering import ScoreCenteringHead
from nemo_is_plugin.loss.separable import TokenLossGradient, single_pass_blocker

V, K = 11, 4
SC = {"reference_policy_kl_penalty": 0.0, "score_centering": True}
TIS = {
    **SC,
    "use_importance_sampling_correction": True,
    "truncated_importance_sampling_type": "tis",
    "truncated_importance_sampling_ratio": 1.5,
}


def batch(seed: int, b: int = 3, t: int = 5, k: int = K) -> dict[str, torch.Tensor]:
    """Trainer logits [B, T, V] (leaf), sampled ids, a perturbed sampler with its top-k head, advantages, masks."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, V, generator=g, dtype=torch.float64)
    sampler = torch.log_softmax(logits + 0.8 * torch.randn(b, t, V, generator=g, dtype=torch.float64), -1)
    top = sampler.topk(k, -1)
    return {
        "logits": logits.requires_grad_(True),
        "ids": torch.randint(0, V, (b, t), generator=g),
        "sampler": sampler,
        "head_ids": top.indices,
        "head_q": top.values,
        "adv": torch.randn(b, t, generator=g, dtype=torch.float64),
        "mask": torch.ones(b, t, dtype=torch.float64),
    }


def inputs_of(d: dict[str, torch.Tensor], logits: torch.Tensor | None = None, **over) -> LossInputs:
    logp = torch.log_softmax(d["logits"] if logits is None else logits, -1)
    ids, head = d["ids"], over.pop("head_ids", d["head_ids"])
    curr = logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    fields = dict(
        curr_logprobs=curr,
        prev_logprobs=curr.detach(),
        generation_logprobs=d["sampler"].gather(-1, ids.unsqueeze(-1)).squeeze(-1),
        reference_logprobs=None,
        advantages=d["adv"],
        token_mask=d["mask"],
        sample_mask=torch.ones(ids.shape[0], dtype=torch.float64),
        global_valid_seqs=float(ids.shape[0]),
        global_valid_toks=float(d["mask"].sum()),
        head=ScoreCenteringHead(head, over.pop("head_q", d["head_q"]), logp.gather(-1, head)),
    )
    fields.update(over)
    return LossInputs(**fields)


def replace_head(inputs: LossInputs, **changes: torch.Tensor) -> None:
    """Replace tensors of ``inputs``' score-centering head (``head_ids`` / ``sampler_head`` / ``trainer_head``)."""
    assert inputs.head is not None
    inputs.head = dataclasses.replace(inputs.head, **changes)


def loss_and_grad(config: dict, inputs: LossInputs, layout: TokenLayout, leaf: torch.Tensor):
    loss, metrics = ClippedPGLoss(config).compute(inputs, layout)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad, metrics


@pytest.mark.parametrize("config", [SC, TIS], ids=["f=1", "tis"])
def test_empty_head_slots_are_ignored_whatever_their_ids_and_values(config):
    """Two -inf slots appended to a k = 4 head (ids repeating a filled slot's, trainer log-probs -inf / NaN there):
    the loss, its gradient and the metrics are those of the k = 4 head."""
    d = batch(0)
    b, t = d["ids"].shape
    lay = TokenLayout.padded(b, t)
    want, want_grad, want_m = loss_and_grad(config, inputs_of(d), lay, d["logits"])
    pad_ids = torch.cat([d["head_ids"], d["head_ids"][..., :1].expand(b, t, 2)], -1)
    pad_q = torch.cat([d["head_q"], torch.full((b, t, 2), -math.inf, dtype=torch.float64)], -1)
    padded = inputs_of(d, head_ids=pad_ids, head_q=pad_q)
    assert padded.head is not None and padded.head.trainer_head is not None
    head = padded.head.trainer_head
    bad = torch.tensor([-math.inf, math.nan], dtype=torch.float64).expand(b, t, 2)
    replace_head(padded, trainer_head=torch.cat([head[..., :K], bad], -1))
    got, grad, metrics = loss_and_grad(config, padded, lay, d["logits"])
    torch.testing.assert_close(got, want, rtol=1e-14, atol=0)
    torch.testing.assert_close(grad, want_grad, rtol=1e-13, atol=1e-16)
    assert torch.isfinite(grad).all()
    for name in [n for n in want_m if n.startswith("score_centering")]:
        assert metrics[name] == pytest.approx(want_m[name], rel=1e-13, abs=1e-16), name


def test_a_sampled_token_outside_the_head():
    """The sampled token's own term reads its generation log-prob; the head term does not depend on it; the
    sampled_in_head metric counts the tokens whose id is in the head."""
    d = batch(1)
    b, t = d["ids"].shape
    in_head = (d["head_ids"] == d["ids"].unsqueeze(-1)).any(-1)
    assert 0 < int(in_head.sum()) < in_head.numel()  # both kinds occur
    _, _, metrics = loss_and_grad(SC, inputs_of(d), TokenLayout.padded(b, t), d["logits"])
    want = in_head.double().sum().item() / (in_head.numel() + 1e-8)
    assert metrics["score_centering_sampled_in_head"] == pytest.approx(want, rel=1e-12)
    # the head term of a token is the same whichever token was sampled: move the sampled ids, the term's value stays
    moved = dict(d, ids=(d["ids"] + 1) % V)
    _, _, m2 = loss_and_grad(SC, inputs_of(moved), TokenLayout.padded(b, t), d["logits"])
    for name in ("score_centering_sampler_tail", "score_centering_trainer_tail", "score_centering_drift"):
        assert m2[name] == pytest.approx(metrics[name], rel=1e-13), name


def test_masked_rows_and_positions_contribute_nothing():
    """A row whose sample mask is 0 and padding positions hold NaN head values: the loss and gradient equal those of
    the batch without them (same global counts); their gradient is exactly 0."""
    d = batch(2, b=3, t=6)
    d["mask"][1, 4:] = 0.0
    keep = batch(2, b=3, t=6)
    keep["mask"][1, 4:] = 0.0
    full = inputs_of(d, sample_mask=torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64), global_valid_seqs=2.0)
    full.global_valid_toks = float(d["mask"][:2].sum())
    head_q = d["head_q"].clone()
    head_q[2] = math.nan
    head_q[1, 4:] = math.nan
    replace_head(full, sampler_head=head_q)
    loss, grad, _ = loss_and_grad(TIS, full, TokenLayout.padded(3, 6), d["logits"])
    assert torch.isfinite(grad).all() and (grad[2] == 0).all() and (grad[1, 4:] == 0).all()
    part = {k: v[:2] for k, v in keep.items() if k != "logits"}
    leaf = keep["logits"].detach()[:2].clone().requires_grad_(True)
    sub = inputs_of({**part, "logits": leaf}, global_valid_seqs=2.0, global_valid_toks=full.global_valid_toks)
    want, want_grad, _ = loss_and_grad(TIS, sub, TokenLayout.padded(2, 6), leaf)
    torch.testing.assert_close(loss, want, rtol=1e-14, atol=0)
    torch.testing.assert_close(grad[:2], want_grad, rtol=1e-13, atol=1e-16)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_packed_rows_equal_padded_rows(aggregation):
    """The same sequences padded [B, T, k] (with padding) and packed [N, k]: the same loss and gradient."""
    d = batch(3, b=3, t=5)
    lengths = [5, 3, 4]
    for i, n in enumerate(lengths):
        d["mask"][i, n:] = 0.0
    config = {**TIS, "loss_aggregation": aggregation}
    padded = inputs_of(d)
    loss, grad, metrics = loss_and_grad(config, padded, TokenLayout.padded(3, 5), d["logits"])
    sel = d["mask"] != 0
    leaf = d["logits"].detach()[sel].clone().requires_grad_(True)
    flat = {k: v[sel] for k, v in d.items() if k != "logits"}
    packed = inputs_of({**flat, "logits": leaf}, sample_mask=torch.ones(3, dtype=torch.float64), global_valid_seqs=3.0)
    cu = [0, 5, 8, 12]
    got, got_grad, got_m = loss_and_grad(config, packed, TokenLayout.packed(cu), leaf)
    torch.testing.assert_close(got, loss, rtol=1e-14, atol=0)
    torch.testing.assert_close(got_grad, grad[sel], rtol=1e-13, atol=1e-16)
    for name in [n for n in metrics if n.startswith("score_centering")]:
        assert got_m[name] == pytest.approx(metrics[name], rel=1e-13, abs=1e-16), name


def test_batch_normalisation_scales_the_coefficients_as_the_weights():
    """With importance_sampling_batch_normalize the head's gradient is the un-normalised one divided by the batch's
    mean truncated weight (the divisor of the sampled tokens' weights)."""
    d = batch(4)
    b, t = d["ids"].shape
    inputs = inputs_of(d)
    head = inputs.head.trainer_head.detach().clone().requires_grad_(True)  # type: ignore[union-attr]
    replace_head(inputs, trainer_head=head)
    plain, _ = ClippedPGLoss(TIS).compute(inputs, TokenLayout.padded(b, t))
    (g_plain,) = torch.autograd.grad(plain, head)
    normed, _ = ClippedPGLoss({**TIS, "importance_sampling_batch_normalize": True}).compute(
        inputs, TokenLayout.padded(b, t)
    )
    (g_norm,) = torch.autograd.grad(normed, head)
    w = (inputs.prev_logprobs - inputs.generation_logprobs).exp().clamp(max=1.5)  # type: ignore[operator]
    z = w.mean()
    assert abs(z.item() - 1.0) > 0.05
    torch.testing.assert_close(g_norm, g_plain / z, rtol=1e-12, atol=1e-17)


# ------------------------------------------------------------------------------------------------ NeMo-RL's call
def nemo_rl_data(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """[B, S] data whose column 0 is never read: the [B, S-1] token tensors behind a dummy first column."""

    def widen(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.zeros_like(x[:, :1]), x], 1)

    logp = torch.log_softmax(d["logits"].detach(), -1)
    curr = logp.gather(-1, d["ids"].unsqueeze(-1)).squeeze(-1)
    return {
        "input_ids": widen(d["ids"]),
        "token_mask": widen(d["mask"]),
        "sample_mask": torch.ones(d["ids"].shape[0], dtype=torch.float64),
        "advantages": widen(d["adv"]),
        "prev_logprobs": widen(curr),
        "generation_logprobs": widen(d["sampler"].gather(-1, d["ids"].unsqueeze(-1)).squeeze(-1)),
        "rollout_topk_ids": widen(d["head_ids"]),
        "rollout_topk_logprobs": widen(d["head_q"]),
    }


def test_nemo_rl_call_from_logits_equals_the_aligned_inputs():
    d = batch(5, b=2, t=4)
    data = nemo_rl_data(d)
    b, t = d["ids"].shape
    want, want_grad, _ = loss_and_grad(TIS, inputs_of(d), TokenLayout.padded(b, t), d["logits"])
    # logits [B, S, V]: the last position's row is never read
    logits = torch.cat([d["logits"], torch.zeros(b, 1, V, dtype=torch.float64)], 1)
    loss, _ = ClippedPGLoss({**TIS, "score_centering_top_k": K})(None, data, b, t * b, logits=logits)
    (grad,) = torch.autograd.grad(loss, d["logits"])
    torch.testing.assert_close(loss.detach(), want, rtol=1e-14, atol=0)
    torch.testing.assert_close(grad, want_grad, rtol=1e-13, atol=1e-16)
    # or the head's log-probs as an aligned [B, S-1, k] data key beside next_token_logprobs
    logp = torch.log_softmax(d["logits"], -1)
    curr = logp.gather(-1, d["ids"].unsqueeze(-1)).squeeze(-1)
    with_head = {**data, "curr_topk_logprobs": logp.gather(-1, d["head_ids"])}
    loss2, _ = ClippedPGLoss(TIS)(curr, with_head, b, t * b)
    torch.testing.assert_close(loss2.detach(), want, rtol=1e-14, atol=0)


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"score_centering_top_k": 5}, ValueError, "k = 4 log-probs per token, score_centering_top_k = 5"),
        ({"drop": "rollout_topk_ids"}, KeyError, "rollout_topk_ids"),
        ({"ids_dtype": torch.float64}, TypeError, "expected an integer dtype"),
        (
            {"unsliced": True},
            ValueError,
            r"rollout_topk_logprobs'\] has shape \[2, 3, 4\], expected \[\*T, 4\] with \*T = \[2, 4\] "
            r"\(the rollout_topk_\* data are \[B, S, k\]",
        ),
    ],
)
def test_nemo_rl_head_inputs_are_checked(change, error, match):
    d = batch(6, b=2, t=4)
    data = nemo_rl_data(d)
    logits = torch.cat([d["logits"], torch.zeros(2, 1, V, dtype=torch.float64)], 1)
    config = {**TIS, "score_centering_top_k": change.get("score_centering_top_k", K)}
    if "drop" in change:
        del data[change["drop"]]
    if "ids_dtype" in change:
        data["rollout_topk_ids"] = data["rollout_topk_ids"].to(change["ids_dtype"])
        logits = None
        logp = torch.log_softmax(d["logits"], -1)
        data["curr_topk_logprobs"] = logp.gather(-1, d["head_ids"])
    if "unsliced" in change:
        data["rollout_topk_logprobs"] = d["head_q"]  # [B, S-1, k]: sliced to [B, S-2, k]
    with pytest.raises(error, match=match):
        if logits is None:
            curr = torch.log_softmax(d["logits"], -1).gather(-1, d["ids"].unsqueeze(-1)).squeeze(-1)
            ClippedPGLoss(config)(curr, data, 2, 8)
        else:
            ClippedPGLoss(config)(None, data, 2, 8, logits=logits)


@pytest.mark.parametrize("config", [SC, {**TIS, "importance_sampling_batch_normalize": True}], ids=["f=1", "tis-bn"])
def test_the_chunk_gradients_equal_the_whole_batch_gradients(config):
    """The fused single pass's chunk gradient (separable.TokenLossGradient.with_head), chunk by chunk: dL/dc and
    dL/d(trainer_head) of the whole batch's loss (a masked row included)."""
    d = batch(9, b=3, t=5)
    d["mask"][2, 3:] = 0.0
    inputs = inputs_of(d)
    c = inputs.curr_logprobs.detach().clone().requires_grad_(True)
    head = inputs.head.trainer_head.detach().clone().requires_grad_(True)  # type: ignore[union-attr]
    inputs.curr_logprobs = c
    replace_head(inputs, trainer_head=head)
    loss = ClippedPGLoss(config)
    layout = TokenLayout.padded(3, 5)
    assert single_pass_blocker(loss.config, layout) is None
    want_c, want_head = torch.autograd.grad(loss.compute(inputs, layout)[0], (c, head))
    chunks = TokenLossGradient.build(loss, inputs, layout)
    flat_c, flat_head = c.detach().reshape(-1), head.detach().reshape(-1, K)
    parts = [chunks.with_head(slice(i, min(i + 4, 15)), flat_c[i : i + 4], flat_head[i : i + 4]) for i in (0, 4, 8, 12)]
    torch.testing.assert_close(torch.cat([g for g, _ in parts]), want_c.reshape(-1), rtol=1e-13, atol=1e-16)
    torch.testing.assert_close(torch.cat([h for _, h in parts]), want_head.reshape(-1, K), rtol=1e-13, atol=1e-16)
    with pytest.raises(ValueError, match="call with_head"):
        chunks(slice(0, 4), flat_c[:4])


@pytest.mark.parametrize(
    "where, key, value, refused",
    [
        ((0, 2, 1), "rollout_topk_logprobs", math.nan, "rollout_topk_logprobs'] holds 1 value"),
        ((0, 2, 1), "rollout_topk_logprobs", math.inf, "rollout_topk_logprobs'] holds 1 value"),
        ((0, 2, 1), "rollout_topk_logprobs", 0.5, "rollout_topk_logprobs'] holds 1 value"),
        ((0, 2, 1), "curr_topk_logprobs", -math.inf, "curr_topk_logprobs'] holds 1 value"),
        ((1, 3, 0), "rollout_topk_logprobs", math.nan, None),  # a padding token: never read
        ((0, 2, 1), "rollout_topk_logprobs", -math.inf, None),  # an empty slot
    ],
)
def test_nemo_rl_head_values_are_checked_on_counted_tokens(where, key, value, refused):
    d = batch(7, b=2, t=4)
    d["mask"][1, 3] = 0.0
    data = nemo_rl_data(d)
    curr = torch.log_softmax(d["logits"], -1).gather(-1, d["ids"].unsqueeze(-1)).squeeze(-1)
    data["curr_topk_logprobs"] = torch.log_softmax(d["logits"].detach(), -1).gather(-1, d["head_ids"])
    b, s, j = where
    data[key][b, s + (key == "rollout_topk_logprobs"), j] = value  # [B, S] data: column s + 1 is token s
    if refused is None:
        loss, _ = ClippedPGLoss(TIS)(curr, data, 2, 7)
        assert torch.isfinite(loss)
    else:
        with pytest.raises(ValueError, match=re.escape(refused) + r".*first at \[0, 2, 1\]"):
            ClippedPGLoss(TIS)(curr, data, 2, 7)


def test_the_fused_lm_head_loss_computes_the_head_in_its_pass():
    """The fused LM-head loss from hidden states (its single pass, and two passes) equals the call on the logits
    (one log-softmax): loss and the hidden states' gradient. Its TP / CP and padding cases:
    tests/distributed/test_score_centering_entry_points.py and test_score_centering_parallel.py."""
    from nemo_is_plugin.distributed.entry_points.fused_linear_loss import fused_linear_pg_loss

    d = batch(8, b=2, t=4)
    data = nemo_rl_data(d)
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(2, 4, 6, generator=g, dtype=torch.float64), torch.randn(V, 6, generator=g).double()
    h = hidden.clone().requires_grad_(True)
    logits = torch.cat([h @ weight.t(), torch.zeros(2, 1, V, dtype=torch.float64)], 1)
    want, _ = ClippedPGLoss(TIS)(None, data, 2, 8, logits=logits)
    (want_grad,) = torch.autograd.grad(want, h)
    for single_pass in (True, False):
        h = hidden.clone().requires_grad_(True)
        loss, _ = fused_linear_pg_loss(
            ClippedPGLoss(TIS), h, weight, d["ids"], data, 2, 8, chunk_size=3, single_pass=single_pass
        )
        loss.backward()
        torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(h.grad, want_grad, rtol=1e-11, atol=1e-14)


def test_the_logits_path_without_score_centering_and_its_misuse():
    d = batch(10, b=2, t=3)
    data = nemo_rl_data(d)
    logits = torch.cat([d["logits"], torch.zeros(2, 1, V, dtype=torch.float64)], 1)
    plain = {"reference_policy_kl_penalty": 0.0}
    curr = torch.log_softmax(d["logits"], -1).gather(-1, d["ids"].unsqueeze(-1)).squeeze(-1)
    want, _ = ClippedPGLoss(plain)(curr, data, 2, 6)
    got, _ = ClippedPGLoss(plain)(None, data, 2, 6, logits=logits)
    torch.testing.assert_close(got, want, rtol=1e-15, atol=0)
    with pytest.raises(ValueError, match="pass next_token_logprobs or logits, not both"):
        ClippedPGLoss(plain)(curr, data, 2, 6, logits=logits)
    with pytest.raises(KeyError, match="input_ids"):
        ClippedPGLoss(plain)(None, {k: v for k, v in data.items() if k != "input_ids"}, 2, 6, logits=logits)


def test_its_metrics_declare_their_denominators_without_data():
    """The shape-only trace (what the NeMo-RL adapter advertises as metric_normalizations) carries the head too."""
    from nemo_is_plugin.loss.denominator import Denominator

    for aggregation, loss_per in (("token-mean", Denominator.TOKENS), ("seq-mean-token-mean", Denominator.SEQUENCES)):
        got = ClippedPGLoss({**SC, "loss_aggregation": aggregation}).metric_denominators()
        assert got["score_centering_loss"] == got["loss"] == loss_per
        assert got["score_centering_drift"] == got["score_centering_sampled_in_head"] == Denominator.TOKENS
    assert not any(k.startswith("score_centering") for k in ClippedPGLoss({}).metric_denominators())
