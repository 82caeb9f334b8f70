"""The Triton chunk kernels (kernels/triton_logprob.py) against float64 references, under Triton's interpreter.

Tiny shapes with blocks of 16 columns, so every row spans several blocks and ends in a ragged one (37 columns);
chunk dtypes fp32, bf16 and fp16 (the kernels read them as they are); targets owned by this shard, at its first and
last column, and owned by another TP rank (column -1); a row stride wider than the row (a view of a larger buffer);
temperature as ``in_scale`` / ``out_scale``; entropy on and off. Tolerances: the statistics are fp32 computed from the
exact low-precision values, so 1e-5 relative whatever the chunk dtype; the gradient is written in the chunk dtype, so
one unit in the last place of it (2^-7 relative for bf16, 2^-10 for fp16; 1e-6 for fp32) of the largest entry: a GPU
rounds to nearest (half an ulp), the interpreter's fp32 -> bf16 cast truncates (a whole ulp). The same checks run on a
real GPU in the ``gpu`` tier.
"""

from __future__ import annotations

import pytest
import torch

from kernels._interpreter import interpreter_results

pytest.importorskip("triton")

N, V = 7, 37
SCALE = 0.8
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
OUT_TOL = {torch.float32: 1e-6, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def case(dtype, seed=0, device="cpu", wide=False):
    """Logits ``[N, V]`` in ``dtype`` (a column slice of a wider buffer when ``wide``), target columns, per-row
    vectors; the float64 reference softmax of the exact ``dtype`` values times ``SCALE``."""
    g = torch.Generator().manual_seed(seed)
    full = (torch.randn(N, V + (5 if wide else 0), generator=g) * 4).to(dtype)
    z = full[:, :V]
    column = torch.tensor([0, V - 1, -1, 5, -1, 17, 36])  # first / last column, other ranks' targets
    zz = z.double() * SCALE
    vec = lambda: torch.randn(N, generator=g)  # noqa: E731
    return dict(
        z=z.to(device), column=column.to(device), col=column, zz=zz, g=vec(), h=vec(), ent=torch.rand(N, generator=g)
    )


def reference_partials(zz, column):
    m = zz.amax(-1)
    e = torch.exp(zz - m[:, None])
    target = torch.where(column >= 0, zz.gather(1, column.clamp_min(0)[:, None]).squeeze(1), 0.0)
    return m, e.sum(-1), target, (e * (zz - m[:, None])).sum(-1)


def reference_grad(zz, column, lse, g, ent, h, out_scale):
    """out_scale (g (onehot - p) - h p (log p + H)), float64; g / h None = that term off."""
    logp = zz - lse[:, None]
    p = logp.exp()
    grad = torch.zeros_like(zz)
    if g is not None:
        onehot = torch.zeros_like(zz)
        rows = torch.nonzero(column >= 0).squeeze(1)
        onehot[rows, column[rows]] = 1.0
        grad = grad + g.double()[:, None] * (onehot - p)
    if h is not None:
        grad = grad - h.double()[:, None] * p * (logp + ent.double()[:, None])
    return out_scale * grad


def _blocks(size=16):
    from nemo_is_plugin.kernels import triton_logprob as tk

    tk.BLOCKS.partials_block_v = tk.BLOCKS.grad_block_v = size
    return tk


# ------------------------------------------------------------- checks run in a child process under the interpreter
def check_partials(dtype, wide=False, device="cpu"):
    from nemo_is_plugin.kernels.softmax_partials import SoftmaxPartials

    tk = _blocks()
    c = case(dtype, wide=wide, device=device)
    want = reference_partials(c["zz"], c["col"])
    for with_entropy in (False, True):
        fields = torch.full((4, N), float("nan"), device=device)
        out = SoftmaxPartials(fields[0], fields[1], fields[2], fields[3] if with_entropy else None)
        tk.triton_partials(c["z"], c["column"], SCALE, with_entropy, out)
        for got, ref in zip(out, want):
            if got is not None:
                torch.testing.assert_close(got.cpu().double(), ref, rtol=1e-5, atol=1e-5)
        assert with_entropy or torch.isnan(fields[3]).all()  # nothing written where entropy is off


def check_logits_grad(dtype, device="cpu"):
    tk = _blocks()
    c = case(dtype, seed=1, device=device)
    lse = torch.logsumexp(c["zz"], -1) + 0.3  # a TP-global lse is above the shard's own
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    for g, ent, h in ((c["g"], None, None), (c["g"], c["ent"], c["h"]), (None, c["ent"], c["h"]), (None, None, None)):
        want = reference_grad(c["zz"], c["col"], lse, g, ent, h, SCALE)
        for in_place in (True, False):
            z = c["z"].clone()
            out = z if in_place else torch.full_like(z, float("nan"))
            got = tk.triton_logits_grad(z, out, c["column"], to(lse.float()), to(g), to(ent), to(h), SCALE, SCALE)
            assert got.data_ptr() == out.data_ptr() and got.dtype == dtype
            if not in_place:
                assert torch.equal(z, c["z"])  # the logits are read only
            err = (got.cpu().double() - want).abs().max().item()
            assert err <= OUT_TOL[dtype] * max(want.abs().max().item(), 1e-30) + 1e-7, (g is None, h is None, err)


def check_chunk_math_backends_agree(dtype, device="cpu"):
    """ChunkMath's triton and torch backends: pass 1, the single pass's pass 2 (local shard max, global lse) and the
    two-pass pass 2 with entropy give the same numbers (torch computes in fp32 from the same chunk values)."""
    from nemo_is_plugin.kernels.chunk_math import ChunkMath

    _blocks()
    c = case(dtype, seed=2, device=device)
    local_t = c["column"].clamp_min(0)
    owned = c["column"] >= 0
    lse = (torch.logsumexp(c["zz"], -1) + 0.3).float().to(device)
    g, ent, h = (c[k].to(device) for k in ("g", "ent", "h"))
    results = {}
    for backend in ("torch", "triton"):
        for with_entropy in (False, True):
            math = ChunkMath(backend, dtype, torch.float32, torch.device(device), N, V, with_entropy=with_entropy)
            z = c["z"].clone()
            parts = math.partials(z, local_t, owned, c["column"], SCALE)
            results[backend, "partials", with_entropy] = [None if p is None else p.cpu() for p in parts]
            if not with_entropy:
                dz = math.single_pass_grad(z, parts, lse, local_t, owned, c["column"], g, SCALE, SCALE)
                results[backend, "single"] = dz.cpu().double()
        math = ChunkMath(backend, dtype, torch.float32, torch.device(device), N, V, with_entropy=True)
        z = c["z"].clone()
        dz = math.logits_grad(z, z, local_t, owned, c["column"], lse, g, ent, h, SCALE, SCALE)
        results[backend, "two_pass"] = dz.cpu().double()
    for key in [k for k in results if k[0] == "torch"]:
        other = results[("triton",) + key[1:]]
        if key[1] == "partials":
            for a, b in zip(results[key], other):
                assert (a is None) == (b is None)
                if a is not None:
                    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        else:
            tol = OUT_TOL[dtype] * results[key].abs().max().item() + 1e-7
            assert (results[key] - other).abs().max().item() <= tol, key
    want = reference_grad(c["zz"], c["col"], lse.cpu().double(), c["g"], None, None, SCALE)
    assert (results["triton", "single"] - want).abs().max() <= OUT_TOL[dtype] * want.abs().max() + 1e-7


def check_vocab_parallel_reads_low_precision_logits(device="cpu"):
    """vocab_parallel_logprobs on bf16 logits with the Triton backend: no fp32 copy, float64-exact up to fp32."""
    from nemo_is_plugin.distributed.head.vocab_parallel import vocab_parallel_logprobs

    _blocks()
    c = case(torch.bfloat16, seed=3, device=device)
    target = torch.where(c["column"] >= 0, c["column"], 3)
    logits = c["z"].clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(logits, target, chunk_size=3, with_entropy=True, backend="triton")
    (lp * c["g"].to(device)).sum().add((ent * c["h"].to(device)).sum()).backward()
    zz = c["z"].detach().cpu().double().requires_grad_(True)  # the float64 reference runs on the CPU
    logp = torch.log_softmax(zz, -1)
    ref_lp, ref_ent = logp.gather(1, target.cpu()[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)
    (ref_lp * c["g"].double()).sum().add((ref_ent * c["h"].double()).sum()).backward()
    torch.testing.assert_close(lp.detach().cpu().double(), ref_lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.detach().cpu().double(), ref_ent.detach(), rtol=1e-5, atol=1e-5)
    assert logits.grad.dtype == torch.bfloat16
    err = (logits.grad.cpu().double() - zz.grad).abs().max() / zz.grad.abs().max()
    assert err <= OUT_TOL[torch.bfloat16], err


INTERPRETER_CHECKS = {
    **{f"partials[{k}]": (lambda d=d: check_partials(d)) for k, d in DTYPES.items()},
    "partials[bf16-row-stride]": lambda: check_partials(torch.bfloat16, wide=True),
    **{f"logits_grad[{k}]": (lambda d=d: check_logits_grad(d)) for k, d in DTYPES.items()},
    **{f"backends_agree[{k}]": (lambda d=d: check_chunk_math_backends_agree(d)) for k, d in DTYPES.items()},
    "vocab_parallel_bf16": check_vocab_parallel_reads_low_precision_logits,
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return interpreter_results(__name__, tmp_path_factory.mktemp("triton_kernels"))


@pytest.mark.parametrize("name", list(INTERPRETER_CHECKS))
def test_kernel_under_triton_interpreter(results, name):
    assert results[name] is None, results[name]


# ------------------------------------------------------------------------------------------------------ GPU tier
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(INTERPRETER_CHECKS))
def test_kernel_on_gpu(name):
    """The same checks compiled for the GPU (default block sizes would cover the 37 columns in one block: the
    checks set 16 to keep rows spanning blocks)."""
    fn = {
        **{f"partials[{k}]": (lambda d=d: check_partials(d, device="cuda")) for k, d in DTYPES.items()},
        "partials[bf16-row-stride]": lambda: check_partials(torch.bfloat16, wide=True, device="cuda"),
        **{f"logits_grad[{k}]": (lambda d=d: check_logits_grad(d, device="cuda")) for k, d in DTYPES.items()},
        **{
            f"backends_agree[{k}]": (lambda d=d: check_chunk_math_backends_agree(d, device="cuda"))
            for k, d in DTYPES.items()
        },
        "vocab_parallel_bf16": lambda: check_vocab_parallel_reads_low_precision_logits(device="cuda"),
    }[name]
    from nemo_is_plugin.kernels import triton_logprob as tk

    saved = (tk.BLOCKS.partials_block_v, tk.BLOCKS.grad_block_v)
    try:
        fn()
    finally:
        tk.BLOCKS.partials_block_v, tk.BLOCKS.grad_block_v = saved
