"""Derived benchmark numbers from a hand-written result: ratios, throughput, the memory fit and the targets."""

from __future__ import annotations

import pytest
import torch

from nemo_is_plugin.apps.bench import measure
from nemo_is_plugin.apps.bench.report import derived_rows, markdown_table, memory_fit, targets
from tools.bench_docs.performance_page import render_markdown


def _row(path, fwd, fb, **kw):
    base = dict(
        model="M",
        hidden=4,
        vocab=10,
        tokens=100,
        path=path,
        fwd_s=fwd,
        fwdbwd_s=fb,
        fwd_peak=None,
        fwdbwd_peak=None,
        fwdbwd_rss=None,
        lp_err=None,
        grad_err=None,
    )
    base.update(kw)
    return base


def _results():
    rows = [
        _row("matmul", 2.0, 6.0),
        _row("naive", 2.4, 7.0),
        _row("fused_linear", 2.2, 8.0),
        _row("fused_2pass", None, 9.0),
    ]
    sweep = [dict(path="naive", tokens=n, peak_bytes=1000 + 300 * n) for n in (10, 20, 40)]
    sweep += [dict(path="fused_linear", tokens=n, peak_bytes=2000 + 2 * n) for n in (10, 20, 40)]
    config = dict(tokens=100, batch=2, tp=1, chunk_size=None, repeats=1, extrapolate_tokens=1000, memory_shape=[4, 10])
    machine = dict(date="d", cpu="c", torch="t", threads=1)
    direct = [
        dict(path="naive", tokens=1000, peak_bytes=250000),
        dict(path="fused_linear", tokens=1000, peak_bytes=5000),
    ]
    return dict(config=config, machine=machine, rows=rows, memory_sweep=sweep, memory_direct=direct, skipped={})


def test_ratios_throughput_and_flops():
    fused = next(r for r in derived_rows(_results()) if r["path"] == "fused_linear")
    assert fused["fwd_ratio"] == pytest.approx(1.1) and fused["fwdbwd_ratio"] == pytest.approx(4.0)
    assert fused["fwd_tok_s"] == pytest.approx(100 / 2.2)
    assert fused["fwdbwd_gflops"] == pytest.approx(8 * 100 * 4 * 10 / 8.0 / 1e9)  # 8 N H V convention


def test_memory_fit_uses_the_two_largest_points():
    fits = memory_fit(_results())
    assert fits["naive"]["bytes_per_token"] == pytest.approx(300)
    assert fits["naive"]["extrapolated"] == pytest.approx(1000 + 300 * 1000)
    assert fits["fused_linear"]["extrapolated"] == pytest.approx(2000 + 2 * 1000)


def test_targets_report_values_and_verdicts():
    got = {t["target"].split(": ", 1)[-1]: t for t in targets(_results())}
    assert got["fused forward <= 1.15x matmul"]["ok"] is True
    assert got["fused forward+backward <= 4.4x matmul"]["ok"] is True
    assert got["fused forward faster than naive (time ratio fused/naive)"]["value"] == pytest.approx(2.2 / 2.4)
    assert got["fused forward+backward faster than naive (time ratio)"]["ok"] is False  # 8.0 > 7.0
    two_pass = next(t for k, t in got.items() if k.startswith("two-pass fused forward+backward"))
    assert two_pass["value"] == pytest.approx(4.5) and two_pass["ok"] is False  # 9.0 / 2.0 > 4.4
    measured = got["peak memory naive/fused >= 5.0x at 1000 tokens (measured)"]
    assert measured["value"] == pytest.approx(50) and measured["ok"] is True
    memory = next(t for k, t in got.items() if k.startswith("peak memory") and "extrapolated" in k)
    assert memory["value"] == pytest.approx(301000 / 4000) and memory["ok"] is True
    growth = next(t for k, t in got.items() if k.startswith("fused peak memory growth"))
    assert growth["value"] == pytest.approx(2) and growth["ok"] is True  # 2 B/token <= 2 * 4 * H + 256


def test_markdown_page_has_tables_and_images():
    page = render_markdown(_results())
    assert "| model | N | path |" in page and "![time ratios](img/perf_ratios.png)" in page
    assert "| naive | 0 | 0 | 0 |" in page  # the sweep row in MiB
    assert markdown_table(["a", "b"], [["1", "2"]]) == "| a | b |\n|---|---|\n| 1 | 2 |"


def test_blocked_float64_reference_equals_autograd(monkeypatch):
    monkeypatch.setattr(measure, "REFERENCE_VOCAB_BLOCK", 7)  # several vocab blocks, a ragged last one
    g = torch.Generator().manual_seed(0)
    x, w, t = torch.randn(5, 6, generator=g), torch.randn(30, 6, generator=g), torch.randint(0, 30, (5,), generator=g)
    lp, grad = measure.reference_logprobs_and_grad(x, w, t)
    xd = x.double().requires_grad_(True)
    ref = torch.log_softmax(xd @ w.double().t(), -1).gather(-1, t[:, None])[:, 0]
    (-ref.mean()).backward()
    torch.testing.assert_close(lp, ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, xd.grad, rtol=1e-12, atol=1e-12)
