"""Every edge input on every path of the whole config space (issue 31): a pairwise covering grid of valid configs
(``helpers.config_space``: 15 factors — policy objective, ratio level, clip, pi_old, IS switch and level, truncation,
rejection, veto, KL, aggregation, batch normalisation, NLL, input mode, score centering) crossed with the edge inputs of
``helpers.edge_inputs`` (non-finite and huge generation / prev / reference log-probs on valid, padding and
masked-out tokens, positive log-probs, empty and one-token rows, all-masked batches, a NaN advantage).

Checked, per config and edge input:

- ``ClippedPGLoss.__call__`` in NeMo-RL's layout (float32): the promise of docs/config.md ("Edge inputs"): a finite
  loss, gradient and metrics; exactly the base batch's results for a value nothing reads (masked, or a tensor the config
  does not read); loss and gradient 0 on an all-masked batch; else a one-line ``ValueError`` naming the tensor. And
  the weight rule of a non-finite generation log-prob: the promised weights are 0, and so is the gradient there when
  nothing else reads those tokens;
- ``ClippedPGLoss.compute`` on a packed layout and a context-parallel layout of the same tokens (float64): the padded
  layout's loss, gradient and metrics (the cumulative prefix and the sequence sums of a non-finite term included);
- under the CPU device guard (a sample of the grid): bit for bit the unguarded results;
- on CUDA (``gpu``): the CPU's results;
- the fused LM-head loss (``fused_linear_pg_loss``, single pass where the config allows it, and two passes) on a small
  vocabulary (a third of the grid): the naive loss's results, refusals included.

The grid's size, the pairs it covers and the configs the constraint refused are checked in
:func:`test_the_grid_covers_every_pair_a_valid_config_can_hold` (and reported in docs/testing.md).
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from helpers.config_space import FACTORS, build, config_grid, row_id
from helpers.covering import row_pairs
from helpers.device_guard import assert_identical, device_guard
from helpers.edge_checks import Outcome, check_outcome, check_weight_rule, counts, nemo_rl_call
from helpers.edge_inputs import EDGE_INPUTS, expectation

from nemo_is_plugin import TokenLayout, build_loss_fn
from nemo_is_plugin.distributed.parallel.context_parallel import CPTokenLayout
from nemo_is_plugin.distributed.parallel.cp_sharding import local_tokens, num_chunks
from nemo_is_plugin.loss import LossInputs
from nemo_is_plugin.loss.score_centering import ScoreCenteringHead

GRID = config_grid()
ROWS = GRID.rows
IDS = [f"{i:03d}-{row_id(r)}"[:90] for i, r in enumerate(ROWS)]
BASE = EDGE_INPUTS[0]


def _other_objectives(*allowed: str) -> set[tuple[str, str]]:
    return {("objective", o) for o in FACTORS["objective"] if o not in ("ppo_clip", *allowed)}


def expected_infeasible() -> set[tuple[str, str, str, str]]:
    """The pairs no valid config holds, by the config's own contradictions (config/contradictions.py)."""
    out: set[tuple[str, str, str, str]] = set()
    clip_keys = [c for c in FACTORS["clip"] if c != "ratio"]
    for (_, obj), clip in itertools.product(_other_objectives(), clip_keys):
        out.add(("objective", obj, "clip", clip))  # every other objective replaces PPO's clip and ratio switches
    for (_, obj), ratio in itertools.product(_other_objectives(), FACTORS["ratio"]):
        token_ok = obj in ("dppo_tv", "dppo_kl", "prob_diff", "cppo", "sapo")
        if ratio != "unset" and not (token_ok and ratio == "token"):
            out.add(("objective", obj, "ratio", ratio))
    for agg in FACTORS["aggregation"]:
        if agg != "seq-mean-token-mean":
            out.add(("objective", "gmpo", "aggregation", agg))  # GMPO: a per-sequence mean
    out |= {("objective", "gmpo", "rejection", r) for r in ("token_k1", "token_prob_diff")}  # sequence rules only
    out |= {("ratio", r, "clip", "cispo") for r in ("sequence", "sequence_token", "cumulative", "cumulative_mean")}
    for r, c in itertools.product(
        ("sequence_token", "cumulative", "cumulative_mean"), ("force_on_policy", "reinforce")
    ):
        out.add(("ratio", r, "clip", c))  # force_on_policy_ratio: token or sequence only; disable_ppo_ratio: none
    out |= {("ratio", "sequence", "clip", "reinforce"), ("ratio", "gspo_nemo_rl", "clip", "cispo")}
    out |= {("ratio", "gspo_nemo_rl", "aggregation", a) for a in ("token-mean", "token-sum")}
    out |= {("clip", "cispo", "aggregation", a) for a in FACTORS["aggregation"] if a.startswith("seq-")}
    out.add(("clip", "force_on_policy", "old_policy", "generation"))
    out |= {("is", "off", "truncation", t) for t in ("tis", "tis_min", "icepop", "seq-mask-tis")}
    out |= {("is_level", lv, "truncation", "seq-mask-tis") for lv in ("sequence", "cumulative")}
    for t, r in itertools.product(("seq-mask-tis", "seq-mis", "geo-rs"), ("seq-mis_band", "geo-rs_band")):
        out.add(("truncation", t, "rejection", r))  # a sequence-masking type already rejects sequences
    # score centering: ppo_clip at the token ratio level, token IS weights, no rejection (config/contradictions.py)
    sc = ("score_centering", "on")
    out |= {(*f, *sc) for f in _other_objectives("ppo_clip")}
    out |= {("ratio", r, *sc) for r in FACTORS["ratio"] if r not in ("unset", "token")}
    out |= {("is_level", lv, *sc) for lv in ("sequence", "sequence_mean", "cumulative")}
    out |= {("truncation", t, *sc) for t in ("seq-mask-tis", "seq-mis", "geo-rs")}
    out |= {("rejection", r, *sc) for r in FACTORS["rejection"] if r != "none"}
    out.add(("veto", "on", *sc))
    return out


def test_the_grid_covers_every_pair_a_valid_config_can_hold():
    names = list(FACTORS)
    every = {(a, va, b, vb) for a, b in itertools.combinations(names, 2) for va in FACTORS[a] for vb in FACTORS[b]}
    covered = set().union(*(row_pairs(r, names) for r in ROWS))
    assert covered | set(GRID.infeasible) == every and not covered & set(GRID.infeasible)
    assert len(covered) == GRID.pairs
    assert set(GRID.infeasible) == expected_infeasible(), set(GRID.infeasible) ^ expected_infeasible()
    for row in ROWS:
        build(row)  # every row is a valid config
    assert len(ROWS) < 200 and GRID.refused > 0


# ------------------------------------------------------------------------------------------------ NeMo-RL's layout
def batches(dtype: torch.dtype = torch.float32, device: str = "cpu") -> dict[str, tuple[torch.Tensor, dict]]:
    """Every edge input's (curr, data), built outside any guard."""
    out = {}
    for edge in EDGE_INPUTS:
        curr, data = edge.batch(dtype)
        out[edge.name] = curr.to(device), {k: v.to(device) for k, v in data.items()}
    return out


def run_row(index: int, inputs: dict[str, tuple[torch.Tensor, dict]]) -> dict[str, Outcome]:
    cfg = build(ROWS[index])
    return {name: nemo_rl_call(cfg, curr, data) for name, (curr, data) in inputs.items()}


@pytest.mark.parametrize("index", range(len(ROWS)), ids=IDS)
def test_edge_inputs_on_the_nemo_rl_call(index):
    cfg = build(ROWS[index])
    results = run_row(index, batches())
    base = results[BASE.name]
    for edge in EDGE_INPUTS:
        where = f"{IDS[index]} / {edge.name}"
        check_outcome(results[edge.name], expectation(cfg, edge, torch.float32), edge, base, where)
        curr, data = edge.batch(torch.float32)
        check_weight_rule(cfg, edge, curr, data, results[edge.name], where)


GUARDED = range(0, len(ROWS), 6)


@pytest.mark.parametrize("index", GUARDED, ids=[IDS[i] for i in GUARDED])
def test_edge_inputs_under_the_device_guard(index):
    inputs = batches()
    plain = run_row(index, inputs)
    with device_guard():
        guarded = run_row(index, inputs)
    for name, want in plain.items():
        got = guarded[name]
        if want.error is not None:
            assert type(got.error) is type(want.error) and str(got.error) == str(want.error), name
        else:
            assert got.error is None, (name, got.error)
            assert_identical((got.loss, got.grad, got.metrics), (want.loss, want.grad, want.metrics), name)


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(ROWS)), ids=IDS)
def test_edge_inputs_on_cuda_match_the_cpu(index):
    cpu, cuda = run_row(index, batches()), run_row(index, batches(device="cuda"))
    for name, want in cpu.items():
        got = cuda[name]
        if want.error is not None:
            assert type(got.error) is type(want.error), (name, got.error)
            continue
        assert got.error is None, (name, got.error)
        torch.testing.assert_close(got.loss.cpu(), want.loss, rtol=1e-5, atol=1e-6, equal_nan=True)
        scale = want.grad.abs().max().clamp_min(1e-30)
        torch.testing.assert_close(got.grad.cpu() / scale, want.grad / scale, rtol=0, atol=1e-4, equal_nan=True)
        for k, v in want.metrics.items():
            assert got.metrics[k] == pytest.approx(v, rel=1e-4, abs=1e-6, nan_ok=True), (name, k)


# ------------------------------------------------------------------------------------------------ packed and CP layouts
LAYOUT_EDGES = [e for e in EDGE_INPUTS if e.where in ("valid", "structure", "pad") and e.key != "advantages"]


def padded_inputs(curr: torch.Tensor, data: dict) -> LossInputs:
    n_seq, n_tok = counts(data)
    tokens = {k: data[k][:, 1:] for k in ("prev_logprobs", "generation_logprobs", "reference_policy_logprobs")}
    tokens.update(advantages=data["advantages"][:, 1:], token_mask=data["token_mask"][:, 1:])
    tokens.update({k: data[k][:, 1:] for k in ("rollout_topk_ids", "rollout_topk_logprobs")})
    tokens["curr_topk_logprobs"] = data["curr_topk_logprobs"]
    return LossInputs.from_tokens(curr, tokens, data, n_seq, n_tok)


def compute(loss_fn, inputs: LossInputs, layout) -> Outcome:
    c = inputs.curr_logprobs.detach().clone().requires_grad_(True)
    try:
        loss, metrics = loss_fn.compute(dataclasses.replace(inputs, curr_logprobs=c), layout)
    except ValueError as exc:
        return Outcome(error=exc)
    if loss.requires_grad:
        loss.backward()
    return Outcome(loss.detach(), torch.zeros_like(c) if c.grad is None else c.grad, dict(metrics))


FIELDS = ("curr_logprobs", "prev_logprobs", "generation_logprobs", "reference_logprobs", "advantages", "token_mask")


@pytest.mark.parametrize("index", range(len(ROWS)), ids=IDS)
def test_edge_inputs_on_packed_and_context_parallel_layouts(index):
    """The same tokens packed (THD) and as a single-process CP layout (load-balanced chunks of 2) give the padded
    layout's results; a refusal (an overflowing ratio) is the same refusal."""
    cfg = build(ROWS[index])
    loss_fn = build_loss_fn(cfg)
    for edge in LAYOUT_EDGES:
        if expectation(cfg, edge).outcome == "refused":
            continue  # refused by the input validation of __call__, which compute() does not run
        curr, data = edge.batch(torch.float64)
        inputs = padded_inputs(curr, data)
        want = compute(loss_fn, inputs, TokenLayout.padded(*curr.shape))
        tm = inputs.token_mask
        ends = [int(torch.nonzero(row).max()) + 1 if bool(row.any()) else 0 for row in tm]
        mult = num_chunks(1, "load_balanced")
        lengths = [max(-(-n // mult) * mult, mult) for n in ends]
        flat = _pack_inputs(inputs, lengths)
        cu = list(itertools.accumulate(lengths, initial=0))
        lt = local_tokens(lengths, 0, 1, "load_balanced", torch.device("cpu"))
        cp = CPTokenLayout(lt.seq, lt.position, lt.chunk, len(lengths), mult, None, in_order=True)
        for name, layout in (("packed", TokenLayout.packed(cu)), ("cp", cp)):
            got = compute(loss_fn, flat, layout)
            where = f"{IDS[index]} / {edge.name} / {name}"
            if want.error is not None:
                assert type(got.error) is type(want.error), f"{where}: {got.error!r} vs {want.error!r}"
                continue
            assert got.error is None, f"{where}: {got.error!r}"
            torch.testing.assert_close(got.loss, want.loss, rtol=1e-9, atol=1e-12, msg=where)
            torch.testing.assert_close(got.grad, _pack(want.grad, lengths), rtol=1e-9, atol=1e-12, msg=where)
            for k, v in want.metrics.items():
                assert got.metrics[k] == pytest.approx(v, rel=1e-9, abs=1e-12, nan_ok=True), (where, k)


def _pack_inputs(inputs: LossInputs, lengths: list[int]) -> LossInputs:
    """The token tensors of ``inputs`` (score centering's head included) packed by :func:`_pack`."""
    head = inputs.head
    if head is not None:
        head = ScoreCenteringHead(
            *(None if t is None else _pack(t, lengths) for t in (head.head_ids, head.sampler_head, head.trainer_head))
        )
    return dataclasses.replace(inputs, head=head, **{f: _pack(getattr(inputs, f), lengths) for f in FIELDS})


def _pack(t: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Row i's first ``lengths[i]`` tokens (the row padded with masked zeros up to it), rows back to back."""
    rows = []
    for row, n in zip(t, lengths):
        rows += [row[:n], row.new_zeros((max(n - row.shape[0], 0), *row.shape[1:]))]
    return torch.cat(rows)
