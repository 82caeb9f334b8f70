"""``nemo-is bench --model-step`` end to end on CPU: a tiny megatron-core MoE GPT model (gloo, world size 1), one
training step per loss path. Same weights and batch for every path, so the fused losses must reproduce the naive
loss and its gradients; the numbers themselves are a smoke run (the GPU tier measures the real shape)."""

from __future__ import annotations

import json

import pytest

from nemo_is_plugin.apps.bench.model_step import StepConfig, count_model_steps
from nemo_is_plugin.apps.bench.moe_model import GPU_STEP_SHAPE, QUICK_STEP_SHAPE

from ._cli import run_cli

pytest.importorskip("megatron.core")


def test_tiny_moe_step_on_cpu_naive_and_fused_agree(tmp_path):
    result = run_cli("bench", "--model-step", "--device", "cpu", "--quick", "--repeats", "2", "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "not meaningful" in result.stdout and "qkv grad vs naive" in result.stdout
    out = json.loads((tmp_path / "model_step.json").read_text())
    assert out["kind"] == "model_step" and out["config"]["device"] == "cpu" and out["config"]["quick"] is True
    rows = {r["variant"]: r for r in out["rows"]}
    assert list(rows) == ["body", "naive", "fused", "fused_2pass"] and out["skipped"] == {}
    for r in rows.values():
        assert r["step_s"] > 0 and r["peak_bytes"] > 0 and r["tokens_per_s"] == pytest.approx(66 / r["step_s"])
    for name in ("fused", "fused_2pass"):
        assert rows[name]["loss"] == pytest.approx(rows["naive"]["loss"], rel=1e-5)
        assert rows[name]["loss_rel_diff"] < 1e-5 and rows[name]["grad_rel_diff"] < 1e-4
        assert rows[name]["head_loss_s"] == pytest.approx(rows[name]["step_s"] - rows["body"]["step_s"])
    assert rows["naive"]["loss_rel_diff"] == 0 and "head_loss_s" not in rows["body"]
    assert out["config"]["params"] > 0 and out["machine"]["megatron_core"]


def test_step_config_defaults_and_refusals():
    gpu = StepConfig.for_device("cuda")
    assert gpu.shape == GPU_STEP_SHAPE and gpu.shape.tokens == 8192 and gpu.repeats == 5 and not gpu.quick
    smaller = StepConfig.for_device("cuda", tokens=4096, layers=1, experts=2)
    assert (smaller.shape.batch, smaller.shape.layers, smaller.shape.experts, smaller.shape.topk) == (2, 1, 2, 2)
    assert StepConfig.for_device("cpu", quick=True).shape == QUICK_STEP_SHAPE
    assert count_model_steps(StepConfig.for_device("cpu", quick=True)) == 1 + 4 * (1 + 3)
    with pytest.raises(ValueError, match="--quick"):
        StepConfig.for_device("cpu")
    with pytest.raises(ValueError, match="multiple of the sequence length 2048"):
        StepConfig.for_device("cuda", tokens=1000)
