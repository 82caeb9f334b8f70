"""kernels.chunking: chunk sizes by bytes (CPU: fp32 logits; GPU: the chunk in the GEMM dtype plus the torch backend's
workspaces, rounded to GEMM tiles)."""

from __future__ import annotations

import torch

from nemo_is_plugin.kernels.chunking import GPU_CHUNK_BYTES, chunk_slices, default_chunk_size, device_chunk_size


def test_default_chunk_size_bounds_the_workspace():
    assert default_chunk_size(151936) == 441  # 256 MiB / (4 B x 151936)
    assert default_chunk_size(10**9) == 1


def test_gpu_chunk_policy_sizes_chunks_by_bytes():
    """GPU: the chunk (bf16, triton) takes at most GPU_CHUNK_BYTES, in multiples of 128 tokens; thousands of tokens on
    MoE heads. The torch backend also counts its fp32 workspace. CPU: unchanged (256 MiB of fp32 logits)."""
    cuda = torch.device("cuda")
    for vocab in (129280, 151936, 201088, 248320):
        rows = device_chunk_size(vocab, cuda, torch.bfloat16, "triton")
        assert rows % 128 == 0 and rows * vocab * 2 <= GPU_CHUNK_BYTES < (rows + 128) * vocab * 2
        assert 1000 < rows < 4096
        torch_rows = device_chunk_size(vocab, cuda, torch.bfloat16, "torch")
        assert torch_rows * vocab * (2 + 4) <= GPU_CHUNK_BYTES and torch_rows < rows
    assert device_chunk_size(151936, torch.device("cpu"), torch.float32, "torch") == 441
    assert device_chunk_size(10**9, cuda, torch.bfloat16, "triton") == 1


def test_chunk_slices_cover_the_range_in_order():
    assert list(chunk_slices(10, 4)) == [slice(0, 4), slice(4, 8), slice(8, 10)]
    assert list(chunk_slices(8, 4)) == [slice(0, 4), slice(4, 8)]
    assert list(chunk_slices(0, 4)) == []
