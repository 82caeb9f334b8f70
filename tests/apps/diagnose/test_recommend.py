"""The recommendation: least biased healthy setting, with reasons that name the failing checks and bins."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from nemo_is_plugin.apps.diagnose import diagnose
from nemo_is_plugin.apps.diagnose.analysis import analyze
from nemo_is_plugin.apps.diagnose.recommend import Criteria, check, recommend
from nemo_is_plugin.apps.diagnose.settings import settings_grid
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig

from ._dumps import constant_dump


def _noisy_dump(lengths, std, seed=0, bias=0.0):
    """Responses with p_t - g_t ~ N(bias, std) (g_t = -1)."""
    dump = constant_dump(lengths, 0.0)
    rng = np.random.default_rng(seed)
    prev = dump.generation_logprobs + rng.normal(bias, std, size=dump.num_tokens)
    return replace(dump, prev_logprobs=np.minimum(prev, 0.0))


def test_negligible_mismatch_recommends_the_least_biased_level_without_truncation():
    dump = _noisy_dump([8] * 8 + [64] * 8, std=1e-4)
    report = diagnose(dump)
    rec = report.recommendation
    assert rec.ok and rec.name == "cumulative"
    assert rec.loss_fn == {"use_importance_sampling_correction": True, "is_correction_level": "cumulative"}
    assert ClippedPGLossConfig(**rec.loss_fn).effective_is_level == "cumulative"  # the YAML snippet validates
    assert rec.reasons[0].startswith("cumulative is healthy in every length bin with >= 4 responses: ESS >= 1.00")
    assert any("the mismatch is small" in r for r in rec.reasons)
    assert all(not f for f in rec.failures.values())


def test_collapsing_long_sequences_rule_out_sequence_and_cumulative_levels():
    dump = _noisy_dump([16] * 6 + [1024] * 6, std=0.1, seed=1)
    report = diagnose(dump, edges=[256])
    rec = report.recommendation
    assert rec.ok
    level = ClippedPGLossConfig(**rec.loss_fn).effective_is_level
    assert level in ("token", "sequence_mean")
    fails = rec.failures["sequence"]
    assert any(f.startswith("ESS") and f.endswith("at length >=256") for f in fails), fails
    # every better-ranked setting is listed with the first reason it failed
    assert any(r.startswith("not cumulative: ") for r in rec.reasons)
    assert any(r.startswith("not sequence: ") for r in rec.reasons)


def test_nothing_healthy_says_so_and_picks_the_most_effective_data():
    dump = _noisy_dump([512] * 8, std=3.0, seed=2)
    report = diagnose(dump, levels=("sequence", "cumulative"), truncations=("none", "icepop"))
    rec = report.recommendation
    assert not rec.ok
    assert rec.reasons[0].startswith("no setting meets every criterion")
    assert all(rec.failures[name] for name in rec.failures)


def test_check_names_each_failed_criterion_and_bin():
    dump = constant_dump([4] * 5 + [40] * 5, math.log(3.0))  # token weight 3 everywhere
    settings, _ = settings_grid(("token",), ("none", "tis", "icepop"), bounds={"icepop": (0.5, 2.5)})
    a = analyze(dump, settings, dtype=torch.float64)
    c = Criteria()
    assert check(a.result("token"), a, c) == [
        "mean weight 3 outside [0.5, 2] at length 4-7",
        "mean weight 3 outside [0.5, 2] at length 32-63",
    ]
    assert check(a.result("token+tis[0,2]"), a, c) == [
        "100.0% of tokens truncated (> 20%) at length 4-7",
        "100.0% of tokens truncated (> 20%) at length 32-63",
    ]
    icepop = check(a.result("token+icepop[0.5,2.5]"), a, c)
    assert "100.0% of tokens masked (> 10%) at length 4-7" in icepop
    assert "ESS 0.00 < 0.5 at length 4-7" in icepop
    # thresholds come from the criteria
    assert check(a.result("token"), a, Criteria(mean_band=(0.5, 4.0))) == []


def test_small_bins_are_not_judged_alone():
    # five on-policy 4-token responses, and one 300-token response whose token weights alternate e and 1/e
    dump = constant_dump([4] * 5 + [300], 0.0)
    prev = dump.prev_logprobs.copy()
    prev[20:] += np.where(np.arange(300) % 2 == 0, 1.0, -1.0)
    dump = replace(dump, prev_logprobs=prev)
    a = analyze(dump, settings_grid(("token",), ("none",))[0], dtype=torch.float64)
    assert check(a.result("token"), a, Criteria(min_ess=0.9)) == []  # the 256-1023 bin has 1 < 4 responses
    ess = (math.e + 1 / math.e) ** 2 / (2 * (math.e**2 + math.e**-2))
    assert check(a.result("token"), a, Criteria(min_ess=0.9, min_responses=1)) == [
        f"ESS {ess:.2f} < 0.9 at length 256-1023"
    ]


def test_recommend_needs_settings():
    a = analyze(constant_dump([4], 0.0), [], dtype=torch.float64)
    with pytest.raises(ValueError, match="no settings were analysed"):
        recommend(a)


@pytest.mark.parametrize("n, tentative", [(1, True), (31, True), (32, False)])
def test_a_small_sample_makes_the_recommendation_tentative(n, tentative):
    dump = _noisy_dump([8] * n, std=1e-3)
    settings, _ = settings_grid(("token",), ("none",))
    rec = recommend(analyze(dump, settings))
    assert rec.tentative is tentative
    if tentative:
        assert rec.warnings == [w for w in rec.warnings if f"only {n} response(s) with a valid token" in w]
        assert rec.ok  # the thresholds still apply; the sample size only qualifies the verdict


def test_recommendation_yaml_is_a_loss_fn_section_that_reloads():
    import yaml

    dump = _noisy_dump([8] * 40, std=1e-3)
    rec = recommend(analyze(dump, settings_grid(("sequence",), ("tis",))[0]))
    section = yaml.safe_load(rec.yaml())["loss_fn"]
    assert section == rec.loss_fn and ClippedPGLossConfig(**section).truncated_importance_sampling_ratio == 2.0


def test_negative_chi2_seq_gets_an_explanation_not_a_heavy_tail_note():
    dump = constant_dump([6] * 40, -0.01)  # w = e^-0.06 < 1 for every sequence: E[w^2] - 1 < 0
    rec = recommend(analyze(dump, settings_grid(("token",), ("none",))[0]))
    note = [r for r in rec.reasons if r.startswith("chi2_seq = ")]
    assert len(note) == 1 and "< 0: a chi-square estimate E[w^2] - 1 below 0" in note[0]
