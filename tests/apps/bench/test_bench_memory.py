"""The memory tracker the benchmark reports: exact bytes of storages created (and freed) inside the block."""

from __future__ import annotations

import torch

from nemo_is_plugin.apps.bench.memory import RssPeak, TensorMemoryTracker


def test_counts_new_storages_and_releases_them():
    with TensorMemoryTracker() as mem:
        a = torch.ones(1000)  # 4000 B
        b = torch.ones(500, dtype=torch.float64)  # 4000 B
        assert mem.current == 8000
        del a
        assert mem.current == 4000
        c = torch.zeros(250)  # 1000 B
        assert mem.current == 5000
    assert mem.peak == 8000
    del b, c


def test_views_inplace_and_out_results_are_not_allocations():
    x = torch.ones(100, 10)  # before the block: an input, never counted
    with TensorMemoryTracker() as mem:
        x.add_(1.0)
        _ = x[:50].t()
        torch.mul(x, 2.0, out=x)
        y = x.sum(0)  # 10 floats
    assert mem.peak == 40 and mem.current == 40
    del y


def test_autograd_saved_tensors_and_gradients_are_counted():
    w = torch.randn(64, 32, requires_grad=True)
    x = torch.randn(16, 32)
    with TensorMemoryTracker() as mem:
        logits = x @ w.t()  # [16, 64] = 4096 B
        out = torch.log_softmax(logits, -1)  # saved for backward: another 4096 B
        del logits
        out.sum().backward()
    assert mem.peak >= 2 * 4096
    assert mem.current >= w.numel() * 4  # w.grad stays alive


def test_rss_peak_reports_a_nonnegative_delta_or_none():
    with RssPeak() as rss:
        # 64 MiB, touched: above glibc's largest dynamic mmap threshold (32 MiB), so fresh pages whatever earlier
        # tests freed (a 16 MiB block can come back from already resident heap pages and add nothing to the RSS)
        t = torch.ones(16 * 2**20)
        t.add_(1)
    assert rss.delta is None or rss.delta >= 32 * 2**20
    del t
