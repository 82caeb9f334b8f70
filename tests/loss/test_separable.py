"""separable.py: which configs are token-separable or causal (single pass), the aggregation weights a_t = dL_agg/dx_t
(hand-computed), and TokenLossGradient (per-token dL/dc of a chunk) against autograd of the full ClippedPGLoss, in
float64, including the cumulative ratios' running prefix sums across chunks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.policy_draws import draw_policy_logprobs

from nemo_is_plugin.distributed.parallel.context_parallel import CPTokenLayout
from nemo_is_plugin.loss import ClippedPGLoss, LossInputs
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.separable import (
    PrefixCarry,
    TokenLossGradient,
    aggregation_weights,
    is_token_separable,
    single_pass_blocker,
)

F64 = torch.float64
EPS = 1e-8
IS_ON = dict(use_importance_sampling_correction=True)


# ---------------------------------------------------------------------------------------------------- truth table
@pytest.mark.parametrize(
    "config, separable",
    [
        ({}, True),  # NeMo-RL defaults: token ratio
        (dict(ratio_level="token"), True),
        (dict(ratio_level="token", is_correction_level="sequence", **IS_ON), True),
        (dict(ratio_level="token", is_correction_level="cumulative", **IS_ON), True),
        (dict(ratio_level="token", loss_aggregation="seq-mean-token-mean"), True),
        (dict(use_cispo=True), True),
        (dict(disable_ppo_ratio=True), True),
        (dict(disable_ppo_ratio=True, ratio_level="token"), True),
        (dict(ratio_level="sequence"), False),
        (dict(ratio_level="sequence_token"), False),
        (dict(ratio_level="cumulative"), False),  # causal, not separable: single pass via PrefixCarry
        (dict(ratio_level="cumulative_mean"), False),
        (dict(force_on_policy_ratio=True), False),
        (dict(force_on_policy_ratio=True, ratio_level="token"), False),
        (dict(sequence_level_importance_ratios=True, token_level_loss=False), False),  # GSPO in NeMo-RL's words
        # NeMo-RL's GSPO flag, but the ratio level set back to token explicitly: the token ratio decides
        (dict(sequence_level_importance_ratios=True, token_level_loss=False, ratio_level="token"), True),
    ],
)
def test_is_token_separable_truth_table(config, separable):
    assert is_token_separable(ClippedPGLossConfig(**config)) is separable


def test_token_loss_gradient_rejects_configs_without_a_single_pass():
    c, inputs, layout = _batch()
    with pytest.raises(ValueError, match="ratio_level='sequence_token'"):
        TokenLossGradient.build(ClippedPGLoss(dict(ratio_level="sequence_token")), inputs, layout)


def test_single_pass_blocker_names_the_reason_per_level_and_layout():
    padded = TokenLayout.padded(2, 3)
    seq = torch.tensor([[0, 0, 0], [1, 1, 1]])
    pos = torch.tensor([[0, 1, 2], [0, 1, 2]])
    cp_shard = CPTokenLayout(seq, pos, torch.zeros_like(seq), 2, 1, None)  # a CP layout, even of size 1
    shuffled = TokenLayout(torch.tensor([0, 0, 1, 0]), torch.tensor([0, 2, 0, 1]), 2)  # seq 0's tokens out of order
    assert not cp_shard.holds_whole_sequences and not shuffled.in_memory_order and padded.in_memory_order
    for level in ("cumulative", "cumulative_mean"):
        cfg = ClippedPGLossConfig(ratio_level=level)
        assert single_pass_blocker(cfg, padded) is None
        assert single_pass_blocker(cfg, TokenLayout.packed([0, 2, 5])) is None
        assert "context-parallel" in single_pass_blocker(cfg, cp_shard)
        assert "position order" in single_pass_blocker(cfg, shuffled)
    token = ClippedPGLossConfig()
    assert single_pass_blocker(token, cp_shard) is None and single_pass_blocker(token, shuffled) is None
    for level in ("sequence", "sequence_token"):
        assert f"ratio_level='{level}'" in single_pass_blocker(ClippedPGLossConfig(ratio_level=level), padded)
    assert "force_on_policy_ratio" in single_pass_blocker(ClippedPGLossConfig(force_on_policy_ratio=True), padded)


def test_prefix_carry_continues_sums_across_chunks_and_insists_on_order():
    """Packed sequences of 3 and 4 tokens cut into chunks of 2: inclusive per-sequence sums carry over."""
    layout = TokenLayout.packed([0, 3, 7])
    carry = PrefixCarry(ClippedPGLossConfig(ratio_level="cumulative"), layout)
    x = torch.tensor([1.0, 2.0, 3.0, 10.0, 20.0, 30.0, 40.0], dtype=F64)
    got = torch.cat([carry.scan(slice(s, min(s + 2, 7)), x[s : s + 2]) for s in range(0, 7, 2)])
    assert got.tolist() == [1.0, 3.0, 6.0, 10.0, 30.0, 60.0, 100.0]
    fresh = PrefixCarry(ClippedPGLossConfig(ratio_level="cumulative"), layout)
    with pytest.raises(RuntimeError, match="in order"):
        fresh.scan(slice(2, 4), x[2:4])


# ------------------------------------------------------------------------------------------------ aggregation weights
# 3 sequences x 4 positions; sequence 1 is masked out by sample_mask; global counts exceed the local ones
TM = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1], [1, 1, 0, 0]], dtype=F64)
SM = torch.tensor([1, 0, 1], dtype=F64)
N_TOK, N_SEQ, NORM = 11.0, 5.0, 6.0


def _agg_inputs(tm=TM, sm=SM) -> LossInputs:
    z = torch.zeros(tm.shape, dtype=F64)
    return LossInputs(z, z, z, None, z, tm, sm, torch.tensor(N_SEQ), torch.tensor(N_TOK))


def _hand_weights(mode: str) -> torch.Tensor:
    out = torch.zeros(3, 4, dtype=F64)
    for i in range(3):
        length = float(TM[i].sum())  # L_i counts token_mask only (sample_mask is applied per sequence)
        for t in range(4):
            if TM[i, t] == 0 or SM[i] == 0:
                continue
            out[i, t] = {
                "token-mean": 1.0 / (N_TOK + EPS),
                "seq-mean-token-mean": 1.0 / (length + EPS) / (N_SEQ + EPS),
                "seq-mean-token-sum": 1.0 / (N_SEQ + EPS),
                "seq-mean-token-sum-norm": 1.0 / NORM / (N_SEQ + EPS),
            }[mode]
    return out


def _agg_config(mode: str) -> ClippedPGLossConfig:
    return ClippedPGLossConfig(
        loss_aggregation=mode, loss_aggregation_norm=NORM if mode == "seq-mean-token-sum-norm" else None
    )


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_aggregation_weights_hand_computed(mode):
    a = aggregation_weights(_agg_config(mode), TM, SM, TokenLayout.padded(3, 4), _agg_inputs())
    want = _hand_weights(mode)
    assert a.dtype == F64 and a.shape == TM.shape
    torch.testing.assert_close(a, want, rtol=1e-14, atol=0)
    # e.g. token-mean: mask / (N_tok + 1e-8)
    if mode == "token-mean":
        torch.testing.assert_close(a, TM * SM.unsqueeze(1) / (N_TOK + 1e-8), rtol=1e-15, atol=0)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_aggregation_weights_packed_layout_equal_the_padded_ones(mode):
    """The same three sequences packed (THD): the weights are the padded ones at the packed positions."""
    lengths = [3, 4, 2]  # each sequence keeps its masked tokens up to its last unmasked one
    keep = torch.zeros(3, 4, dtype=torch.bool)
    for i, n in enumerate(lengths):
        keep[i, :n] = True
    layout = TokenLayout.packed([0, 3, 7, 9])
    a = aggregation_weights(_agg_config(mode), TM[keep], SM, layout, _agg_inputs(TM[keep]))
    torch.testing.assert_close(a, _hand_weights(mode)[keep], rtol=1e-14, atol=0)


def test_aggregation_weights_are_linear_exact_for_the_loss():
    """sum_t a_t x_t equals the aggregated loss for any x (the weights are the whole aggregation)."""
    from nemo_is_plugin.loss.aggregation import aggregate

    x = torch.randn(3, 4, dtype=F64, generator=torch.Generator().manual_seed(0))
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        lay = TokenLayout.padded(3, 4)
        a = aggregation_weights(_agg_config(mode), TM, SM, lay, _agg_inputs())
        want = aggregate(x, TM, SM, lay, mode=mode, global_valid_toks=N_TOK, global_valid_seqs=N_SEQ, norm=NORM)
        assert (a * x).sum().item() == pytest.approx(want.item(), rel=1e-14)


# ---------------------------------------------------------------------------------------------------- TokenLossGradient
B, T = 3, 7


def _batch(seed=0, extreme=None):
    """Random float64 batch around on-policy; ``extreme = (name, value)`` writes value into that tensor at the
    masked tokens (padding of a valid sequence and the masked first token of another)."""
    g = torch.Generator().manual_seed(seed)
    c, prev, gen, ref, adv = draw_policy_logprobs(g, B, T)
    tm = torch.ones(B, T, dtype=F64)
    tm[0, 5:] = 0
    tm[1, 0] = 0
    tm[2, 6] = 0
    tensors = dict(prev=prev, gen=gen, ref=ref, adv=adv)
    if extreme is not None:
        name, value = extreme
        tensors[name][tm == 0] = value
    sm = torch.tensor([1.0, 1.0, 0.0], dtype=F64)
    inputs = LossInputs(
        c,
        tensors["prev"],
        tensors["gen"],
        tensors["ref"],
        tensors["adv"],
        tm,
        sm,
        global_valid_seqs=4.0,
        global_valid_toks=17.0,
        rewards=torch.tensor([1.0, 0.0, 1.0], dtype=F64),
    )
    return c, inputs, TokenLayout.padded(B, T)


TIS = dict(
    ratio_level="token",
    use_importance_sampling_correction=True,
    truncated_importance_sampling_type="tis",
    truncated_importance_sampling_ratio=1.05,
    ratio_clip_min=0.03,
    ratio_clip_max=0.03,
)
GRAD_CONFIGS = {
    "tis_token_k3": dict(TIS, is_correction_level="token", reference_policy_kl_penalty=0.1),
    "cumulative_is_seq_mean_agg_k1": dict(
        TIS,
        is_correction_level="cumulative",
        loss_aggregation="seq-mean-token-mean",
        reference_policy_kl_penalty=0.1,
        reference_policy_kl_type="k1",
    ),
    "log_clip_nll_batch_norm": dict(
        TIS,
        is_correction_level="sequence_mean",
        log_ratio_clip_low=0.02,
        log_ratio_clip_high=0.03,
        clip_position_power=0.5,
        log_ratio_clip_c=0.05,
        positive_example_nll_weight=0.3,
        importance_sampling_batch_normalize=True,
    ),
    "cispo_geo_rs_on_policy_kl": dict(
        use_cispo=True,
        truncated_importance_sampling_type="geo-rs",
        truncated_importance_sampling_ratio=1.03,
        truncated_importance_sampling_ratio_min=0.97,
        use_on_policy_kl_approximation=True,
        reference_policy_kl_penalty=0.1,
    ),
    "cumulative_ratio_seq_is_k3": dict(
        TIS,
        ratio_level="cumulative",
        is_correction_level="sequence",
        reference_policy_kl_penalty=0.1,
    ),
    "cumulative_mean_ratio_ctpo_clip_nll": dict(
        TIS,
        ratio_level="cumulative_mean",
        is_correction_level="cumulative",
        log_ratio_clip_low=0.02,
        log_ratio_clip_high=0.03,
        clip_position_power=0.5,
        log_ratio_clip_c=0.05,
        token_log_ratio_clamp=0.04,
        max_log_ratio=0.02,
        positive_example_nll_weight=0.3,
    ),
    "reinforce_dual_clip_sum_norm_k2_gradient": dict(
        disable_ppo_ratio=True,
        ratio_clip_c=1.5,
        loss_aggregation="seq-mean-token-sum-norm",
        loss_aggregation_norm=7.0,
        reference_policy_kl_penalty=0.1,
        reference_policy_kl_gradient="k2",
    ),
}


def _full_grad(loss: ClippedPGLoss, c: torch.Tensor, inputs: LossInputs, layout: TokenLayout) -> torch.Tensor:
    cc = c.clone().requires_grad_(True)
    value, _ = loss.compute(dataclasses.replace(inputs, curr_logprobs=cc), layout)
    (grad,) = torch.autograd.grad(value, cc)
    return grad


def _chunked_grad(loss, c, inputs, layout, chunk) -> torch.Tensor:
    tg = TokenLossGradient.build(loss, inputs, layout)
    flat = c.reshape(-1)
    parts = [tg(slice(s, min(s + chunk, flat.numel())), flat[s : s + chunk]) for s in range(0, flat.numel(), chunk)]
    return torch.cat(parts).reshape(c.shape)


@pytest.mark.parametrize("chunk", [4, 21])
@pytest.mark.parametrize("name", sorted(GRAD_CONFIGS))
def test_token_loss_gradient_equals_autograd_of_the_full_loss(name, chunk):
    loss = ClippedPGLoss(GRAD_CONFIGS[name])
    c, inputs, layout = _batch()
    want = _full_grad(loss, c, inputs, layout)
    got = _chunked_grad(loss, c, inputs, layout, chunk)
    assert got.dtype == F64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    valid = (inputs.token_mask * inputs.sample_mask.unsqueeze(1)) != 0
    assert (got[~valid] == 0).all()  # masked tokens and masked sequences: exactly 0
    assert (got[valid] != 0).sum() >= valid.sum() // 2  # and the loss reaches most valid tokens


def test_token_loss_gradient_of_a_chunk_does_not_depend_on_the_other_chunks():
    """Separability itself: moving the log-probs outside a chunk leaves that chunk's gradient unchanged."""
    loss = ClippedPGLoss(GRAD_CONFIGS["tis_token_k3"])
    c, inputs, layout = _batch()
    tg = TokenLossGradient.build(loss, inputs, layout)
    sl = slice(7, 14)
    a = tg(sl, c.reshape(-1)[sl])
    # the full loss with the other tokens moved: its gradient on the chunk is unchanged
    moved = c.clone()
    moved[0] -= 0.3
    moved[2] += 0.2
    moved = moved.clamp(max=-1e-3)
    b = _full_grad(loss, moved, inputs, layout).reshape(-1)[sl]
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)


def test_token_loss_gradient_upcasts_half_precision_to_fp32():
    loss = ClippedPGLoss(GRAD_CONFIGS["tis_token_k3"])
    c, inputs, layout = _batch()
    half = dataclasses.replace(inputs, curr_logprobs=c.to(torch.bfloat16))
    got = _chunked_grad(loss, c.to(torch.bfloat16), half, layout, 5)
    assert got.dtype == torch.float32
    want = _full_grad(loss, c.to(torch.bfloat16).double(), inputs, layout)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)


# Masked tokens holding extreme inputs: the validation of ClippedPGLoss.__call__ rejects +-inf but lets any finite
# value (<= 1e-4 for log-probs) through, so padding can hold e.g. -1e6.
SAFE_EXTREMES = [
    ("prev", 1e6),
    ("prev", -50.0),
    ("gen", -1e6),
    ("gen", float("-inf")),
    ("gen", 1e6),
    ("ref", -1e6),
    ("ref", float("-inf")),
    ("ref", 1e6),
    ("adv", 1e30),
]


@pytest.mark.parametrize("extreme", SAFE_EXTREMES, ids=lambda e: f"{e[0]}={e[1]}")
@pytest.mark.parametrize("name", ["tis_token_k3", "log_clip_nll_batch_norm", "cispo_geo_rs_on_policy_kl"])
def test_masked_tokens_with_extreme_inputs_get_zero_gradient(name, extreme):
    loss = ClippedPGLoss(GRAD_CONFIGS[name])
    c, inputs, layout = _batch(extreme=extreme)
    got = _chunked_grad(loss, c, inputs, layout, 4)
    masked = inputs.token_mask == 0
    assert masked.any() and torch.isfinite(got).all()
    assert (got[masked] == 0).all()
    torch.testing.assert_close(got, _full_grad(loss, c, inputs, layout), rtol=1e-12, atol=1e-15)
    # what masked tokens hold must not change the other tokens' gradients
    c0, clean_inputs, _ = _batch()
    torch.testing.assert_close(got, _chunked_grad(loss, c0, clean_inputs, layout, 4), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("value", [-1e6, float("-inf")])
@pytest.mark.parametrize("name", ["tis_token_k3", "log_clip_nll_batch_norm"])
def test_masked_tokens_with_very_negative_prev_get_zero_gradient(name, value):
    loss = ClippedPGLoss(GRAD_CONFIGS[name])
    c, inputs, layout = _batch(extreme=("prev", value))
    got = _chunked_grad(loss, c, inputs, layout, 4)
    assert torch.isfinite(got).all() and (got[inputs.token_mask == 0] == 0).all()
    # ClippedPGLoss itself: masked tokens are anchored at ratio 1 (ratio_anchor), so no 0 * inf in its backward
    full = _full_grad(loss, c, inputs, layout)
    assert torch.isfinite(full).all()
    torch.testing.assert_close(got, full, rtol=1e-12, atol=1e-15)
    c0, clean_inputs, _ = _batch()
    torch.testing.assert_close(got, _full_grad(loss, c0, clean_inputs, layout), rtol=1e-12, atol=1e-15)
