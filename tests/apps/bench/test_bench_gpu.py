"""The benchmark on a real GPU (``gpu`` tier, skipped without CUDA): the head benchmark at one real MoE head shape
on a small token count, and the MoE model step on a reduced model. Checks structure and sanity (errors small, memory
positive, the fused loss equal to the naive one), not speed: the speed targets are read off the full run."""

from __future__ import annotations

import json

import pytest
import torch

from ._cli import run_cli

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_head_bench_on_cuda(tmp_path):
    result = run_cli(
        "bench",
        "--device",
        "cuda",
        "--model",
        "Qwen3-30B-A3B",
        "--tokens",
        "2048",
        "--repeats",
        "2",
        "--out",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "not checked here" in result.stdout  # 2,048 tokens: not the targets' setting
    out = json.loads((tmp_path / "results.json").read_text())
    assert out["config"]["device"] == "cuda" and out["config"]["dtype"] == "bfloat16"
    assert out["machine"]["device_name"] and out["machine"]["cuda"]
    rows = {r["path"]: r for r in out["rows"]}
    for name in ("matmul", "naive", "from_logits", "fused_linear", "fused_2pass"):
        assert name in rows, out["skipped"]
        assert rows[name]["fwdbwd_s"] > 0 and rows[name]["fwdbwd_peak"] > 0
    for name in ("naive", "from_logits", "fused_linear", "fused_2pass"):
        # bf16 inputs (and bf16 logits on the naive and from-logits paths): errors at bf16's resolution
        r = rows[name]
        assert 0 <= r["loss_err"] < 2e-2 and 0 < r["dx_err"] < 3e-2 and 0 < r["dw_err"] < 3e-2, r
        assert r["lp_err"] < 0.1 and r["loss_grad_err"] < 1e-3, r
    if out["machine"]["triton"]:  # triton installed: the fused rows ran on it, no fallback to torch
        assert out["triton_fallback"] is None and rows["fused_linear"]["backend"] == "triton", rows["fused_linear"]
    assert all(not r["failed"] for r in out["rows"]), [r["failed"] for r in out["rows"]]
    # the plugin's paths hold nothing of size tokens x vocab: far below the naive path's fp32 [N, V] buffers
    assert rows["fused_linear"]["fwdbwd_peak"] < rows["naive"]["fwdbwd_peak"] / 2
    for name, why in out["skipped"].items():  # whatever could not run says why
        assert isinstance(why, str) and why, name
    assert any(k.startswith("fused_triton") for k in list(rows) + list(out["skipped"]))


def test_model_step_on_cuda(tmp_path):
    result = run_cli(
        "bench",
        "--model-step",
        "--device",
        "cuda",
        "--layers",
        "1",
        "--experts",
        "4",
        "--tokens",
        "4096",
        "--repeats",
        "2",
        "--out",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = json.loads((tmp_path / "model_step.json").read_text())
    assert out["config"]["device"] == "cuda" and out["config"]["dtype"] == "bfloat16" and out["skipped"] == {}
    rows = {r["variant"]: r for r in out["rows"]}
    assert list(rows) == ["body", "naive", "fused", "fused_2pass"]
    for r in rows.values():
        assert r["step_s"] > 0 and r["peak_bytes"] > 0
    for name in ("fused", "fused_2pass"):
        assert rows[name]["loss_rel_diff"] < 1e-2 and rows[name]["grad_rel_diff"] < 5e-2
        assert 0 < rows[name]["head_loss_share"] < 1
    assert rows["fused"]["peak_bytes"] < rows["naive"]["peak_bytes"]
