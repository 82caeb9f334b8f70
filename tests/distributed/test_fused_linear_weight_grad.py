"""The weight-gradient options of the fused entry points, against the naive path (single process, fp32 unless said).

- ``grad_weight_out`` (Megatron's fp32 ``main_grad``): the weight's gradient is ADDED into the buffer (content kept,
  a second call accumulates), ``weight.grad`` stays None, in both schedules; the single pass applies the upstream
  gradient in its backward (``2.5 * loss``). With bf16 weights on CPU the GEMMs are fp32, so the buffer is exact to
  fp32 (1e-5 against an fp32 reference on the same bf16 values).
- ``grad_weight_dtype=torch.bfloat16`` with fp32 inputs reproduces the GPU default's numerics on CPU (the running sum
  rounded to bf16 once per chunk): bounded by one bf16 rounding per chunk, returned in the weight's dtype.
- argument errors name the argument; the GPU chunk policy gives thousands of tokens within its byte budget.
"""

from __future__ import annotations

import pytest
import torch

from nemo_is_plugin import build_loss_fn
from nemo_is_plugin.apps.bench.paths import naive_logprobs
from nemo_is_plugin.distributed.entry_points.fused_linear_loss import fused_linear_pg_loss
from nemo_is_plugin.distributed.head.fused_linear import fused_linear_logprobs

from ._fused_cases import CHUNK, level_config, rel_err, run
from ._fused_cases import pg_problem as problem


def _pg(p, cfg, weight, upstream=1.0, **kwargs):
    h = p.hidden.to(weight.dtype).clone().requires_grad_(True)
    loss, _ = fused_linear_pg_loss(
        build_loss_fn(cfg),
        h,
        weight,
        p.target,
        p.data,
        p.global_valid_seqs,
        p.global_valid_toks,
        chunk_size=CHUNK,
        **kwargs,
    )
    (upstream * loss).backward()
    return h.grad


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])  # single pass / two-pass
def test_main_grad_receives_the_scaled_gradient_added_to_its_content(ratio_level):
    p, cfg = problem(), level_config(ratio_level, "token")
    _, _, ref_dx, ref_dw = run(p, naive_logprobs, cfg)
    w = p.weight.clone().requires_grad_(True)
    main_grad = torch.full(w.shape, 0.5)
    dx = _pg(p, cfg, w, upstream=2.5, grad_weight_out=main_grad)
    assert w.grad is None
    assert rel_err(dx, 2.5 * ref_dx) < 1e-5
    assert rel_err(main_grad - 0.5, 2.5 * ref_dw) < 1e-5
    _pg(p, cfg, w, upstream=1.0, grad_weight_out=main_grad)  # a second micro-batch accumulates
    assert rel_err(main_grad - 0.5, 3.5 * ref_dw) < 1e-5 and w.grad is None


def test_main_grad_with_bf16_weights_is_fp32_exact_on_cpu():
    p, cfg = problem(dtype=torch.bfloat16, seed=1), level_config("token", "token")
    _, _, _, ref_dw = run(p, naive_logprobs, cfg, p.hidden.float(), p.weight.float())
    w = p.weight.clone().requires_grad_(True)
    main_grad = torch.zeros(w.shape, dtype=torch.float32)
    _pg(p, cfg, w, grad_weight_out=main_grad)
    assert w.grad is None and rel_err(main_grad, ref_dw) < 1e-5


def test_logprobs_main_grad_two_calls_accumulate():
    p = problem()
    coef = torch.randn(p.target.shape, generator=torch.Generator().manual_seed(4))
    w_ref = p.weight.clone().requires_grad_(True)
    (naive_logprobs(p.hidden, w_ref, p.target) * coef).sum().backward()
    w = p.weight.clone().requires_grad_(True)
    main_grad = torch.zeros(w.shape)
    for _ in range(2):
        lp = fused_linear_logprobs(p.hidden, w, p.target, chunk_size=4, grad_weight_out=main_grad)
        (lp * coef).sum().backward()
    assert w.grad is None and rel_err(main_grad, 2 * w_ref.grad) < 1e-5


@pytest.mark.parametrize("single_pass", [True, False])
def test_bf16_weight_dtype_accumulation_is_bounded(single_pass):
    """The GPU default's numerics (dW summed in the weight's dtype), emulated with grad_weight_dtype=bf16: at most one
    bf16 rounding (2^-8) per chunk of the largest entry; 1 chunk is the naive bf16 path's single rounding."""
    p, cfg = problem(), level_config("token", "token")
    _, _, _, ref_dw = run(p, naive_logprobs, cfg)
    n_chunks = -(-p.num_tokens // CHUNK)
    w = p.weight.clone().requires_grad_(True)
    _pg(p, cfg, w, single_pass=single_pass, grad_weight_dtype=torch.bfloat16)
    assert w.grad.dtype == torch.float32
    err = rel_err(w.grad, ref_dw)
    assert 2.0**-12 < err <= n_chunks * 2.0**-8, err  # really rounded in bf16, within the bound


def test_argument_errors_name_the_argument():
    p = problem()
    w = p.weight.clone().requires_grad_(True)
    with pytest.raises(ValueError, match="grad_weight_out must be"):
        fused_linear_logprobs(p.hidden, w, p.target, grad_weight_out=torch.zeros(3, 3))
    with pytest.raises(ValueError, match="weight.requires_grad is False"):
        fused_linear_logprobs(p.hidden, p.weight, p.target, grad_weight_out=torch.zeros(p.weight.shape))
    with pytest.raises(ValueError, match="chunk_size"):
        fused_linear_logprobs(p.hidden, w, p.target, chunk_size=0)
