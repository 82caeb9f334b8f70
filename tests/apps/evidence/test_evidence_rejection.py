"""What each IS rejection rule rejects (nemo_is_plugin/apps/evidence/rejection.py): invariants on small synthetic
batches at fixed seeds."""

import math

import numpy as np
import pytest
import torch

from nemo_is_plugin.apps.evidence import rejection as rej
from nemo_is_plugin.config import RejectionRule
from nemo_is_plugin.config.rejection_rule import REJECTION_LOG_RATIO_CLAMP
from nemo_is_plugin.loss import ClippedPGLoss, LossInputs
from nemo_is_plugin.loss.layout import TokenLayout

NUM_SEQS, LENGTH = 48, 64


@pytest.fixture(scope="module")
def batch():
    return rej.make_batch(num_seqs=NUM_SEQS, length=LENGTH, seed=7)


@pytest.fixture(scope="module")
def sweep(batch):
    return rej.run_mismatch_sweep(batch)


def test_zero_mismatch_is_no_mismatch_and_rejects_nothing(batch, sweep):
    assert torch.equal(batch.prev_logprobs(0.0), batch.rollout_logprobs())
    assert sweep["mismatches"][0] == 0.0
    for s, row in sweep["statistics"].items():
        assert row["rejected_fraction"][0] == 0.0, s


def test_thresholds_are_matched_at_the_reference_mismatch(sweep):
    """Each rule's threshold is a quantile of its own statistic at the reference: all reject the target share there
    (up to the quantile's interpolation between two tokens), and they part away from it."""
    i = sweep["mismatches"].index(rej.REFERENCE_MISMATCH)
    n = NUM_SEQS * LENGTH
    fractions = {s: row["rejected_fraction"] for s, row in sweep["statistics"].items()}
    for s, f in fractions.items():
        assert abs(f[i] - rej.TARGET_FRACTION) <= 1.0 / n, s
    # prob_diff <= 1 saturates where the log-ratio statistics keep growing: at the largest mismatch it rejects less
    assert fractions["prob_diff"][-1] < fractions["k1"][-1] - 0.1


def test_rejected_fraction_grows_with_mismatch(sweep):
    """Non-decreasing along the sweep within one binomial standard error (a token's log-ratio need not grow
    monotonically in m: the normaliser moves too), and engaged at the largest mismatch."""
    n = NUM_SEQS * LENGTH
    for s, row in sweep["statistics"].items():
        f = np.array(row["rejected_fraction"])
        se = np.sqrt(np.maximum(f[1:] * (1 - f[1:]), 1.0 / n) / n)
        assert np.all(np.diff(f) >= -se), (s, f)
        assert f[-1] > 0.2, s


def test_k2_rejects_the_same_tokens_as_the_symmetric_k1_band(sweep):
    """k2 = y^2 / 2 <= c^2 / 2 is |y| <= c: matched at the same reference (both quantiles fall between the same two
    tokens' statistics), the two rules reject the same tokens at every mismatch."""
    k1, k2 = sweep["statistics"]["k1"], sweep["statistics"]["k2"]
    assert k1["rejected_count"] == k2["rejected_count"]
    assert k1["low_prob_share"] == k2["low_prob_share"]
    assert k1["rejected_count"][-1] > 0


def test_prob_diff_rejects_fewer_rare_tokens_than_the_log_ratio_statistics(sweep):
    """With matched thresholds, k1 / k3 spend a larger share of their rejections on tokens mu sampled at < 0.1 (large
    log-ratio, small |p - q|) than such tokens hold in the batch; prob_diff a smaller one."""
    i = sweep["mismatches"].index(rej.REFERENCE_MISMATCH)
    share = {s: row["low_prob_share"][i] for s, row in sweep["statistics"].items()}
    base = sweep["low_prob_share_all_tokens"]
    assert share["prob_diff"] < base < share["k1"]
    assert share["k1"] - share["prob_diff"] > 0.2
    assert share["k3"] - share["prob_diff"] > 0.2


def test_maximal_thresholds_reject_nothing(batch):
    """The largest bound each validated rule accepts (prob_diff 1; k1 / k2 / k3 at the clamp's +-20) keeps every token
    at the largest mismatch."""
    c = REJECTION_LOG_RATIO_CLAMP
    maximal = {"k1": c, "k2": c * c / 2, "k3": math.exp(c) - 1 - c, "prob_diff": 1.0}
    prev, gen = batch.prev_logprobs(rej.MISMATCHES[-1]), batch.rollout_logprobs()
    for s, bound in maximal.items():
        assert rej.rejection_summary(rej.token_rule(s, bound), prev, gen)["rejected_count"] == 0, s


def test_the_loss_metric_reads_the_same_rejected_fraction(batch, sweep):
    """The experiment applies loss/rejection.py directly; the loss configured with the same rule reports the same
    share in its metric ``is_rejection_token_<statistic>_rejected_fraction``."""
    i = sweep["mismatches"].index(1.0)
    prev, gen = batch.prev_logprobs(1.0), batch.rollout_logprobs()
    ones = torch.ones_like(prev)
    rules = [rej.token_rule(s, c).model_dump() for s, c in sweep["thresholds"].items()]
    config = {
        "reference_policy_kl_penalty": 0.0,
        "use_importance_sampling_correction": True,
        "importance_sampling_rejection_rules": rules,
    }
    inputs = LossInputs(
        curr_logprobs=prev,
        prev_logprobs=prev,
        generation_logprobs=gen,
        reference_logprobs=None,
        advantages=ones,
        token_mask=ones,
        sample_mask=ones[:, 0],
        global_valid_seqs=float(NUM_SEQS),
        global_valid_toks=float(NUM_SEQS * LENGTH),
    )
    _, metrics = ClippedPGLoss(config).compute(inputs, TokenLayout.padded(NUM_SEQS, LENGTH))
    for s, row in sweep["statistics"].items():
        measured = float(metrics[f"is_rejection_token_{s}_rejected_fraction"])
        assert measured == pytest.approx(row["rejected_fraction"][i], rel=1e-6), s


def test_sequence_max_grows_and_sequence_mean_falls_with_length():
    res = rej.run_sequence_lengths(num_seqs=64, lengths=(8, 64, 512), seed=3)
    frac = {name: np.array(f) for name, f in res["rejected_sequence_fraction"].items()}
    for name, f in frac.items():
        assert abs(f[0] - rej.TARGET_SEQUENCE_FRACTION) <= 1.0 / 64, name  # matched at the shortest length
    for s in rej.SEQUENCE_STATISTICS:
        mx, mean = frac[f"sequence_max_{s}"], frac[f"sequence_mean_{s}"]
        assert np.all(np.diff(mx) >= 0) and mx[-1] > 0.9, s  # one bad token in ever more tokens
        assert mean[-1] < 0.05, s  # the mean concentrates below a threshold set above its expectation


def test_sequence_max_rejects_exactly_the_sequences_with_a_rejected_token(batch):
    """sequence_max <= c fails iff some token's statistic exceeds c: the token rule at the same bound says which."""
    prev, gen = batch.prev_logprobs(rej.REFERENCE_MISMATCH), batch.rollout_logprobs()
    for s in ("k3", "prob_diff"):
        c = rej.matched_threshold(s, "token", prev, gen, rej.TARGET_FRACTION)
        seq_rule = RejectionRule(statistic=s, aggregation="sequence_max", max=c)
        seq_rejected = ~rej.apply_rule(seq_rule, prev, gen).keep[:, 0]
        token_rejected = ~rej.apply_rule(RejectionRule(statistic=s, aggregation="token", max=c), prev, gen).keep
        assert torch.equal(seq_rejected, token_rejected.any(-1)), s
        assert 0 < int(seq_rejected.sum()) < NUM_SEQS


def test_headline_reads_the_sweep():
    res = rej.run_rejection(num_seqs=16, length=32, lengths=(8, 32), seed=0)
    head = rej.headline(res)
    assert set(head) >= {"token_k1", "token_k2", "token_k3", "token_prob_diff", "all tokens", "sequence_max_k3"}
    sweep = res["mismatch_sweep"]
    assert head["token_k3"]["matched threshold"] == sweep["thresholds"]["k3"]
    i = sweep["mismatches"].index(2.0)
    prob_diff = sweep["statistics"]["prob_diff"]
    assert head["token_prob_diff"]["rejected fraction at m=2"] == prob_diff["rejected_fraction"][i]
