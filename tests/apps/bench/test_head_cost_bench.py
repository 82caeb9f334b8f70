"""``nemo-is bench --score-centering-head`` (apps/bench/head_cost.py): the CLI end to end at tiny shapes (a child
process), the run's rows and ratios, the sampler-like head ids, the k = 32 target on a result at its threshold and
its absence for a quick run, the refusals of bad settings."""

from __future__ import annotations

import json

import pytest
import torch

from nemo_is_plugin.apps.bench.head_cost import (
    HEAD_PATHS,
    HeadCostConfig,
    count_steps,
    head_cost_targets,
    head_ids_like_a_sampler,
    run_head_cost,
)

from ._cli import run_cli


def test_the_cli_runs_every_path_at_every_k_and_writes_json(tmp_path):
    proc = run_cli("bench", "--score-centering-head", "--quick", "--head-k", "8", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "head_cost.json").read_text())
    assert {(r["path"], r["k"]) for r in results["rows"]} == {(p, k) for p in HEAD_PATHS for k in (0, 8)}
    assert "k = 8 / k = 0" in proc.stdout and "not met" not in proc.stdout  # no target on a quick run


def test_a_run_times_every_job_and_its_ratios_are_to_the_same_path_without_the_head():
    cfg = HeadCostConfig.for_device("cpu", quick=True, ks=(4,), paths=("fused_linear", "from_logits"))
    steps: list[str] = []
    results = run_head_cost(cfg, steps.append)
    assert len(steps) == count_steps(cfg)
    rows = {(r["path"], r["k"]): r for r in results["rows"]}
    assert set(rows) == {(p, k) for p in ("fused_linear", "from_logits") for k in (0, 4)}
    for (path, _k), row in rows.items():
        assert row["seconds"] > 0
        assert row["ratio"] == pytest.approx(row["seconds"] / rows[(path, 0)]["seconds"])
    assert results["config"]["quick"] and head_cost_targets(results) == []


def test_head_ids_look_like_a_sampler_head():
    target = torch.arange(70) % 50
    ids = head_ids_like_a_sampler(target, 50, 5, torch.Generator().manual_seed(0))
    assert ids.shape == (70, 5)
    assert (ids[::7, -1] == -1).all() and ((ids >= -1) & (ids < 50)).all()
    assert 0.7 < float((ids[:, 0] == target).double().mean()) <= 1.0  # the label heads most rows


def test_the_target_is_the_k32_ratio_at_five_percent():
    rows = [
        dict(model="m", path="fused_linear", k=32, ratio=1.05),
        dict(model="m", path="from_logits", k=32, ratio=1.0501),
        dict(model="m", path="fused_linear", k=128, ratio=2.0),
    ]
    got = head_cost_targets({"config": {"quick": False}, "rows": rows})
    assert [(t["value"], t["ok"]) for t in got] == [(1.05, True), (1.0501, False)]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [({"paths": ("naive",)}, "unknown head path"), ({"ks": (-1,)}, "k must be >= 0"), ({"tokens": 0}, ">= 1")],
)
def test_bad_settings_are_refused(overrides, match):
    with pytest.raises(ValueError, match=match):
        HeadCostConfig(**overrides)


def test_the_baseline_is_always_measured():
    assert HeadCostConfig(ks=(32,)).ks == (0, 32)
