"""Each metric's denominator as the MetricBook declares it where it is emitted, against the previous mechanism (name
lists in adapters/normalizers.py applied to the metric names of a fake-batch call), on a broad set of configs."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.golden_calls import load_suite, suites
from helpers.loss_strategies import HYPOTHESIS_SETTINGS, loss_configs
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_is_plugin.adapters.normalizers import metric_normalizer, probe_metric_names
from nemo_is_plugin.adapters.protocol import MetricNormalizer
from nemo_is_plugin.config import ClippedPGLossConfig
from nemo_is_plugin.loss import ClippedPGLoss
from nemo_is_plugin.recipes import load_loss_spec

ROOT = Path(__file__).resolve().parents[2]


def _old(config: ClippedPGLossConfig) -> dict:
    return {n: metric_normalizer(n, config) for n in probe_metric_names(ClippedPGLoss(config))}


def _new(config: ClippedPGLossConfig) -> dict:
    return {k: MetricNormalizer(v.value) for k, v in ClippedPGLoss(config).metric_denominators().items()}


def _golden_configs() -> list[dict]:
    out = []
    for suite in suites():
        for case in load_suite(suite):
            cfg = case.get("config")
            if isinstance(cfg, dict) and "error" not in case and "expect_error" not in case:
                try:
                    ClippedPGLossConfig(**cfg)
                except Exception:  # the golden cases of refused configs
                    continue
                out.append(cfg)
    return out


@pytest.mark.parametrize("i", range(len(_golden_configs())))
def test_golden_configs(i):
    cfg = ClippedPGLossConfig(**_golden_configs()[i])
    assert _new(cfg) == _old(cfg)


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").rglob("*.yaml")))
def test_recipes(path):
    spec = load_loss_spec(ROOT / path)
    assert _new(spec.config) == _old(spec.config)


RULES = [
    [{"option": "token_k3", "threshold": 0.1}],
    [{"option": "seq_max_k2", "threshold": 2.0}, {"option": "seq_sum_k1", "threshold": 3.0}],
    [{"option": "seq_mean_k3", "threshold": 0.5}],
]


@settings(max_examples=400, **HYPOTHESIS_SETTINGS)
@given(cfg=loss_configs(), rules=st.sampled_from([None, *RULES]), token_sum=st.booleans())
def test_drawn_configs(cfg, rules, token_sum):
    kw = cfg.model_dump(exclude_unset=True)
    if rules is not None:
        kw["importance_sampling_rejection_rules"] = rules
    if token_sum and not kw.get("sequence_level_importance_ratios"):
        kw["loss_aggregation"] = "token-sum"
    try:
        cfg = ClippedPGLossConfig(**kw)
    except Exception:
        return
    assert _new(cfg) == _old(cfg)
