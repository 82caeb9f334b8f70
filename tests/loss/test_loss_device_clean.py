"""The loss call is device-clean and reads the device back once, for every config branch, not only the golden ones.

- Every golden case: ``build_loss_fn(config)(...)`` synchronises with the host exactly twice (the input validation's
  one batched check, then the metrics), ``ClippedPGLoss.compute`` once (the metrics), slime's entry points never
  (they return tensor metrics, which slime reduces), the backward never.
- Random valid configs (the property tests' strategy, plus sequence rejection) x random batches in fp32 / bf16 / fp16:
  the call under the device guard equals the plain call bit for bit, with the same two synchronisations.
- The same configs on a packed layout and on a single-process context-parallel layout (both CP orders) of the same
  tokens, under the guard, give the padded layout's loss, gradient and metrics (float64, 1e-9 relative).

Example counts: ~250 by default (``NEMO_IS_PROPERTY_SCALE`` multiplies them, as in helpers/loss_strategies.py).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers.device_guard import assert_identical, count_host_syncs, device_guard, run_guarded_and_plain
from helpers.golden_calls import golden_calls
from helpers.loss_strategies import HYPOTHESIS_SETTINGS, PROPERTY_SCALE, batches, counts, loss_configs
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from nemo_is_plugin import ClippedPGLossConfig, TokenLayout, build_loss_fn
from nemo_is_plugin.config import SEQUENCE_MASK_TYPES
from nemo_is_plugin.distributed.parallel.context_parallel import CPTokenLayout
from nemo_is_plugin.distributed.parallel.cp_sharding import CP_ORDERS, local_tokens, num_chunks
from nemo_is_plugin.loss import LossInputs

CALLS = golden_calls()
_EXAMPLES = {"guard": 150 * PROPERTY_SCALE, "layouts": 100 * PROPERTY_SCALE}


def _files(syncs) -> list[str]:
    return sorted(r.where.split(":")[0] for r in syncs.records)


@pytest.mark.parametrize("call", CALLS, ids=[c.id for c in CALLS])
def test_golden_call_reads_the_device_back_once(call):
    holder = {}

    @contextlib.contextmanager
    def counting():
        with count_host_syncs() as syncs:
            holder["syncs"] = syncs
            yield

    # A first call imports what the loss imports lazily (verl's core_algos on the verl route): an import's own host
    # reads are not the loss's, and which test imports first depends on the order the tests run in.
    call.run("cpu", None, contextlib.nullcontext)
    call.run("cpu", None, counting)  # the loss call and its backward
    validated = call.fmt == "nemo_rl"  # through ClippedPGLoss.__call__, which validates its inputs
    # the objective compositions keep their metrics on the device; slime's entry points return tensor metrics
    host_metrics = call.fmt != "verl_loss_modes" and not call.fmt.startswith("slime")
    want = ["nemo_is_plugin/loss/input_values.py"] * validated + ["nemo_is_plugin/loss/metrics.py"] * host_metrics
    assert _files(holder["syncs"]) == want, str(holder["syncs"])


# ---------------------------------------------------------------------------------------------------- random configs
@st.composite
def configs_with_rejection(draw) -> ClippedPGLossConfig:
    """The property tests' configs, some with a sequence rejection on top of their truncation."""
    cfg = draw(loss_configs())
    if draw(st.booleans()) and cfg.truncated_importance_sampling_type not in SEQUENCE_MASK_TYPES:
        kind, low, high = draw(st.sampled_from([("seq-mis", 0.5, 2.0), ("geo-rs", 0.9, 1.1)]))
        update = dict(
            importance_sampling_rejection=kind,
            importance_sampling_rejection_min=low,
            importance_sampling_rejection_max=high,
        )
        try:
            cfg = ClippedPGLossConfig(**{**cfg.model_dump(exclude_defaults=True), **update})
        except ValidationError:
            pass
    return cfg


@settings(max_examples=_EXAMPLES["guard"], **HYPOTHESIS_SETTINGS)
@given(cfg=configs_with_rejection(), batch=batches(policy_scale=0.3))
def test_random_config_is_device_clean_with_two_host_syncs(cfg, batch):
    x0, data = batch
    n_seq, n_tok = counts(data)
    loss_fn = build_loss_fn(cfg)

    def run():
        x = x0.clone().requires_grad_(True)
        with count_host_syncs() as syncs:
            loss, metrics = loss_fn(next_token_logprobs=x, data=data, global_valid_seqs=n_seq, global_valid_toks=n_tok)
            if loss.requires_grad:
                loss.backward()
        return (loss.detach(), metrics, x.grad), _files(syncs)

    (got, files), (want, _) = run_guarded_and_plain(run)
    assert_identical(got, want)
    assert files == ["nemo_is_plugin/loss/input_values.py", "nemo_is_plugin/loss/metrics.py"], cfg


# ---------------------------------------------------------------------------------------------------- layouts
TOKEN_FIELDS = ("prev_logprobs", "generation_logprobs", "reference_logprobs", "advantages", "token_mask")


def _padded_inputs(x: torch.Tensor, data: dict) -> LossInputs:
    n_seq, n_tok = counts(data)
    t = lambda k: data[k][:, 1:]  # noqa: E731
    return LossInputs(
        curr_logprobs=x,
        prev_logprobs=t("prev_logprobs"),
        generation_logprobs=t("generation_logprobs"),
        reference_logprobs=t("reference_policy_logprobs"),
        advantages=t("advantages"),
        token_mask=t("token_mask"),
        sample_mask=data["sample_mask"],
        global_valid_seqs=n_seq,
        global_valid_toks=n_tok,
        rewards=data["rewards"],
    )


def _pack(t: torch.Tensor, lengths: list[int], padded_to: list[int]) -> torch.Tensor:
    """Row i's first ``lengths[i]`` tokens, then zeros up to ``padded_to[i]``, rows back to back."""
    rows = []
    for row, n, p in zip(t, lengths, padded_to):
        rows += [row[:n], row.new_zeros(p - n)]
    return torch.cat(rows)


def _run_compute(loss_fn, inputs: LossInputs, layout_of) -> tuple:
    c = inputs.curr_logprobs.detach().clone().requires_grad_(True)
    layout = layout_of()
    with count_host_syncs() as syncs:
        loss, metrics = loss_fn.compute(_replace(inputs, curr_logprobs=c), layout)
    if loss.requires_grad:
        loss.backward()
    grad = torch.zeros_like(c) if c.grad is None else c.grad
    return (loss.detach(), metrics, grad), len(syncs)


def _replace(inputs: LossInputs, **kw) -> LossInputs:
    from dataclasses import replace

    return replace(inputs, **kw)


@settings(max_examples=_EXAMPLES["layouts"], **HYPOTHESIS_SETTINGS)
@given(
    cfg=configs_with_rejection(), batch=batches(policy_scale=0.3, dtype=torch.float64), order=st.sampled_from(CP_ORDERS)
)
def test_packed_and_cp_layouts_match_the_padded_one_under_the_guard(cfg, batch, order):
    x, data = batch
    loss_fn = build_loss_fn(cfg)
    padded = _padded_inputs(x, data)
    (want_loss, want_metrics, want_grad), _ = _run_compute(loss_fn, padded, lambda: TokenLayout.padded(*x.shape))

    # Trailing masked tokens are dropped (at least one token per sequence); CP needs lengths in multiples of chunks.
    tm = padded.token_mask
    keep = [max(int(torch.nonzero(row).max()) + 1 if bool(row.any()) else 1, 1) for row in tm]
    mult = num_chunks(1, order)
    lengths = [-(-n // mult) * mult for n in keep]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    packed = _replace(padded, **{f: _pack(getattr(padded, f), keep, lengths) for f in ("curr_logprobs", *TOKEN_FIELDS)})
    cpu = torch.device("cpu")

    def cp_layout_of():
        lt = local_tokens(lengths, 0, 1, order, cpu)
        return CPTokenLayout(lt.seq, lt.position, lt.chunk, len(lengths), mult, None, in_order=True)

    for layout_of in (lambda: TokenLayout.packed(cu, device=cpu), cp_layout_of):
        with device_guard():
            (loss, metrics, grad), syncs = _run_compute(loss_fn, packed, layout_of)
        assert syncs == 1
        torch.testing.assert_close(loss, want_loss, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(grad, _pack(want_grad, keep, lengths), rtol=1e-9, atol=1e-12)
        for k, v in want_metrics.items():
            assert metrics[k] == pytest.approx(v, rel=1e-9, abs=1e-12, nan_ok=True), (k, cfg)
