"""kernels/gemm.py: the weight-gradient accumulator and its three dtypes, against float64 references.

- fp32 accumulation of fp32 chunk GEMMs equals one fp32 GEMM over all tokens (1e-6);
- accumulation in bf16 (the GPU default: the weight's dtype) rounds the running sum once per chunk: its error is
  bounded by ``k`` roundings (2^-8 relative each, of the largest entry) for ``k`` chunks, and is measured against the
  naive path's single rounding;
- a caller's buffer (Megatron's fp32 ``main_grad``) receives ``+= dW`` exactly (its content is kept) and no dW is
  returned; mixed dtypes (bf16 operands into fp32 on CPU: no ``out_dtype`` kernel) take the blocked fallback, whose
  row blocks give the same result as one block.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from nemo_is_plugin.kernels import gemm
from nemo_is_plugin.kernels.gemm import WeightGrad, addmm_, default_grad_weight_dtype

V, H, N = 40, 24, 96


def _chunks(k: int, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    dz = (torch.randn(N, V, generator=g, dtype=torch.float64) * 0.1).to(dtype)
    x = torch.randn(N, H, generator=g, dtype=torch.float64).to(dtype)
    step = -(-N // k)
    return dz, x, [slice(s, min(s + step, N)) for s in range(0, N, step)]


def _accumulate(weight, dtype, k, operand_dtype, out=None):
    dz, x, slices = _chunks(k, operand_dtype)
    acc = WeightGrad(weight, dtype, out)
    for sl in slices:
        acc.add(dz[sl], x[sl])
    return acc, dz.double().t() @ x.double()  # the float64 reference of the same operand values


def test_fp32_accumulation_equals_one_gemm():
    weight = torch.empty(V, H)
    acc, ref = _accumulate(weight, torch.float32, 6, torch.float32)
    got = acc.result()
    assert got.dtype == torch.float32 and got.shape == (V, H)
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6)


def test_first_chunk_writes_the_accumulator_without_zero_fill(monkeypatch):
    weight = torch.empty(V, H)

    def no_zeros(*args, **kwargs):
        raise AssertionError("no zero-filled V x H buffer when the dtypes agree")

    monkeypatch.setattr(gemm.torch, "zeros", no_zeros)
    acc, ref = _accumulate(weight, torch.float32, 3, torch.float32)
    torch.testing.assert_close(acc.buf.double(), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("k", [1, 4, 12])
def test_bf16_accumulation_error_is_bounded_by_one_rounding_per_chunk(k):
    """The GPU default (dW in the weight's dtype), run here with bf16 operands: k chunk GEMMs each rounded into the
    bf16 running sum. Bound: k x 2^-8 of the largest entry; a single chunk is the naive path's one rounding."""
    weight = torch.empty(V, H, dtype=torch.bfloat16)
    acc, ref = _accumulate(weight, torch.bfloat16, k, torch.bfloat16)
    got = acc.result()
    assert got.dtype == torch.bfloat16
    err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
    assert err <= k * 2.0**-8, err
    if k == 1:
        assert err <= 2.0**-8


def test_bf16_operands_into_an_fp32_accumulator_use_the_blocked_fallback_on_cpu(monkeypatch):
    """CPU has no ``addmm(out_dtype=fp32)`` for bf16: row blocks of the bf16 product are added in fp32. The block size
    does not change the result, and each chunk contributes one bf16 rounding of its own product."""
    weight = torch.empty(V, H, dtype=torch.bfloat16)
    acc_one, ref = _accumulate(weight, torch.float32, 4, torch.bfloat16)
    monkeypatch.setattr(gemm, "FALLBACK_BLOCK_BYTES", 7 * H * 2)  # 7 rows per block: ragged blocks
    acc_blocks, _ = _accumulate(weight, torch.float32, 4, torch.bfloat16)
    assert acc_one.buf.dtype == torch.float32
    assert torch.equal(acc_one.buf, acc_blocks.buf)
    assert ((acc_one.buf.double() - ref).abs().max() / ref.abs().max()).item() <= 4 * 2.0**-8


def test_caller_buffer_receives_the_gradient_added_to_its_content():
    weight = torch.empty(V, H, dtype=torch.bfloat16)
    main_grad = torch.randn(V, H, dtype=torch.float32, generator=torch.Generator().manual_seed(3))
    before = main_grad.clone()
    acc, _ = _accumulate(weight, torch.bfloat16, 5, torch.float32, out=main_grad)  # fp32 operands (the CPU case)
    dz, x, _ = _chunks(5)
    assert acc.result() is None and acc.buf is main_grad
    torch.testing.assert_close(main_grad, before + dz.t() @ x, rtol=1e-6, atol=1e-6)


def test_addmm_same_dtype_is_in_place():
    acc = torch.ones(V, H)
    a, b = torch.randn(V, 5), torch.randn(5, H)
    ptr = acc.data_ptr()
    out = addmm_(acc, a, b)
    assert out.data_ptr() == ptr
    torch.testing.assert_close(out, 1 + a @ b)


def test_default_dtypes():
    assert default_grad_weight_dtype(torch.empty(2, 2, dtype=torch.bfloat16), None) == torch.float32  # CPU
    assert default_grad_weight_dtype(torch.empty(2, 2, dtype=torch.float64), None) == torch.float64
    assert default_grad_weight_dtype(torch.empty(2, 2, dtype=torch.bfloat16, device="meta"), None) == torch.bfloat16
    assert default_grad_weight_dtype(torch.empty(2, 2), torch.bfloat16) == torch.bfloat16


def test_no_chunk_gives_a_zero_gradient():
    assert torch.equal(WeightGrad(torch.empty(V, H), torch.float32).result(), torch.zeros(V, H))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_mixed_accumulation_adds_in_place_in_fp32():
    """bf16 operands into an fp32 buffer on CUDA: one GEMM with an fp32 epilogue (``addmm(out_dtype=fp32)``) where
    torch has it, else the blocked fallback; either way equal to the fp32 product of the bf16 values (1e-5)."""
    dz, x, slices = _chunks(4, torch.bfloat16)
    dz, x = dz.cuda(), x.cuda()
    main_grad = torch.ones(V, H, device="cuda")
    acc = WeightGrad(torch.empty(V, H, dtype=torch.bfloat16, device="cuda"), torch.bfloat16, main_grad)
    for sl in slices:
        acc.add(dz[sl], x[sl])
    ref = 1 + dz.double().t() @ x.double()
    assert ((main_grad.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5


MIXED_KEY = ("cpu", torch.bfloat16, torch.float32)


def _mixed_operands():
    g = torch.Generator().manual_seed(5)
    a = torch.randn(V, 7, generator=g).to(torch.bfloat16)
    b = torch.randn(7, H, generator=g).to(torch.bfloat16)
    return torch.ones(V, H), a, b


@pytest.mark.parametrize(
    "error",
    [
        torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("CUDA error: out of memory"),  # an allocator that raises the plain RuntimeError
    ],
)
def test_an_out_of_memory_in_the_mixed_gemm_propagates_and_switches_nothing(monkeypatch, error):
    monkeypatch.setitem(gemm._MIXED_ADDMM, MIXED_KEY, True)  # as on a GPU: try addmm(out_dtype=) first

    def oom(*args, **kwargs):
        raise error

    monkeypatch.setattr(gemm.torch, "addmm", oom)
    acc, a, b = _mixed_operands()
    with pytest.raises(RuntimeError, match="out of memory"):
        addmm_(acc, a, b)
    assert gemm._MIXED_ADDMM[MIXED_KEY] is True and torch.equal(acc, torch.ones(V, H))


def test_a_missing_out_dtype_kernel_switches_to_the_blocked_product_with_one_warning(monkeypatch):
    """CPU torch has no ``aten::addmm.dtype_out`` kernel (NotImplementedError): the blocked product, warned once."""
    monkeypatch.setitem(gemm._MIXED_ADDMM, MIXED_KEY, True)
    acc, a, b = _mixed_operands()
    with pytest.warns(RuntimeWarning, match="blocked product"):
        addmm_(acc, a, b)
    assert gemm._MIXED_ADDMM[MIXED_KEY] is False
    ref = 1 + a.double() @ b.double()
    assert (acc.double() - ref).abs().max() <= 2.0**-8 * ref.abs().max()  # one bf16 rounding of the product
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        addmm_(acc, a, b)  # no second warning


def test_which_addmm_errors_mean_unsupported():
    assert gemm.mixed_addmm_unsupported(TypeError("addmm() got an unexpected keyword argument 'out_dtype'"))
    assert gemm.mixed_addmm_unsupported(NotImplementedError("Could not run 'aten::addmm.dtype_out'"))
    assert gemm.mixed_addmm_unsupported(RuntimeError("out_dtype must be the same as input dtype or fp32"))
    assert not gemm.mixed_addmm_unsupported(torch.cuda.OutOfMemoryError("CUDA out of memory (out_dtype)"))
    assert not gemm.mixed_addmm_unsupported(RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED"))
