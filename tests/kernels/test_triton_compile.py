"""The Triton chunk kernels compile for an H100 (sm_90) without a GPU: Triton's front end, its MLIR passes, LLVM and
the ``ptxas`` shipped with triton run on the CPU and produce a cubin. The interpreter tests
(test_triton_chunk_kernels.py) check the math; this checks what the interpreter cannot: that every specialisation the
entry points launch (chunk dtype x constexpr flags, default block sizes and warps) is valid Triton for the real
compiler, so a CUDA user does not hit the "kernel failed to compile" fallback. Not checked: running it, register
pressure at run time, speed.
"""

from __future__ import annotations

import itertools
import os

import pytest

triton = pytest.importorskip("triton")

if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter replaces triton.jit: nothing to compile
    pytest.skip("TRITON_INTERPRET=1", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from nemo_is_plugin.kernels import triton_logprob as tk  # noqa: E402

H100 = GPUTarget("cuda", 90, 32)
CHUNK_TYPES = ("*bf16", "*fp16", "*fp32")


def _compile(fn, pointer_types: dict, constexprs: dict, num_warps: int, cache_dir):
    scalar = {"stride_z": "i64", "stride_out": "i64", "n_cols": "i32", "in_scale": "fp32", "out_scale": "fp32"}
    signature = {}
    for name in fn.arg_names:
        signature[name] = "constexpr" if name in constexprs else pointer_types.get(name) or scalar[name]
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    os.environ["TRITON_CACHE_DIR"] = str(cache_dir)
    return triton.compile(src, target=H100, options={"num_warps": num_warps})


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    try:
        from triton.backends import backends

        if "nvidia" not in backends:
            pytest.skip("triton has no NVIDIA backend here")
    except ImportError:
        pytest.skip("triton.backends unavailable")
    saved = os.environ.get("TRITON_CACHE_DIR")
    yield tmp_path_factory.mktemp("triton_cache")
    if saved is None:
        os.environ.pop("TRITON_CACHE_DIR", None)
    else:
        os.environ["TRITON_CACHE_DIR"] = saved


@pytest.mark.parametrize(
    "chunk,with_entropy,n_cols", list(itertools.product(CHUNK_TYPES, (False, True), (151936, 18992)))
)
def test_partials_kernel_compiles_for_sm90(cache_dir, chunk, with_entropy, n_cols):
    """Rows of a whole MoE vocab (the 32k block, 32 warps) and of a TP=8 shard (next_pow2: 32k as well, or less)."""
    pointers = {"Z": chunk, "TGT": "*i64", "M_OUT": "*fp32", "S_OUT": "*fp32", "T_OUT": "*fp32", "Q_OUT": "*fp32"}
    block, warps = tk.BLOCKS.partials_launch(n_cols, with_entropy)
    kernel = _compile(tk._partials_kernel, pointers, {"WITH_ENTROPY": with_entropy, "BLOCK_V": block}, warps, cache_dir)
    assert "cubin" in kernel.asm and len(kernel.asm["cubin"]) > 0
    assert ".target sm_90" in kernel.asm["ptx"]


@pytest.mark.parametrize(
    "chunk,flags", list(itertools.product(CHUNK_TYPES, [(True, False), (True, True), (False, True)]))
)
def test_logits_grad_kernel_compiles_for_sm90(cache_dir, chunk, flags):
    has_g, has_h = flags
    pointers = {"Z": chunk, "OUT": chunk, "TGT": "*i64", "LSE": "*fp32", "G": "*fp32", "ENT": "*fp32", "HG": "*fp32"}
    kernel = _compile(
        tk._logits_grad_kernel,
        pointers,
        {"HAS_G": has_g, "HAS_H": has_h, "BLOCK_V": tk.BLOCKS.grad_block_v},
        tk.BLOCKS.grad_warps,
        cache_dir,
    )
    assert "cubin" in kernel.asm and len(kernel.asm["cubin"]) > 0
    # the bf16 store rounds to nearest (the interpreter truncates; the GPU must not)
    if chunk == "*bf16":
        assert "cvt.rn.bf16" in kernel.asm["ptx"]


def _ptxas_report(ptx: str, tmp_path) -> str:
    """``ptxas -v`` of the kernel's PTX for sm_90a with the ptxas triton itself uses (skip when unavailable)."""
    import subprocess

    try:
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(90).path
    except (ImportError, AttributeError, TypeError, RuntimeError):
        pytest.skip("this triton does not expose its ptxas")
    src = tmp_path / "kernel.ptx"
    src.write_text(ptx)
    result = subprocess.run(
        [ptxas, "-v", "--gpu-name=sm_90a", str(src), "-o", str(tmp_path / "kernel.o")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stderr


@pytest.mark.parametrize("chunk,with_entropy", list(itertools.product(("*bf16", "*fp32"), (False, True))))
def test_default_launches_do_not_spill_registers(cache_dir, tmp_path, chunk, with_entropy):
    """At the default launch parameters neither pass spills to local memory on sm_90 (pass 1 at 32 warps may use 64
    registers per thread; the entropy variant halves its block to stay within them)."""
    block, warps = tk.BLOCKS.partials_launch(151936, with_entropy)
    pointers = {"Z": chunk, "TGT": "*i64", "M_OUT": "*fp32", "S_OUT": "*fp32", "T_OUT": "*fp32", "Q_OUT": "*fp32"}
    partials = _compile(
        tk._partials_kernel, pointers, {"WITH_ENTROPY": with_entropy, "BLOCK_V": block}, warps, cache_dir
    )
    grad_pointers = {
        "Z": chunk,
        "OUT": chunk,
        "TGT": "*i64",
        "LSE": "*fp32",
        "G": "*fp32",
        "ENT": "*fp32",
        "HG": "*fp32",
    }
    grad = _compile(
        tk._logits_grad_kernel,
        grad_pointers,
        {"HAS_G": True, "HAS_H": with_entropy, "BLOCK_V": tk.BLOCKS.grad_block_v},
        tk.BLOCKS.grad_warps,
        cache_dir,
    )
    for kernel in (partials, grad):
        report = _ptxas_report(kernel.asm["ptx"], tmp_path)
        assert "0 bytes spill stores, 0 bytes spill loads" in report, report
