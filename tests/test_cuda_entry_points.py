"""CUDA tier, entry points other than the golden suites' (those are tests/test_cuda_golden.py; the fused hidden-state
paths have their own parity tests): the LOGIT loss (padded and packed), NeMo-RL's loss function (LOGPROB and LOGIT),
verl's policy loss, the single-process CP layout and the tensor-taking diagnostics, each on CUDA against the same call
on the CPU. Marked ``gpu``: skipped without CUDA. See docs/testing.md.

Tolerances: fp32 loss and metrics rtol 1e-5 / atol 1e-6 (the same fp32 math on both devices, rounding apart; the
metrics rtol 1e-4 for the cancelling KL-type sums); gradients 1e-4 of their largest entry. bf16 logits / log-probs are
upcast to fp32 before any arithmetic on both devices, so the loss and metrics keep the fp32 tolerances, while the
gradients come back in bf16: one rounding step, rtol 1e-2 of the largest entry.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from distributed._loss_cases import LOSS_CONFIGS, cu_seqlens, global_counts, make_batch, pack, padded_lengths

from nemo_is_plugin.adapters.nemo_rl import NeMoRLLossFn
from nemo_is_plugin.adapters.verl import VerlPolicyLoss
from nemo_is_plugin.apps.evidence.is_collapse import IS_LEVELS, level_weights
from nemo_is_plugin.distributed.entry_points.logit_loss import LogitClippedPGLoss
from nemo_is_plugin.distributed.parallel.context_parallel import CPTokenLayout
from nemo_is_plugin.distributed.parallel.cp_sharding import local_tokens, num_chunks
from nemo_is_plugin.loss import ClippedPGLoss, LossInputs
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.mismatch_metrics import mismatch_metric_sums

Result = tuple  # (loss, metrics, *gradients)
DTYPES = [torch.float32, torch.bfloat16]


def _leaf(t: torch.Tensor, device, dtype) -> torch.Tensor:
    """A fresh leaf copy of ``t`` that requires grad (never ``t`` itself, even when no conversion is needed)."""
    return t.detach().to(device, dtype, copy=True).requires_grad_(True)


def _to(data: dict, device) -> dict:
    return {k: v.to(device) for k, v in data.items()}


def compare(run: Callable[[str, torch.dtype], Result], device: str, dtype: torch.dtype) -> None:
    """``run(device, dtype)`` equals ``run("cpu", dtype)`` within the module's tolerances."""
    want, got = run("cpu", dtype), run(device, dtype)
    torch.testing.assert_close(got[0].detach().cpu().float(), want[0].detach().float(), rtol=1e-5, atol=1e-6)
    assert got[1].keys() == want[1].keys()
    bad = {
        k: (got[1][k], v)
        for k, v in want[1].items()
        if not (math.isclose(got[1][k], v, rel_tol=1e-4, abs_tol=1e-6) or (math.isnan(v) and math.isnan(got[1][k])))
    }
    assert not bad, f"metrics differ (got, want): {bad}"
    grad_rtol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    for g, w in zip(got[2:], want[2:]):
        assert g.device.type == torch.device(device).type
        scale = float(w.abs().max()) if w.numel() else 0.0
        torch.testing.assert_close(g.cpu().float(), w.float(), rtol=grad_rtol, atol=grad_rtol * scale + 1e-6)


# ---------------------------------------------------------------------------------------------------- runners
def logit_padded(name: str) -> Callable[[str, torch.dtype], Result]:
    logits, data, _ = make_batch(31)

    def run(device, dtype):
        x = _leaf(logits, device, dtype)
        d = _to(data, device)
        loss, metrics = LogitClippedPGLoss(ClippedPGLoss(LOSS_CONFIGS[name]), chunk_size=7, log_entropy=True)(
            x, d, *global_counts(d)
        )
        loss.backward()
        return loss, metrics, x.grad

    return run


def logit_packed(name: str) -> Callable[[str, torch.dtype], Result]:
    logits, data, lengths = make_batch(32)
    lp = padded_lengths(lengths, 2)
    cu, packed = cu_seqlens(lp), pack(logits, lp).unsqueeze(0)

    def run(device, dtype):
        x = _leaf(packed, device, dtype)
        d = _to(data, device)
        loss, metrics = LogitClippedPGLoss(ClippedPGLoss(LOSS_CONFIGS[name]), chunk_size=7)(
            x, d, *global_counts(d), cu_seqlens_padded=cu.to(device)
        )
        loss.backward()
        return loss, metrics, x.grad

    return run


def nemo_rl_adapter(name: str, input_type: str) -> Callable[[str, torch.dtype], Result]:
    logits, data, _ = make_batch(33)
    lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, data["input_ids"][:, 1:, None]).squeeze(-1)
    fn = NeMoRLLossFn(LOSS_CONFIGS[name], input_type=input_type)

    def run(device, dtype):
        d = _to(data, device)
        n_seq, n_tok = global_counts(d)
        if input_type == "logit":
            x = _leaf(logits, device, dtype)
            loss, metrics = fn(logits=x, data=d, global_valid_seqs=n_seq, global_valid_toks=n_tok)
        else:
            x = _leaf(lp, device, dtype)
            for k in ("prev_logprobs", "generation_logprobs", "reference_policy_logprobs"):
                d[k] = d[k].to(dtype)
            loss, metrics = fn(x, d, n_seq, n_tok)
        loss.backward()
        return loss, metrics, x.grad

    return run


VERL_CONFIGS = {
    "vanilla": ({}, "none"),
    "verl_weights": ({}, "weights"),
    "gspo_seq_mean_tis": (
        {
            "use_importance_sampling_correction": True,
            "is_correction_level": "sequence_mean",
            "ratio_level": "sequence",
            "truncated_importance_sampling_type": "tis",
            "truncated_importance_sampling_ratio": 2.0,
        },
        "log_probs",
    ),
    "ctpo_geo_rs": (
        {
            "ratio_level": "cumulative",
            "log_ratio_clip_low": 0.025,
            "log_ratio_clip_high": 0.05,
            "importance_sampling_rejection": "geo-rs",
            "importance_sampling_rejection_min": 0.9,
            "importance_sampling_rejection_max": 1.1,
        },
        "log_probs",
    ),
}
ACTOR = {"clip_ratio": 0.2, "clip_ratio_c": 3.0, "global_batch_info": {}}


def verl_adapter(name: str, agg: str) -> Callable[[str, torch.dtype], Result]:
    user, source = VERL_CONFIGS[name]
    g = torch.Generator().manual_seed(34)
    b, t = 4, 12
    old = -torch.rand(b, t, generator=g) * 2 - 0.05
    lp0 = old + 0.1 * torch.randn(b, t, generator=g)
    rollout = old - 0.05 * torch.randn(b, t, generator=g).abs()
    mask = torch.rand(b, t, generator=g) > 0.25
    adv = torch.randn(b, t, generator=g)
    fn = VerlPolicyLoss(user)

    def run(device, dtype):
        kw = {}
        if source == "weights":
            kw["rollout_is_weights"] = (torch.exp(old - rollout) * mask).to(device)
        if source == "log_probs":
            kw["rollout_log_probs"] = rollout.to(device, dtype)
        lp = _leaf(lp0, device, dtype)
        loss, metrics = fn(old.to(device, dtype), lp, adv.to(device), mask.to(device), agg, ACTOR, **kw)
        loss.backward()
        return loss, metrics, lp.grad

    return run


def cp_layout_loss(name: str, order: str) -> Callable[[str, torch.dtype], Result]:
    _, data, lengths = make_batch(35)
    mult = num_chunks(1, order)
    lp = padded_lengths(lengths, mult)
    n_seq, n_tok = global_counts(data)
    tokens = {
        k: pack(data[k][:, 1:].float(), lp)
        for k in ("token_mask", "advantages", "prev_logprobs", "generation_logprobs", "reference_policy_logprobs")
    }
    curr = (tokens["prev_logprobs"] + 0.05 * torch.sin(torch.arange(len(tokens["prev_logprobs"])))).clamp(max=0)
    loss_fn = ClippedPGLoss(LOSS_CONFIGS[name])

    def run(device, dtype):
        lt = local_tokens(lp, 0, 1, order, torch.device(device))
        layout = CPTokenLayout(lt.seq, lt.position, lt.chunk, len(lp), mult, None, in_order=True)
        t = {k: v.to(device, dtype if k.endswith("logprobs") else torch.float32) for k, v in tokens.items()}
        c = _leaf(curr, device, dtype)
        inputs = LossInputs(
            curr_logprobs=c,
            prev_logprobs=t["prev_logprobs"],
            generation_logprobs=t["generation_logprobs"],
            reference_logprobs=t["reference_policy_logprobs"],
            advantages=t["advantages"],
            token_mask=t["token_mask"],
            sample_mask=data["sample_mask"].to(device),
            global_valid_seqs=float(n_seq),
            global_valid_toks=float(n_tok),
            rewards=data["rewards"].to(device),
        )
        loss, metrics = loss_fn.compute(inputs, layout)
        loss.backward()
        return loss, metrics, c.grad

    return run


def diagnostics(level: str) -> Callable[[str, torch.dtype], Result]:
    g = torch.Generator().manual_seed(36)
    x = 0.05 * torch.randn(5, 30, generator=g)
    prev = -torch.rand(5, 30, generator=g)
    tm = (torch.rand(5, 30, generator=g) > 0.2).float()

    def run(device, dtype):
        p, m = prev.to(device, dtype), tm.to(device)
        layout = TokenLayout.padded(5, 30, device=device)
        sums = mismatch_metric_sums(p, p - x.to(device, dtype), m, torch.ones(5, device=device), layout, 100.0, 5.0)
        w, log_w = level_weights(x.to(device, torch.float64), level)
        return w.sum(), {k: float(v) for k, v in sums.items()}, log_w

    return run


CASES = (
    [pytest.param(logit_padded(n), id=f"logit_padded-{n}") for n in sorted(LOSS_CONFIGS)]
    + [
        pytest.param(logit_packed(n), id=f"logit_packed-{n}")
        for n in ("nemo_rl_default", "ctpo_cumulative_is", "gspo_nemo_rl", "seq_mis_veto")
    ]
    + [
        pytest.param(nemo_rl_adapter(n, it), id=f"nemo_rl_{it}-{n}")
        for it in ("logprob", "logit")
        for n in ("nemo_rl_default", "gspo_nemo_rl", "gspo_token_seqmean_is_tis", "reinforce_on_policy_kl_nll")
    ]
    + [
        pytest.param(verl_adapter(n, agg), id=f"verl-{n}-{agg}")
        for n in VERL_CONFIGS
        for agg in ("token-mean", "seq-mean-token-mean")
    ]
    + [
        pytest.param(cp_layout_loss(n, o), id=f"cp_layout-{n}-{o}")
        for o in ("load_balanced", "contiguous")
        for n in ("ctpo_cumulative_is", "gspo_token_seqmean_is_tis", "geo_rs_batch_norm")
    ]
    + [pytest.param(diagnostics(level), id=f"diagnostics-{level}") for level in IS_LEVELS]
)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("run", CASES)
def test_entry_point_on_cuda_matches_cpu(run, dtype):
    compare(run, "cuda", dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("run", CASES)
def test_entry_point_runners_work_on_the_cpu(run, dtype):
    """The runners of the CUDA tier, exercised in CPU CI (CPU against CPU), so that they cannot rot unseen."""
    compare(run, "cpu", dtype)
