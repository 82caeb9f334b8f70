"""Truncation, masking and rejection of IS weights (one vocabulary), hand-computed in float64."""

import math

import pytest
import torch

from nemo_is_plugin.loss.correction import compute_is_correction
from nemo_is_plugin.loss.layout import TokenLayout

F64 = torch.float64
# Two sequences of 3 tokens; log w = p - g per token:
#   seq 0: [log 3, log 0.5, log 1.2]   sum = log 1.8, mean = log(1.8)/3
#   seq 1: [log 0.1, log 1.0, (masked: log 50)]
LOGW = torch.log(torch.tensor([[3.0, 0.5, 1.2], [0.1, 1.0, 50.0]], dtype=F64))
PREV = torch.full((2, 3), -1.0, dtype=F64)
GEN = PREV - LOGW
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=F64)
LAY = TokenLayout.padded(2, 3)


def run(
    level="token",
    nemo_rl_exact=False,
    truncation=None,
    low=None,
    high=None,
    veto=None,
    bn=False,
    apply=True,
    rejection=None,
    band=(None, None),
):
    return compute_is_correction(
        PREV,
        GEN,
        MASK,
        MASK,
        LAY,
        level=level,
        nemo_rl_exact=nemo_rl_exact,
        apply_weights=apply,
        truncation=truncation,
        low=low,
        high=high,
        veto_threshold=veto,
        batch_normalize=bn,
        rejection=rejection,
        rejection_low=band[0],
        rejection_high=band[1],
    )


@pytest.mark.parametrize("nemo_rl_exact", [True, False])
def test_tis_truncates(nemo_rl_exact):
    c = run(truncation="tis", low=0.2, high=2.0, nemo_rl_exact=nemo_rl_exact)
    want = torch.tensor([[2.0, 0.5, 1.2], [0.2, 1.0, 2.0]], dtype=F64)
    assert torch.allclose(c.weights, want)
    assert c.out_of_band.tolist() == [[True, False, False], [True, False, True]]
    assert not c.rejected.any()


def test_tis_log_space_never_overflows_but_the_nemo_rl_exact_path_zeroes_like_nemo_rl():
    prev = torch.tensor([[0.0]], dtype=torch.float32)
    gen = torch.tensor([[-100.0]], dtype=torch.float32)  # log w = 100: exp overflows float32
    m = torch.ones(1, 1)
    lay = TokenLayout.padded(1, 1)
    kw = dict(apply_weights=True, truncation="tis", low=0.5, high=2.0, veto_threshold=None, batch_normalize=False)
    new = compute_is_correction(prev, gen, m, m, lay, level="token", nemo_rl_exact=False, **kw)
    old = compute_is_correction(prev, gen, m, m, lay, level="token", nemo_rl_exact=True, **kw)
    assert new.weights.item() == 2.0  # truncated in log space
    assert old.weights.item() == 0.5  # NeMo-RL: inf -> 0 by nan_to_num, then clamped up to min (golden 089)


def test_icepop_masks_tokens_out_of_band():
    c = run(truncation="icepop", low=0.2, high=2.0)
    assert torch.allclose(c.weights, torch.tensor([[0.0, 0.5, 1.2], [0.0, 1.0, 0.0]], dtype=F64))
    assert c.rejected.tolist() == [[True, False, False], [True, False, True]]


def test_seq_mask_tis_keeps_token_weights_of_sequences_whose_geometric_mean_is_in_band():
    # geo means: seq 0 = 1.8^(1/3) = 1.216, seq 1 = sqrt(0.1) = 0.316
    c = run(truncation="seq-mask-tis", low=0.5, high=1.5, nemo_rl_exact=True)
    assert torch.allclose(c.weights, torch.tensor([[3.0, 0.5, 1.2], [0.0, 0.0, 0.0]], dtype=F64))
    assert c.seq_out_of_band.tolist() == [False, True]


def test_seq_mis_rejects_by_product():
    c = run(level="sequence", truncation="seq-mis", low=0.5, high=2.0)  # products 1.8 and 0.1
    assert torch.allclose(c.weights, torch.tensor([[1.8] * 3, [0.0] * 3], dtype=F64))
    c = run(level="sequence", truncation="seq-mis", low=0.5, high=1.5)
    assert torch.allclose(c.weights, torch.zeros(2, 3, dtype=F64))


def test_geo_rs_without_weights_is_a_pure_mask():
    c = run(truncation="geo-rs", low=0.9, high=1.3, apply=False)
    assert torch.allclose(c.weights, torch.tensor([[1.0] * 3, [0.0] * 3], dtype=F64))


def test_veto_rejects_sequences_with_a_tiny_token_weight():
    c = run(veto=0.2)  # seq 1 holds w = 0.1 < 0.2; its masked 50 is ignored
    assert torch.allclose(c.weights, torch.tensor([[3.0, 0.5, 1.2], [0.0, 0.0, 0.0]], dtype=F64))


def test_batch_normalize_token_and_sequence_levels():
    c = run(truncation="tis", high=2.0, bn=True)
    raw = torch.tensor([[2.0, 0.5, 1.2], [0.1, 1.0, 2.0]], dtype=F64)
    mean = (2.0 + 0.5 + 1.2 + 0.1 + 1.0) / 5
    assert math.isclose(c.batch_norm_factor.item(), mean, rel_tol=1e-7)  # denominators carry +1e-8
    assert torch.allclose(c.weights, raw / mean, rtol=1e-7)
    s = run(level="sequence", bn=True)  # sequence weights 1.8 and 0.1: mean over sequences 0.95
    assert math.isclose(s.batch_norm_factor.item(), 0.95, rel_tol=1e-7)
    assert torch.allclose(s.weights[:, 0], torch.tensor([1.8, 0.1], dtype=F64) / 0.95)


def test_is_off_gives_unit_weights_but_keeps_raw_for_metrics():
    c = run(apply=False)
    assert torch.equal(c.weights, torch.ones(2, 3, dtype=F64))
    assert torch.allclose(c.raw_weights, torch.exp(LOGW))


def test_rejection_on_top_of_tis_truncates_then_rejects():
    """Geo-RS + token TIS (verl preset): geometric means 1.8^(1/3) = 1.216 (kept) and 0.1^(1/2) = 0.316 (rejected)."""
    c = run(truncation="tis", high=2.0, rejection="geo-rs", band=(0.9, 1.3))
    assert torch.allclose(c.weights, torch.tensor([[2.0, 0.5, 1.2], [0.0, 0.0, 0.0]], dtype=F64))
    assert c.rejected.tolist() == [[False] * 3, [True] * 3]
    assert c.out_of_band.tolist() == [[True, False, False], [False, False, True]]  # the truncation's (3, 50 > 2)
    # Seq-MIS + TIS: products 1.8 (in [0.5, 2]) and 0.1 (rejected); the truncation still caps 3 -> 2
    m = run(truncation="tis", high=2.0, rejection="seq-mis", band=(0.5, 2.0))
    assert torch.allclose(m.weights, torch.tensor([[2.0, 0.5, 1.2], [0.0, 0.0, 0.0]], dtype=F64))
    # a band that keeps both sequences leaves the truncated weights as they are
    keep_all = run(truncation="tis", high=2.0, rejection="seq-mis", band=(0.05, 2.0))
    assert torch.equal(keep_all.weights, run(truncation="tis", high=2.0).weights)


def test_rejection_is_applied_after_batch_normalisation_like_verl():
    """verl divides by the mean of the truncated weights over all valid tokens, rejected sequences included."""
    c = run(truncation="tis", high=2.0, bn=True, rejection="geo-rs", band=(0.9, 1.3))
    mean = (2.0 + 0.5 + 1.2 + 0.1 + 1.0) / 5
    assert math.isclose(c.batch_norm_factor.item(), mean, rel_tol=1e-7)
    assert torch.allclose(c.weights[0], torch.tensor([2.0, 0.5, 1.2], dtype=F64) / mean, rtol=1e-7)
    assert torch.equal(c.weights[1], torch.zeros(3, dtype=F64))


def test_rejection_equals_the_same_rule_as_truncation_type_when_there_is_no_truncation():
    for kind, band in (("seq-mis", (0.5, 2.0)), ("geo-rs", (0.9, 1.3))):
        as_field = run(rejection=kind, band=band)
        as_type = run(truncation=kind, low=band[0], high=band[1])
        assert torch.equal(as_field.weights, as_type.weights) and torch.equal(as_field.rejected, as_type.rejected)
