"""Per-setting weight statistics and mismatch metrics, checked against closed forms on dumps with known log-probs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nemo_is_plugin.apps.diagnose.analysis import analyze
from nemo_is_plugin.apps.diagnose.binning import LengthBin, length_bins
from nemo_is_plugin.apps.diagnose.settings import make_setting, settings_grid
from nemo_is_plugin.loss.is_weights import MAX_LOG_WEIGHT

from ._dumps import constant_dump

LENGTHS = [1, 4, 16, 64]


def _stats(values: np.ndarray) -> dict[str, float]:
    v = np.asarray(values, dtype=np.float64)
    return {
        "mean": v.mean(),
        "std": v.std(),
        "min": v.min(),
        "max": v.max(),
        "ess": v.sum() ** 2 / (len(v) * (v**2).sum()),
    }


def _expected_weights(level: str, lengths, delta: float) -> np.ndarray:
    """Token weights (one per valid token, response by response) for p - g = delta on every token."""
    out = []
    for n in lengths:
        t = np.arange(1, n + 1)
        out.append(
            {
                "token": np.full(n, math.exp(delta)),
                "sequence": np.full(n, math.exp(n * delta)),
                "sequence_mean": np.full(n, math.exp(delta)),
                "cumulative": np.exp(t * delta),
            }[level]
        )
    return np.concatenate(out)


@pytest.mark.parametrize("level", ["token", "sequence", "sequence_mean", "cumulative"])
@pytest.mark.parametrize("delta", [-0.05, 0.02])
def test_weight_stats_match_closed_forms(level, delta):
    dump = constant_dump(LENGTHS, delta, masked_tail=[0, 2, 0, 5])  # masked padding must not count
    a = analyze(dump, [make_setting(level)], dtype=torch.float64)
    r = a.settings[0]
    want = _stats(_expected_weights(level, LENGTHS, delta))
    got = r.overall
    for key in ("mean", "std", "min", "max", "ess"):
        # abs: sequence_mean divides by (count + 1e-8) in the loss, so equal weights differ by ~delta * 1e-8 / n
        assert getattr(got, key) == pytest.approx(want[key], rel=1e-9, abs=1e-9), key
    assert got.n_tokens == sum(LENGTHS) and got.n_responses == len(LENGTHS)
    assert got.truncated == 0.0 and got.masked == 0.0 and got.saturated == 0.0
    # bins: two octaves per bin here (7 octaves, at most 6 bins), one response each; a bin's stats are its response's
    assert [b.label for b in a.bins] == ["1-3", "4-15", "16-63", "64-255"]
    for n, st in zip(LENGTHS, r.by_bin):
        w = _expected_weights(level, [n], delta)
        assert st.mean == pytest.approx(w.mean(), rel=1e-9) and st.n_tokens == n
    # per-response summaries used by the plots
    log_w = [np.log(_expected_weights(level, [n], delta)).mean() for n in LENGTHS]
    np.testing.assert_allclose(r.response_log_w, log_w, rtol=1e-9, atol=1e-9)


def test_on_policy_dump_gives_weight_one_and_zero_mismatch():
    dump = constant_dump(LENGTHS, 0.0)
    settings, _ = settings_grid(truncations=("none", "tis", "icepop", "seq-mask-tis", "seq-mis", "geo-rs"))
    a = analyze(dump, settings, dtype=torch.float32)
    for r in a.settings:
        o = r.overall
        assert (o.mean, o.std, o.min, o.max, o.ess, o.truncated, o.masked) == (1, 0, 1, 1, 1, 0, 0), r.setting.name
    for key in (
        "mismatch_kl_k1",
        "mismatch_kl_k3",
        "log_ppl_diff",
        "log_ppl_abs_diff",
        "chi2_token",
        "chi2_seq",
        "max_abs_log_ratio",
    ):
        # metrics divide by (count + 1e-8) like NeMo-RL's masked_mean: exact to ~1e-8 / count
        assert a.mismatch[key] == pytest.approx(0.0, abs=1e-8), key
    assert a.mismatch["training_log_ppl"] == pytest.approx(1.0) and a.mismatch["responses"] == 4


def test_mismatch_metrics_closed_forms():
    delta = 0.1
    a = analyze(constant_dump(LENGTHS, delta), [make_setting("token")], dtype=torch.float64)
    m = a.mismatch
    assert m["mismatch_kl_k1"] == pytest.approx(-delta)  # E[g - p]
    assert m["mismatch_kl_k3"] == pytest.approx(math.expm1(delta) - delta)
    assert m["log_ppl_diff"] == pytest.approx(-delta)  # mean_t g - mean_t p
    assert m["chi2_token"] == pytest.approx(math.exp(2 * delta) - 1)
    assert m["chi2_seq"] == pytest.approx(np.mean([math.exp(2 * delta * n) for n in LENGTHS]) - 1)
    assert m["max_abs_log_ratio"] == pytest.approx(delta)
    # per bin: one response each
    for n, mb in zip(LENGTHS, a.mismatch_by_bin):
        assert mb["chi2_seq"] == pytest.approx(math.exp(2 * delta * n) - 1) and mb["tokens"] == n


def test_truncation_and_masking_fractions():
    # two responses of 4 tokens: one on-policy, one with weight 3 per token (> tis C=2, inside icepop [0.5, 5])
    # and a third with weight 10 per token (outside icepop)
    dump = constant_dump([4], 0.0)
    from dataclasses import replace

    d3, d10 = constant_dump([4], math.log(3.0)), constant_dump([4], math.log(10.0))
    dump = replace(
        dump,
        generation_logprobs=np.concatenate([dump.generation_logprobs, d3.generation_logprobs, d10.generation_logprobs]),
        prev_logprobs=np.concatenate([dump.prev_logprobs, d3.prev_logprobs, d10.prev_logprobs]),
        mask=np.ones(12, bool),
        cu_seqlens=np.array([0, 4, 8, 12]),
    )
    tis = make_setting("token", "tis", high=2.0)
    icepop = make_setting("token", "icepop", low=0.5, high=5.0)
    a = analyze(dump, [tis, icepop], dtype=torch.float64)
    t, i = a.result(tis.name).overall, a.result(icepop.name).overall
    assert t.truncated == pytest.approx(8 / 12) and t.masked == 0.0 and t.max == pytest.approx(2.0)
    assert t.mean == pytest.approx((4 * 1 + 8 * 2) / 12)
    assert i.masked == pytest.approx(4 / 12) and i.truncated == 0.0 and i.max == pytest.approx(3.0)


def test_huge_weights_saturate_at_the_guard_and_truncation_is_exact():
    # sequence log-weight 100 * 1.0: far beyond any truncation bound; explicit levels saturate at e^MAX_LOG_WEIGHT
    dump = constant_dump([100], 1.0)
    s = make_setting("sequence")
    for dtype in (torch.float32, torch.float64):
        st = analyze(dump, [s], dtype=dtype).settings[0].overall
        assert st.saturated == 1.0 and st.masked == 0.0
        assert st.mean == pytest.approx(math.exp(MAX_LOG_WEIGHT), rel=1e-6)
    # truncation of a saturated weight is still exact (the flag says the raw weight was beyond the guard)
    st_tis = analyze(dump, [make_setting("sequence", "tis", high=2.0)], dtype=torch.float32).settings[0].overall
    assert st_tis.mean == pytest.approx(2.0) and st_tis.truncated == 1.0 and st_tis.saturated == 1.0


def test_empty_responses_are_counted_not_binned():
    from dataclasses import replace

    dump = constant_dump([3, 5], 0.1)
    dump = replace(dump, mask=np.array([0, 0, 0, 1, 1, 1, 1, 1], bool))
    a = analyze(dump, [make_setting("sequence_mean")], dtype=torch.float64)
    assert a.empty_responses == 1
    assert [b.label for b in a.bins] == ["4-7"]
    assert a.settings[0].overall.n_tokens == 5 and a.settings[0].overall.n_responses == 1
    assert math.isnan(a.settings[0].response_mean[0])


def test_grid_skips_what_the_config_rejects():
    settings, skipped = settings_grid(("token", "sequence"), ("none", "seq-mask-tis"))
    assert [s.name for s in settings] == ["token", "token+seq-mask-tis[0.999,1.002]", "sequence"]
    assert skipped[0][0] == "sequence+seq-mask-tis[0.999,1.002]"
    assert "is_correction_level='sequence'" in skipped[0][1]
    with pytest.raises(ValueError, match="unknown truncation 'clip'"):
        settings_grid(("token",), ("clip",))
    with pytest.raises(ValueError, match="unknown IS level 'prefix'"):
        settings_grid(("prefix",), ("none",))


@pytest.mark.parametrize(
    ("lengths", "kw", "labels"),
    [
        ([1, 2, 3, 100, 5000], {}, ["1-7", "64-511", "4096-32767"]),
        ([16, 17, 2048], {"max_bins": 3}, ["16-127", "1024-8191"]),
        ([7, 7], {}, ["4-7"]),
        ([16, 300, 2048], {"edges": [256, 1024]}, ["1-255", "256-1023", ">=1024"]),
        ([0, 0], {}, []),
    ],
)
def test_length_bins(lengths, kw, labels):
    bins = length_bins(np.array(lengths), **kw)
    assert [b.label for b in bins] == labels
    covered = sum(int(b.contains(np.array(lengths)).sum()) for b in bins)
    assert covered == sum(1 for n in lengths if n > 0)  # every non-empty response in exactly one bin


def test_length_bin_label_and_membership():
    b = LengthBin(8, 16)
    assert b.label == "8-15" and b.contains(np.array([7, 8, 15, 16])).tolist() == [False, True, True, False]
    assert LengthBin(4, None).label == ">=4"
