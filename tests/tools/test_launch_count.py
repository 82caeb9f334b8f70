"""tools/launch_count.py: its op counter sees every non-view aten op and nothing else, and its per-call numbers keep the
relations the fused path implies (the sync counts are the ones tests/loss/test_loss_device_clean.py asserts)."""

from __future__ import annotations

import torch

from tools.launch_count import CHUNKS, CONFIGS, LaunchCounter, count_config


def test_the_counter_counts_non_view_ops_only():
    x = torch.arange(6.0)
    with LaunchCounter() as ops:
        y = x + 1  # add
        z = y.view(2, 3).t()  # two views: no kernel
        (z * 2).sum()  # mul, sum
    assert ops.count == 3


def test_bench_config_counts():
    counts = count_config(CONFIGS["bench"])
    # ClippedPGLoss.__call__ reads the device back twice: its batched input check and the metrics (backward adds none)
    assert counts["syncs_epilogue"] == counts["syncs_epilogue+bwd"] == 2
    assert counts["epilogue+bwd"] > counts["epilogue"] > 0
    # the fused pass computes every chunk's dL/dc once, plus the GEMMs and the epilogue on top
    assert counts[f"fused_{CHUNKS}_chunks"] > CHUNKS * counts["chunk_dLdc"] > 0
