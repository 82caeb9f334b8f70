"""Single-process checks of the LOGIT entry point: it must equal ClippedPGLoss on log_softmax of the same logits,
for padded and packed inputs (the multi-process TP / CP / DP / PP checks are in ``test_parallel_loss.py``)."""

from __future__ import annotations

import pytest
import torch

from nemo_is_plugin.distributed.entry_points.logit_loss import LogitClippedPGLoss, next_token_aligned
from nemo_is_plugin.loss import ClippedPGLoss

from ._loss_cases import (
    GRAD_RTOL,
    LOSS_CONFIGS,
    OBJECTIVE_LOSS_CONFIGS,
    TOL,
    assert_metrics_close,
    assert_tensor_close,
    cu_seqlens,
    global_counts,
    make_batch,
    pack,
    padded_lengths,
    reference,
)


def _logit_loss(config, logits, data, **kwargs):
    x = logits.detach().clone().requires_grad_(True)
    call_kwargs = {k: kwargs.pop(k) for k in ("cu_seqlens_padded", "vocab_parallel_rank") if k in kwargs}
    loss, metrics = LogitClippedPGLoss(ClippedPGLoss(config), chunk_size=7, **kwargs)(
        x, data, *global_counts(data), **call_kwargs
    )
    loss.backward()
    return loss.detach(), metrics, x.grad


def test_next_token_alignment():
    x = torch.arange(8.0).reshape(2, 4)
    assert next_token_aligned(x, 4).tolist() == [[1, 2, 3, 0], [5, 6, 7, 0]]
    assert next_token_aligned(x, 6).tolist() == [[1, 2, 3, 0, 0, 0], [5, 6, 7, 0, 0, 0]]


def _assert_same(got, want, dtype, context):
    assert_tensor_close(got[0], want[0], dtype)
    assert_metrics_close(got[1], want[1], context=context, **TOL[dtype])
    assert_tensor_close(got[2], want[2], dtype, grad=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(LOSS_CONFIGS))
def test_padded_logits_match_the_logprob_loss(name, dtype):
    logits, data, _ = make_batch(11, dtype=dtype)
    want = reference(LOSS_CONFIGS[name], logits, data)
    _assert_same(_logit_loss(LOSS_CONFIGS[name], logits, data), want, dtype, name)


@pytest.mark.parametrize("name", ["nemo_rl_default", "ctpo_cumulative_is", "seq_mis_veto", "gspo_nemo_rl"])
def test_packed_logits_match_the_padded_loss(name):
    logits, data, lengths = make_batch(12)
    loss, metrics, grad = reference(LOSS_CONFIGS[name], logits, data)
    lp = padded_lengths(lengths, 4)
    packed = pack(logits, lp, fill=5.0).unsqueeze(0)  # [1, N, V] as Megatron hands it over
    got = _logit_loss(LOSS_CONFIGS[name], packed, data, cu_seqlens_padded=cu_seqlens(lp))
    _assert_same((got[0], got[1], got[2][0]), (loss, metrics, pack(grad, lp)), torch.float32, name)


def test_padding_positions_past_the_data_get_no_gradient():
    logits, data, _ = make_batch(13)
    wider = torch.cat([logits, torch.randn(logits.shape[0], 2, logits.shape[2])], dim=1)  # CP pads S up to 2*cp
    want_loss, _, want_grad = reference(LOSS_CONFIGS["nemo_rl_default"], logits, data)
    loss, _, grad = _logit_loss(LOSS_CONFIGS["nemo_rl_default"], wider, data)
    assert_tensor_close(loss, want_loss, torch.float32)
    assert torch.equal(grad[:, -2:], torch.zeros_like(grad[:, -2:]))
    assert_tensor_close(grad[:, :-2], want_grad, torch.float32, grad=True)


def test_entropy_metric_is_the_masked_token_mean():
    logits, data, _ = make_batch(14)
    _, metrics, _ = _logit_loss({}, logits, data, log_entropy=True)
    logp = torch.log_softmax(logits.double(), -1)[:, :-1]
    ent = -(logp.exp() * logp).sum(-1)
    valid = data["token_mask"][:, 1:].double() * data["sample_mask"].double().unsqueeze(-1)
    assert metrics["entropy"] == pytest.approx(float((ent * valid).sum() / valid.sum()), rel=1e-6)


def test_host_cp_normalisation_compensation_is_identity_without_cp():
    logits, data, _ = make_batch(15)
    a, _, _ = _logit_loss({}, logits, data)
    b, _, _ = _logit_loss({}, logits, data, host_divides_by_cp=True)
    assert torch.equal(a, b)


def test_wrong_vocab_parallel_rank_is_rejected():
    logits, data, _ = make_batch(16)
    with pytest.raises(ValueError, match="vocab_parallel_rank"):
        _logit_loss({}, logits, data, vocab_parallel_rank=1)


def test_short_logits_are_rejected():
    logits, data, _ = make_batch(17)
    with pytest.raises(ValueError, match="positions"):
        _logit_loss({}, logits[:, :-1], data)


def test_loss_configs_cover_every_level_truncation_and_aggregation():
    """The parallel tests iterate LOSS_CONFIGS: it must span every choice the config offers."""
    from typing import get_args

    from nemo_is_plugin.config import ISCorrectionLevel, LossAggregation, RatioLevel, TruncationType
    from nemo_is_plugin.loss.config_model import ClippedPGLossConfig

    cfgs = [ClippedPGLossConfig(**c) for c in LOSS_CONFIGS.values()]
    assert {c.effective_ratio_level for c in cfgs} == set(get_args(RatioLevel))
    assert {c.effective_is_level for c in cfgs if c.use_importance_sampling_correction} == set(
        get_args(ISCorrectionLevel)
    )
    assert {c.truncated_importance_sampling_type for c in cfgs} - {None} == set(get_args(TruncationType))
    assert {c.effective_loss_aggregation for c in cfgs} == set(get_args(LossAggregation))
    from nemo_is_plugin.config import OldPolicyLogprobs, RejectionAggregation, RejectionStatistic

    rules = [r for c in cfgs for r in c.rejection_rules]
    assert {r.aggregation for r in rules} == set(get_args(RejectionAggregation))
    assert {r.statistic for r in rules} == set(get_args(RejectionStatistic))
    assert {c.old_policy_logprobs for c in cfgs} == set(get_args(OldPolicyLogprobs))


def test_objective_configs_cover_every_objective_and_their_trust_regions_bite():
    """The PP check iterates OBJECTIVE_LOSS_CONFIGS: every policy_objective of this package, and on its batch (seed
    300) each trust region drops some tokens but not all (so that the parallel equality tests the masks)."""
    from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
    from nemo_is_plugin.loss.objectives import BUILTIN_OBJECTIVES

    assert sorted(OBJECTIVE_LOSS_CONFIGS) == sorted(BUILTIN_OBJECTIVES)  # another package's objective: its own tests
    logits, data, _ = make_batch(300, dtype=torch.float64)
    for name, cfg in OBJECTIVE_LOSS_CONFIGS.items():
        assert ClippedPGLossConfig(**cfg).policy_objective == name
        if name not in ("sapo", "gpg", "dro", "reinforce", "on_policy"):  # no trust region to bite
            dropped = reference(cfg, logits, data)[1]["clip_fraction"]
            assert 0 < dropped < 1, name


def test_fp32_tolerance_sits_above_the_single_process_noise_floor():
    """The fp32 single-process loss is itself off from its fp64 value; a parallel fp32 result may be off by as much in
    the other direction, so the fp32 tolerance must cover twice that error, and no more than is needed."""
    worst_loss = worst_grad = 0.0
    for seed in (100, 101, 102, 103):  # the batches of test_parallel_loss
        logits, data, _ = make_batch(seed)
        for cfg in LOSS_CONFIGS.values():
            loss32, _, grad32 = reference(cfg, logits, data)
            loss64, _, grad64 = reference(cfg, logits.double(), data)
            worst_loss = max(worst_loss, float((loss32.double() - loss64).abs() / loss64.abs()))
            worst_grad = max(worst_grad, float((grad32.double() - grad64).abs().max() / grad64.abs().max()))
    assert 2 * worst_loss <= TOL[torch.float32]["rtol"] and 2 * worst_grad <= GRAD_RTOL[torch.float32]
    assert worst_grad > GRAD_RTOL[torch.float32] / 10  # measured 1.6e-6: the gradient tolerance is not loose
