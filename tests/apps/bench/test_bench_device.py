"""Device / dtype resolution and the CPU side of the device-specific measurements (the CUDA side runs in the gpu tier:
tests/apps/bench/test_bench_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from nemo_is_plugin.apps.bench.device import BenchDevice, dtype_name, parse_dtype


def test_defaults_per_device_and_explicit_dtypes():
    cpu = BenchDevice.resolve("cpu")
    assert cpu.device == torch.device("cpu") and cpu.dtype == torch.float32 and not cpu.is_cuda
    assert BenchDevice.resolve("cpu", "bf16").dtype == torch.bfloat16
    assert parse_dtype("bfloat16") == torch.bfloat16 and dtype_name(torch.bfloat16) == "bfloat16"
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        parse_dtype("int8")
    with pytest.raises(ValueError, match="device must be one of"):
        BenchDevice.resolve("mps")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="torch.cuda.is_available.. is False .*--device cpu"):
        BenchDevice.resolve("cuda")


def test_cpu_memory_is_the_peak_above_the_start_and_rounds_keep_the_best():
    dev = BenchDevice.resolve("cpu")
    kept = torch.ones(10)  # exists before: not counted

    def job() -> torch.Tensor:
        a = torch.ones(1000)  # 4000 B, freed before b
        del a
        b = torch.zeros(250, dtype=torch.float64)  # 2000 B, returned
        return b

    measured = dev.measure_memory(job)
    assert measured.peak_bytes == 4000 and measured.seconds > 0
    assert dev.time_call(job) > 0
    assert dev.summarise([3.0, 1.0, 2.0]) == 1.0 and dev.statistic == "best"
    info = dev.describe()
    assert info["device"] == "cpu" and info["dtype"] == "float32" and info["torch"] == torch.__version__
    assert info["device_name"] == info["cpu"]
    del kept


def test_run_config_per_device():
    from nemo_is_plugin.apps.bench.shapes import CPU_PATHS, GPU_TARGET_TOKENS, PATHS, BenchConfig

    cpu, gpu = BenchConfig.for_device("cpu"), BenchConfig.for_device("cuda")
    assert (cpu.tokens, cpu.batch, cpu.paths, cpu.warmup, cpu.is_cuda) == (256, 2, CPU_PATHS, 0, False)
    assert (gpu.tokens, gpu.batch, gpu.repeats, gpu.warmup, gpu.paths) == (GPU_TARGET_TOKENS, 8, 5, 2, PATHS)
    assert gpu.tokens == 8 * 2048 and gpu.memory_tokens == () and gpu.is_cuda and gpu.quick_run is False
    quick = BenchConfig.for_device("cuda", quick=True, repeats=1)
    assert quick.quick_run is True and quick.tokens == 64 and quick.memory_tokens == () and quick.repeats == 1
    assert BenchConfig.for_device("cpu", quick=True).memory_tokens == (32, 64, 128)
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        BenchConfig(device="tpu")
