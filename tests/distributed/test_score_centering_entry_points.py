"""Score centering through the parallel entry points, single process: the fused hidden-state loss
(``fused_linear_pg_loss``) in its single pass (the term's dL/d(head log-probs) chunk by chunk, separable.py) and in two
passes, and the LOGIT entry (``LogitClippedPGLoss``, padded and packed), each equal to the plain loss on one float64
full log-softmax gathered at the labels and the head ids (tests/distributed/_centering_cases.py): loss, metrics (the
score_centering_* ones included), dX and dW; the single pass equals the two-pass schedule; padding ids (-1, and 0
with -inf) take no gradient; a batch without the head is refused naming the key. The TP / CP versions:
test_score_centering_parallel.py."""

from __future__ import annotations

import pytest
import torch
from helpers.device_guard import assert_identical, count_host_syncs, run_guarded_and_plain
from helpers.head_reference import head_reference

from nemo_is_plugin import build_loss_fn
from nemo_is_plugin.distributed.entry_points.fused_linear_loss import fused_linear_pg_loss
from nemo_is_plugin.distributed.entry_points.logit_loss import LogitClippedPGLoss

from ._centering_cases import CONFIGS, centering_problem, reference
from ._fused_cases import assert_metrics_close, rel_err
from ._loss_cases import cu_seqlens, pack, padded_lengths

TOL = 1e-5


def _fused(p, config, *, single_pass, chunk_size=5, temperature=1.0):
    h, w = p.hidden.clone().requires_grad_(True), p.weight.clone().requires_grad_(True)
    loss, metrics = fused_linear_pg_loss(
        build_loss_fn(config),
        h,
        w,
        p.target,
        p.data,
        p.global_valid_seqs,
        p.global_valid_toks,
        chunk_size=chunk_size,
        temperature=temperature,
        single_pass=single_pass,
    )
    loss.backward()
    return loss.detach(), metrics, h.grad, w.grad


def _assert_matches(got, want, tol=TOL):
    loss, metrics, dx, dw = got
    # the loss is a small sum of cancelling terms: fp32 inputs leave ~1e-7 absolute
    torch.testing.assert_close(loss.double(), want[0].double(), rtol=tol, atol=tol / 10)
    assert_metrics_close(metrics, want[1], rtol=tol, atol=1e-6)
    assert rel_err(dx, want[2]) < tol and rel_err(dw, want[3]) < tol


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("single_pass", [True, False], ids=["single_pass", "two_pass"])
def test_fused_loss_equals_the_float64_full_log_softmax_loss(name, single_pass):
    p = centering_problem()
    got = _fused(p, CONFIGS[name], single_pass=single_pass, temperature=0.9)
    want = reference(p, CONFIGS[name], temperature=0.9)
    assert want[1]["score_centering_drift"] > 1e-3  # the sampler differs from the trainer: the term acts
    _assert_matches(got, want)


def test_the_term_moves_the_gradient():
    """With the term off, the same batch gives another dX: the comparison above sees the head's gradient."""
    p = centering_problem()
    on = _fused(p, CONFIGS["tis"], single_pass=True)
    off = _fused(p, {k: v for k, v in CONFIGS["tis"].items() if k != "score_centering"}, single_pass=True)
    assert rel_err(on[2], off[2]) > 1e-3


def test_single_pass_equals_two_pass_in_float64():
    p = centering_problem(dtype=torch.float64)
    one = _fused(p, CONFIGS["icepop"], single_pass=True, chunk_size=4)
    two = _fused(p, CONFIGS["icepop"], single_pass=False, chunk_size=7)
    _assert_matches(one, two, tol=1e-10)


def _logit_loss(p, config, **call):
    logits = (p.hidden @ p.weight.t()).detach()
    x = torch.cat([logits, logits[:, :1]], 1).requires_grad_(True)  # [B, S, V]: position s predicts token s + 1
    fn = LogitClippedPGLoss(build_loss_fn(config), chunk_size=5)
    loss, metrics = fn(x, p.data, p.global_valid_seqs, p.global_valid_toks, **call)
    loss.backward()
    return loss.detach(), metrics, x.grad


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logit_entry_equals_the_float64_reference(name):
    p = centering_problem()
    loss, metrics, dlogits = _logit_loss(p, CONFIGS[name])
    logits = (p.hidden.double() @ p.weight.double().t()).requires_grad_(True)
    label, head = head_reference(logits, p.target, p.data["rollout_topk_ids"][:, 1:])
    data = {k: v.double() if v.is_floating_point() else v for k, v in p.data.items()}
    data["curr_topk_logprobs"] = head
    want, want_metrics = build_loss_fn(CONFIGS[name])(label, data, p.global_valid_seqs, p.global_valid_toks)
    want.backward()
    torch.testing.assert_close(loss.double(), want.detach(), rtol=TOL, atol=TOL / 10)
    assert_metrics_close(metrics, want_metrics, rtol=TOL, atol=1e-6)
    assert rel_err(dlogits[:, :-1], logits.grad) < TOL
    assert dlogits[:, -1].abs().max() == 0  # the last position predicts nothing


def test_logit_entry_packed_equals_padded():
    p = centering_problem()
    padded = _logit_loss(p, CONFIGS["tis"])
    logits = (p.hidden @ p.weight.t()).detach()
    full = torch.cat([logits, logits[:, :1]], 1)
    lengths = padded_lengths([full.shape[1]] * full.shape[0], 1)
    packed = pack(full, lengths).unsqueeze(0).requires_grad_(True)
    fn = LogitClippedPGLoss(build_loss_fn(CONFIGS["tis"]), chunk_size=5)
    loss, metrics = fn(packed, p.data, p.global_valid_seqs, p.global_valid_toks, cu_seqlens_padded=cu_seqlens(lengths))
    loss.backward()
    assert rel_err(loss, padded[0]) < 1e-6
    assert_metrics_close(metrics, padded[1], rtol=1e-6)
    assert rel_err(packed.grad[0], pack(padded[2], lengths)) < 1e-6


@pytest.mark.parametrize("key", ["rollout_topk_ids", "rollout_topk_logprobs"])
def test_a_batch_without_the_head_is_refused_naming_it(key):
    p = centering_problem()
    del p.data[key]
    with pytest.raises(KeyError, match=key):
        _fused(p, CONFIGS["tis"], single_pass=None)
    with pytest.raises(KeyError, match=key):
        _logit_loss(p, CONFIGS["tis"])


def test_a_head_of_the_wrong_k_is_refused():
    p = centering_problem()
    config = {**CONFIGS["tis"], "score_centering_top_k": 4}
    with pytest.raises(ValueError, match="score_centering_top_k = 4"):
        _fused(p, config, single_pass=None)
    with pytest.raises(ValueError, match="score_centering_top_k = 4"):
        _logit_loss(p, config)


def test_entry_points_with_the_head_are_device_clean_and_add_no_host_sync():
    """Under the CPU device guard the centred fused loss (single pass and two passes) and LOGIT loss give the plain
    run's results bit for bit, and each call reads the device back exactly as often, from the same lines, as without
    the term: the check of the head's values rides along with the input validation's one read (it was a read of its
    own, once per validation: 4 reads instead of 3 in the single pass, 5 instead of 3 in two passes)."""
    p = centering_problem()
    off = {k: v for k, v in CONFIGS["tis"].items() if k != "score_centering"}
    calls = {
        "single_pass": lambda c: _fused(p, c, single_pass=True),
        "two_pass": lambda c: _fused(p, c, single_pass=False),
        "logit": lambda c: _logit_loss(p, c),
    }

    def run(config):
        def go():
            got, reads = {}, {}
            for name, call in calls.items():
                with count_host_syncs() as syncs:
                    got[name] = call(config)
                reads[name] = sorted(r.where.split(":")[0] for r in syncs.records)
            return got, reads

        return go

    (got, reads), (want, _) = run_guarded_and_plain(run(CONFIGS["tis"]))
    assert_identical(got, want)
    _, reads_off = run(off)()
    assert reads == reads_off
    assert reads["single_pass"] == [
        "nemo_is_plugin/distributed/entry_points/fused_linear_loss.py",
        "nemo_is_plugin/loss/input_values.py",
        "nemo_is_plugin/loss/metrics.py",
    ]


@pytest.mark.parametrize("single_pass", [True, False], ids=["single_pass", "two_pass"])
def test_the_fused_call_refuses_bad_head_values_naming_them(single_pass):
    """The head's values are checked in the input validation's read: a NaN sampler log-prob on a counted token is
    refused with the loss's message, naming the data key and the first bad entry."""
    p = centering_problem()
    b, s = (p.data["token_mask"][:, 1:] * p.data["sample_mask"][:, None]).nonzero()[0].tolist()
    p.data["rollout_topk_logprobs"][b, s + 1, 0] = float("nan")  # [B, S] data: column s + 1 is token s
    want = rf"data\['rollout_topk_logprobs'\] holds 1 value\(s\) .* first at \[{b}, {s}, 0\] = nan"
    with pytest.raises(ValueError, match=want):
        _fused(p, CONFIGS["tis"], single_pass=single_pass)
