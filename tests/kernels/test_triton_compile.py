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


@pytest.mark.parametrize("chunk,with_entropy", list(itertools.product(CHUNK_TYPES, (False, True))))
def test_partials_kernel_compiles_for_sm90(cache_dir, chunk, with_entropy):
    pointers = {"Z": chunk, "TGT": "*i64", "M_OUT": "*fp32", "S_OUT": "*fp32", "T_OUT": "*fp32", "Q_OUT": "*fp32"}
    kernel = _compile(tk._partials_kernel, pointers,
                      {"WITH_ENTROPY": with_entropy, "BLOCK_V": tk.BLOCKS.partials_block_v},
                      tk.BLOCKS.partials_warps, cache_dir)
    assert "cubin" in kernel.asm and len(kernel.asm["cubin"]) > 0
    assert ".target sm_90" in kernel.asm["ptx"]


@pytest.mark.parametrize("chunk,flags", list(itertools.product(CHUNK_TYPES, [(True, False), (True, True),
                                                                              (False, True)])))
def test_logits_grad_kernel_compiles_for_sm90(cache_dir, chunk, flags):
    has_g, has_h = flags
    pointers = {"Z": chunk, "OUT": chunk, "TGT": "*i64", "LSE": "*fp32", "G": "*fp32", "ENT": "*fp32", "HG": "*fp32"}
    kernel = _compile(tk._logits_grad_kernel, pointers,
                      {"HAS_G": has_g, "HAS_H": has_h, "BLOCK_V": tk.BLOCKS.grad_block_v},
                      tk.BLOCKS.grad_warps, cache_dir)
    assert "cubin" in kernel.asm and len(kernel.asm["cubin"]) > 0
    # the bf16 store rounds to nearest (the interpreter truncates; the GPU must not)
    if chunk == "*bf16":
        assert "cvt.rn.bf16" in kernel.asm["ptx"]
