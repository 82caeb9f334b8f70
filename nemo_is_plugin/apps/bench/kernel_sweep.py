"""Measured tuning data for the fused path on a GPU: the two Triton chunk kernels over a grid of launch parameters,
and the whole fused LM-head loss over a few chunk sizes.

Why a sweep and not ``triton.autotune``: the kernels' block sizes only need to be right for rows of 64k-250k columns
(V/TP), which one sweep per device settles; autotuning at run time would re-time every new chunk width inside a
training step. The sweep writes JSON after every section, so a run stopped at a time limit keeps what it measured.

    python -m nemo_is_plugin.apps.bench.kernel_sweep --out sweep.json [--rows 2048] [--vocab 151936 ...]

Each kernel row: the kernel, its launch (block, warps), the chunk (rows x vocab, dtype), the median seconds and the
bandwidth (bytes the kernel must move / seconds; pass 1 reads the chunk once, pass 2 reads and writes it), beside
torch's own reduction over the same chunk (``torch.logsumexp`` of the fp32 upcast, what the torch backend does).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from nemo_is_plugin.kernels import triton_logprob as tk
from nemo_is_plugin.kernels.softmax_partials import empty_partials

# (block, warps) of pass 1 (a row streamed in blocks) and pass 2 (a 2-D grid of row x column block)
PARTIALS_GRID = ((4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16), (16384, 32), (32768, 32))
GRAD_GRID = ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16), (8192, 32))


@dataclass
class _FixedLaunch(tk.TritonBlocks):
    """Launch parameters taken as given (the default derives pass 1's block from the row width)."""

    def partials_launch(self, n_cols: int, with_entropy: bool = False) -> tuple[int, int]:
        return self.partials_block_v, self.partials_warps


def median_seconds(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median of ``reps`` timed calls after one untimed call (which compiles)."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _row(kernel: str, z: torch.Tensor, launch: tuple[int, int] | None, moved_bytes: int, fn, reps: int) -> dict:
    row = dict(kernel=kernel, rows=z.shape[0], vocab=z.shape[1], dtype=str(z.dtype).removeprefix("torch."))
    row.update(block=launch[0] if launch else None, warps=launch[1] if launch else None)
    try:
        seconds = median_seconds(fn, z.device, reps)
    except Exception as exc:  # a launch the device refuses is a result of the sweep, not its end
        return dict(row, failed=f"{type(exc).__name__}: {str(exc)[:200]}")
    return dict(row, seconds=seconds, gbps=moved_bytes / seconds / 1e9)


def sweep_kernels(
    rows: int, vocabs: list[int], device: torch.device, dtype: torch.dtype, reps: int, grids=(PARTIALS_GRID, GRAD_GRID)
) -> list[dict]:
    """Every launch of ``grids`` of both kernels (pass 1 with and without the entropy term) on ``[rows, v]`` chunks
    of random logits, plus torch's fp32 logsumexp over the same chunk."""
    results: list[dict] = []
    saved = tk.BLOCKS
    gen = torch.Generator(device=device).manual_seed(0)
    try:
        for v in vocabs:
            z = (torch.randn(rows, v, device=device, generator=gen) * 2).to(dtype)
            target = torch.randint(0, v, (rows,), device=device, generator=gen)
            results += _sweep_chunk(z, target, torch.randn(rows, device=device, generator=gen), reps, grids)
    finally:
        tk.BLOCKS = saved
    return results


def _sweep_chunk(z: torch.Tensor, target: torch.Tensor, g: torch.Tensor, reps: int, grids) -> list[dict]:
    chunk_bytes = z.numel() * z.element_size()
    results = []
    for with_entropy in (False, True):
        out = empty_partials(z.shape[0], with_entropy, z.new_empty(0, dtype=torch.float32))
        name = "partials_entropy" if with_entropy else "partials"
        for block, warps in grids[0]:
            tk.BLOCKS = _FixedLaunch(partials_block_v=block, partials_warps=warps)
            fn = functools.partial(tk.triton_partials, z, target, 1.0, with_entropy, out)
            results.append(_row(name, z, (block, warps), chunk_bytes, fn, reps))
    lse = torch.logsumexp(z.float(), -1)
    dst = torch.empty_like(z)
    for block, warps in grids[1]:
        tk.BLOCKS = tk.TritonBlocks(grad_block_v=block, grad_warps=warps)
        grad_fn = functools.partial(tk.triton_logits_grad, z, dst, target, lse, g, None, None, 1.0, 1.0)
        results.append(_row("logits_grad", z, (block, warps), 2 * chunk_bytes, grad_fn, reps))
    results.append(_row("torch_logsumexp_fp32", z, None, chunk_bytes, lambda: torch.logsumexp(z.float(), -1), reps))
    return results


def sweep_chunks(models: list[str], chunk_sizes: list[int | None], device: str, repeats: int) -> list[dict]:
    """The fused Triton paths' forward + backward at each chunk size (None: the default budget), with the bare
    forward GEMM of the same run: the rows of ``nemo-is bench`` for those paths, tagged with the chunk size."""
    from nemo_is_plugin.apps.bench.runner import run_benchmark
    from nemo_is_plugin.apps.bench.shapes import MODEL_SHAPES, BenchConfig

    shapes = tuple(s for s in MODEL_SHAPES if s.name in models)
    rows = []
    for chunk in chunk_sizes:
        cfg = BenchConfig.for_device(
            device, shapes=shapes, paths=("fused_triton", "fused_2pass_triton"), chunk_size=chunk, repeats=repeats
        )
        for row in run_benchmark(cfg)["rows"]:
            keep = ("model", "path", "tokens", "fwd_s", "fwdbwd_s", "fwdbwd_peak", "backend", "failed")
            rows.append(dict({k: row.get(k) for k in keep}, chunk_size=chunk))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--vocab", type=int, nargs="+", default=[151936])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--models", nargs="*", default=["Qwen3-30B-A3B"])
    parser.add_argument("--chunk-sizes", type=int, nargs="*", default=[1024, 2048, 4096])
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    result: dict = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    result["kernels"] = sweep_kernels(args.rows, args.vocab, device, torch.bfloat16, args.reps)
    args.out.write_text(json.dumps(result, indent=1))
    if args.models:
        result["chunks"] = sweep_chunks(args.models, [None, *args.chunk_sizes], args.device, repeats=3)
        args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
