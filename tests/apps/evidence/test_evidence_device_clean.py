"""The evidence and diagnostics functions that take tensors run under the CPU device guard (helpers/device_guard.py)
with unchanged results: they build their layouts and masks on the inputs' device and copy to the host only for
numpy. (The simulations' own problem generators, and ``diagnose.analyze``, which reads a file dump into host tensors,
are host-side by design and are not run under the guard.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.device_guard import assert_identical, run_guarded_and_plain

from nemo_is_plugin.apps.evidence.ctpo_variance import estimator_gradients, make_policy
from nemo_is_plugin.apps.evidence.is_collapse import IS_LEVELS, level_weights, summarise
from nemo_is_plugin.apps.evidence.kl_gradient_bias import (
    ALL_VARIANTS,
    expected_gradient,
    make_problem,
    per_sample_penalty,
)
from nemo_is_plugin.apps.evidence.objective_shapes import gradient_weights, per_token_disagreement, sequence_ratios
from nemo_is_plugin.apps.evidence.objectives import (
    OBJECTIVE_CONFIGS,
    drift_gradient,
    drift_summary,
    loss_gradient,
    make_batch,
)
from nemo_is_plugin.apps.evidence.rejection import make_batch as make_mismatch_batch
from nemo_is_plugin.apps.evidence.rejection import run_mismatch_sweep
from nemo_is_plugin.apps.evidence.stats import hotelling_test, mean_estimate, weight_summary
from nemo_is_plugin.loss.correction import compute_is_correction
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.mismatch_metrics import finalize_metrics, mismatch_metric_sums


def _mismatch(seed: int = 0) -> torch.Tensor:
    return 0.05 * torch.randn(6, 40, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _plain(value):
    """numpy arrays and dataclasses as comparable Python values."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    if hasattr(value, "__dataclass_fields__"):
        return {k: _plain(getattr(value, k)) for k in value.__dataclass_fields__}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@pytest.mark.parametrize("level", IS_LEVELS)
def test_is_collapse_level_weights(level):
    x = _mismatch()
    got, want = run_guarded_and_plain(lambda: level_weights(x, level))
    assert_identical(got, want)


def test_is_collapse_summary_and_weight_stats():
    x = _mismatch(1)
    got, want = run_guarded_and_plain(lambda: (summarise(x), weight_summary(torch.exp(x))))
    assert_identical(got, want)


def test_mean_estimate_and_hotelling_test():
    g = torch.Generator().manual_seed(2)
    samples = torch.randn(200, 3, generator=g, dtype=torch.float64)
    target = torch.zeros(3, dtype=torch.float64)
    got, want = run_guarded_and_plain(lambda: _plain((mean_estimate(samples), hotelling_test(samples, target))))
    assert_identical(got, want)


@pytest.mark.parametrize("variant", ALL_VARIANTS, ids=[v.name for v in ALL_VARIANTS])
def test_kl_gradient_bias_per_sample_penalty(variant):
    problem = make_problem(seed=3)
    actions = torch.tensor([0, 2, 2, 5, 1])
    got, want = run_guarded_and_plain(
        lambda: (per_sample_penalty(problem, actions, variant), expected_gradient(problem, variant))
    )
    assert_identical(got, want)


def test_ctpo_estimator_gradients():
    policy = make_policy(num_actions=5, horizon=6, seed=4)
    actions = torch.randint(0, 5, (7, 6), generator=torch.Generator().manual_seed(5))
    got, want = run_guarded_and_plain(lambda: (estimator_gradients(policy, actions), policy.per_action_term()))
    assert_identical(got, want)


@pytest.mark.parametrize("name", list(OBJECTIVE_CONFIGS))
def test_objective_loss_gradient(name):
    batch = make_batch(num_seqs=3, length=10, num_actions=5, seed=7)
    got, want = run_guarded_and_plain(lambda: loss_gradient(batch, 0.7, OBJECTIVE_CONFIGS[name]))
    assert_identical(got, want)


def test_objective_shapes():
    batch = make_batch(num_seqs=3, length=10, num_actions=5, seed=8)
    ratios = torch.tensor([0.5, 1.0, 1.7], dtype=torch.float64)

    def run():
        return (
            drift_gradient(batch, 0.4),
            drift_summary(batch, 0.4),
            sequence_ratios(batch, 0.4, 0.4),
            per_token_disagreement(batch, 1.0, 0.02),
            gradient_weights(OBJECTIVE_CONFIGS["sapo"], ratios, -1.0),
        )

    got, want = run_guarded_and_plain(run)
    assert_identical(got, want)


def test_rejection_sweep():
    batch = make_mismatch_batch(num_seqs=3, length=10, num_actions=5, seed=9)
    got, want = run_guarded_and_plain(lambda: run_mismatch_sweep(batch, (0.0, 0.5, 2.0)))
    assert_identical(got, want)


def test_mismatch_metrics_and_is_correction():
    g = torch.Generator().manual_seed(6)
    prev = -torch.rand(4, 9, generator=g, dtype=torch.float64)
    gen = prev - 0.1 * torch.randn(4, 9, generator=g, dtype=torch.float64)
    tm = (torch.rand(4, 9, generator=g) > 0.2).double()
    sm = torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=torch.float64)

    def run():
        layout = TokenLayout.padded(4, 9, device=prev.device)
        sums = mismatch_metric_sums(prev, gen, tm, sm, layout, 20.0, 3.0)
        corr = compute_is_correction(
            prev,
            gen,
            tm,
            tm,
            layout,
            level="sequence_mean",
            nemo_rl_exact=False,
            apply_weights=True,
            truncation="icepop",
            low=0.8,
            high=1.2,
            veto_threshold=1e-3,
            batch_normalize=True,
        )
        return finalize_metrics({k: float(v) for k, v in sums.items()}), corr.weights, corr.rejected

    got, want = run_guarded_and_plain(run)
    assert_identical(got, want)
