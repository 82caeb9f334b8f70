"""Differential fuzz of NeMo-RL's exact path (every plugin key unset) against NeMo-RL's ClippedPGLossFn, over NeMo-RL's
whole config space and random batches with the edge inputs NeMo-RL tolerates.

NeMo-RL cannot be installed, so :func:`nemo_rl_loss` below re-derives its formulas (commit 7ea279ab) independently,
in float64, from a reading of its code: masks multiply (``sum(v * m) / (N + 1e-8)``), IS weights are
``nan_to_num``-ed before truncation, the KL reads ``curr_logprobs_unfiltered`` when present, force_on_policy_ratio is
tested before disable_ppo_ratio, the NLL term needs a positive weight and ``rewards``, GSPO's
``sampling_importance_ratio`` broadcasts ``[B, 1]`` against ``[B]``. Rejections: NeMo-RL's constructor assertions
plus what it raises at the first call (dual clip <= 1, an unknown KL type, a truncation ratio without a type).

Each trial compares: rejected by both or by neither; loss, gradients w.r.t. both current log-prob inputs and every
metric NeMo-RL returns (float64, tight tolerances); and in float32 the NeMo-RL metrics and the loss bit for bit.

One deliberate difference, re-derived here as the plugin does it: with ``use_on_policy_kl_approximation`` and a
non-finite generation log-prob, NeMo-RL's KL weight ``nan_to_num(exp(c - g))`` is the constant 0 but its backward
computes 0 * inf = NaN, which makes that token's whole gradient NaN; the plugin (and this reference) differentiate the
value NeMo-RL computes, so the KL adds 0 there and the other terms keep their gradient.
"""

from __future__ import annotations

import math
import random
import warnings

import pytest
import torch

from nemo_is_plugin import build_loss_fn
from nemo_is_plugin.config import ConfigValidationError
from nemo_is_plugin.loss.config_model import NUMERIC_RANGES

KL_TYPES = ("k1", "k2", "k3")
TIS_TYPES = ("tis", "icepop", "seq-mask-tis")


class Rejected(Exception):
    """NeMo-RL refuses the config (at construction or at its first call)."""


def nemo_rl_rejects(c: dict) -> bool:
    gspo, tok, t = c["sequence_level_importance_ratios"], c["token_level_loss"], c["truncated_importance_sampling_type"]
    hi, lo = c["truncated_importance_sampling_ratio"], c["truncated_importance_sampling_ratio_min"]
    if gspo and tok:
        return True
    if c["use_cispo"] and (
        c["disable_ppo_ratio"] or c["force_on_policy_ratio"] or gspo or c["ratio_clip_c"] is not None or not tok
    ):
        return True
    if t is not None and (
        not c["use_importance_sampling_correction"]
        or t not in TIS_TYPES
        or hi is None
        or hi <= 0
        or (lo is not None and lo > hi)
        or (t != "tis" and lo is None)
        or (t == "seq-mask-tis" and gspo)
    ):
        return True
    call_time = (t is None and hi is not None) or (c["ratio_clip_c"] is not None and c["ratio_clip_c"] <= 1)
    return call_time or c["reference_policy_kl_type"] not in KL_TYPES


def nemo_rl_loss(c: dict, x: torch.Tensor, data: dict, n_seq, n_tok):
    """(loss, metrics) of NeMo-RL's ClippedPGLossFn; ``x`` and ``data['curr_logprobs_unfiltered']`` may require grad."""
    if nemo_rl_rejects(c):
        raise Rejected
    nan0 = lambda t: torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0)  # noqa: E731
    mm = lambda v, m, n: (v * m).sum() / (n + 1e-8)  # noqa: E731
    row = lambda v, m: (v * m).sum(-1) / (m.sum(-1) + 1e-8)  # noqa: E731
    sl = lambda k: data[k][:, 1:]  # noqa: E731
    tm, sm = sl("token_mask"), data["sample_mask"]
    m, adv, g = tm * sm.unsqueeze(-1), sl("advantages"), sl("generation_logprobs")
    p = x.detach() if c["force_on_policy_ratio"] else sl("prev_logprobs")
    beta = 0.0 if c["use_kl_in_reward"] else c["reference_policy_kl_penalty"]
    kind, gspo, level = c["reference_policy_kl_type"], c["sequence_level_importance_ratios"], c["token_level_loss"]

    def kl(lp, ref, clamp_in=None, clamp_out=None, w=None):
        logr = ref - lp
        if clamp_in is not None:
            clamped = logr.clamp(-clamp_in, clamp_in)
            w = None if w is None else torch.where(logr == clamped, w, w.detach())
            logr = clamped
        k = {"k1": -logr, "k2": logr**2 / 2, "k3": torch.exp(logr) - 1 - logr}[kind]
        k = k if w is None else w * k
        return k if clamp_out is None else k.clamp(-clamp_out, clamp_out)

    out = {
        "token_mult_prob_error": mm(torch.exp((g - p).abs() * m), m, n_tok),
        "gen_kl_error": mm(kl(g, p), m, n_tok),
        "policy_kl_error": mm(kl(p, g), m, n_tok),
    }
    mix = torch.log(0.5 * torch.exp(p) + 0.5 * torch.exp(g))
    out["js_divergence_error"] = mm(
        0.5 * (torch.exp(p - mix) - (p - mix) - 1) + 0.5 * (torch.exp(g - mix) - (g - mix) - 1), m, n_tok
    )
    kl_loss = torch.zeros((), dtype=x.dtype)
    if beta != 0:
        cu = data.get("curr_logprobs_unfiltered", x)
        if c["use_on_policy_kl_approximation"]:  # nan_to_num(exp(cu - g)); see the module docstring for the gradient
            finite = torch.isfinite(torch.exp(cu.detach() - g))
            w = torch.where(finite, torch.exp(torch.where(finite, cu - g, torch.zeros_like(g))), torch.zeros_like(g))
        else:
            w = nan0(torch.exp(cu - cu.detach()))
        k = beta * kl(cu, sl("reference_policy_logprobs"), c["kl_input_clamp_value"], c["kl_output_clamp_value"], w)
        kl_loss = mm(k, m, n_tok) if level else mm(row(k, tm), sm, n_seq)
    if c["force_on_policy_ratio"]:
        r = rc = torch.exp(x - x.detach())
    elif not c["disable_ppo_ratio"]:
        r = torch.exp(row(x - p, tm)).unsqueeze(-1).expand_as(x) if gspo else torch.exp(x - p)
        rc = r.clamp(1 - c["ratio_clip_min"], 1 + c["ratio_clip_max"])
    else:
        r = rc = x
    surrogate = -adv * rc.detach() * x if c["use_cispo"] else torch.maximum(-adv * r, -adv * rc)
    if c["ratio_clip_c"] is not None:
        surrogate = torch.where(adv < 0, torch.minimum(surrogate, -adv * c["ratio_clip_c"]), surrogate)
    w = nan0(torch.exp(((p - g) * m).sum(-1))).detach().unsqueeze(-1) if gspo else nan0(torch.exp(p - g))
    t, hi, lo = (
        c["truncated_importance_sampling_type"],
        c["truncated_importance_sampling_ratio"],
        c["truncated_importance_sampling_ratio_min"],
    )
    if t == "tis":
        lo = 0.0 if lo is None else lo
        out["is_oob_ratio"] = mm(((w > hi) | (w < lo)).to(x.dtype), m, n_tok)
        w = w.clamp(lo, hi)
    elif t == "icepop":
        keep = (w >= lo) & (w <= hi)
        out["is_oob_ratio"] = mm((~keep).to(x.dtype), m, n_tok)
        w = torch.where(keep, w, torch.zeros_like(w))
    elif t == "seq-mask-tis":
        geo = torch.exp(row(nan0(p - g), tm)).detach()
        kept = ((geo >= lo) & (geo <= hi)).to(x.dtype)
        out["is_oob_ratio"] = mm(1.0 - kept, sm, n_seq)
        w = w * kept.unsqueeze(-1)
    weighted = (w if c["use_importance_sampling_correction"] else torch.ones_like(x)) * surrogate
    actor = mm(weighted, m, n_tok) if level else mm(row(weighted, tm), sm, n_seq)
    out["sampling_importance_ratio"] = mm(w, sm, n_seq) if gspo else mm(w, m, n_tok)  # [B,1] x [B] broadcast
    out["approx_entropy"] = -mm(torch.exp(x.detach() - g) * x.detach(), m, n_tok)
    nll, mu = torch.zeros((), dtype=x.dtype), c["positive_example_nll_weight"]
    if mu > 0 and "rewards" in data:
        cm = m * (data["rewards"] > 0).to(x.dtype).unsqueeze(-1)
        if cm.sum() > 0:
            nll = mm(-x, cm, cm.sum())
    loss = actor + kl_loss + mu * nll
    valid = m.bool()
    for name, v in (("probs_ratio", r.detach()), ("probs_ratio_clamped", rc.detach())):
        out[name] = mm(v, m, n_tok)
        out[f"{name}_min"] = v[valid].min() if valid.any() else torch.tensor(math.inf)
        out[f"{name}_max"] = v[valid].max() if valid.any() else torch.tensor(-math.inf)
    out.update(loss=loss.detach(), num_valid_samples=sm.sum(), positive_nll_loss=nll.detach())
    out = {k: float(v) for k, v in out.items()}
    out["kl_penalty"] = (
        float(kl_loss.detach()) / beta if kl_loss != 0 else 0.0
    )  # a Python division of the loss-dtype value
    return loss, out


# ------------------------------------------------------------------------------------------------ random trials
def random_config(rng: random.Random) -> dict:
    """A config NeMo-RL mostly accepts, then (one time in three) one key drawn from its whole range."""
    pick = rng.choice
    gspo = rng.random() < 0.25
    trunc = pick([None, None, "tis", "icepop", "seq-mask-tis"]) if not gspo else pick([None, "tis", "icepop"])
    hi = pick([0.9, 1.002, 1.5, 2.0, 5.0]) if trunc else None
    cfg = {
        "disable_ppo_ratio": rng.random() < 0.15,
        "token_level_loss": not gspo and rng.random() < 0.7,
        "sequence_level_importance_ratios": gspo,
        "ratio_clip_min": pick([0.0, 0.1, 0.2, 0.2, 0.5, 1.0]),
        "ratio_clip_max": pick([0.0, 0.2, 0.28, 1.0, 5.0]),
        "ratio_clip_c": pick([None, None, 1.5, 3.0]),
        "reference_policy_kl_penalty": pick([0.0, 0.01, 0.1, 1.0]),
        "reference_policy_kl_type": pick(KL_TYPES),
        "kl_input_clamp_value": pick([20.0, 20.0, None, 0.3, 2.0]),
        "kl_output_clamp_value": pick([10.0, 10.0, None, 0.2]),
        "use_kl_in_reward": rng.random() < 0.15,
        "use_importance_sampling_correction": bool(trunc) or rng.random() < 0.5,
        "truncated_importance_sampling_type": trunc,
        "truncated_importance_sampling_ratio": hi,
        "truncated_importance_sampling_ratio_min": (
            min(hi, pick([0.5, 0.7, 0.999])) if trunc != "tis" or rng.random() < 0.5 else None
        )
        if trunc
        else None,
        "use_on_policy_kl_approximation": rng.random() < 0.3,
        "force_on_policy_ratio": rng.random() < 0.2,
        "use_cispo": False,
        "positive_example_nll_weight": pick([0.0, 0.0, 0.1, 1.0, -0.5]),
    }
    if rng.random() < 0.2 and not gspo and cfg["token_level_loss"]:
        cfg.update(use_cispo=True, disable_ppo_ratio=False, force_on_policy_ratio=False, ratio_clip_c=None)
    if rng.random() < 0.35:  # anything from the key's range, NeMo-RL's rejections included
        key, values = pick(list(WHOLE_RANGE.items()))
        cfg[key] = pick(values)
    return cfg


WHOLE_RANGE = {
    "disable_ppo_ratio": [True, False],
    "token_level_loss": [True, False],
    "force_on_policy_ratio": [True, False],
    "sequence_level_importance_ratios": [True, False],
    "use_cispo": [True, False],
    "ratio_clip_c": [0.5, 1.0, 2.0],
    "reference_policy_kl_type": ["k1", "k4"],
    "use_importance_sampling_correction": [True, False],
    "truncated_importance_sampling_type": [None, "tis", "icepop", "seq-mask-tis", "clip"],
    "truncated_importance_sampling_ratio": [None, 0.0, 0.8, 3.0],
    "truncated_importance_sampling_ratio_min": [None, 0.5, 4.0],
    "positive_example_nll_weight": [0.0, 2.0, -1.0],
    "use_kl_in_reward": [True, False],
}


def random_batch(rng: random.Random, dtype: torch.dtype):
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    b, s = rng.randint(1, 4), rng.randint(2, 9)
    u = lambda *shape: torch.rand(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    curr = -u(b, s - 1) * 2.5 - 0.02
    tm = (u(b, s) > 0.2).double()
    tm[:, 0] = 0
    sm = (u(b) > 0.15).double() if rng.random() < 0.8 else torch.ones(b, dtype=torch.float64)
    if rng.random() < 0.05:
        tm = torch.zeros_like(tm)
    spread = rng.choice([0.05, 0.3, 1.0])
    col0 = torch.zeros(b, 1, dtype=torch.float64)
    shifted = lambda t: torch.cat([col0 - 7.0, t], 1)  # noqa: E731  (column 0 is junk NeMo-RL never reads)
    prev = curr + (u(b, s - 1) - 0.5) * spread
    data = {
        "input_ids": torch.zeros(b, s, dtype=torch.long),
        "token_mask": tm,
        "sample_mask": sm,
        "advantages": torch.cat([col0 + 5.0, torch.randn(b, s - 1, generator=g, dtype=torch.float64)], 1),
        "prev_logprobs": shifted(prev),
        "generation_logprobs": shifted(prev + (u(b, s - 1) - 0.5) * spread),
        "reference_policy_logprobs": shifted(curr + (u(b, s - 1) - 0.5) * 2 * spread),
    }
    if rng.random() < 0.7:
        data["rewards"] = torch.randn(b, generator=g, dtype=torch.float64)
    if rng.random() < 0.3:  # top-k / top-p training: unfiltered log-probs lie below the filtered ones
        data["curr_logprobs_unfiltered"] = curr - u(b, s - 1) * 0.5
    valid = (tm[:, 1:] * sm[:, None]).nonzero().tolist()
    edge = rng.choice(["none", "none", "neg_inf_gen", "positive"])
    if edge == "neg_inf_gen" and valid:
        i, t = rng.choice(valid)
        data["generation_logprobs"][i, t + 1] = -math.inf
    elif edge == "positive":  # slightly positive log-probs, NeMo-RL's tests use log 3
        for key in ("prev_logprobs", "generation_logprobs", "reference_policy_logprobs"):
            data[key][:, 1:] += rng.choice([0.0, 0.2, math.log(3.0)])
        curr = curr + rng.choice([0.0, 0.15])
    n_seq, n_tok = sm.sum(), (tm[:, 1:] * sm[:, None]).sum()
    if rng.random() < 0.3:  # other DP ranks
        n_seq, n_tok = n_seq + rng.randint(1, 4), n_tok + rng.randint(1, 20)
    cast = lambda t: t.to(dtype) if t.is_floating_point() else t  # noqa: E731
    return cast(curr), {k: cast(v) for k, v in data.items()}, cast(n_seq), cast(n_tok), edge


def _run(fn, x, data, n_seq, n_tok):
    x = x.clone().requires_grad_(True)
    data = dict(data)
    leaves = [x]
    if "curr_logprobs_unfiltered" in data:
        data["curr_logprobs_unfiltered"] = data["curr_logprobs_unfiltered"].clone().requires_grad_(True)
        leaves.append(data["curr_logprobs_unfiltered"])
    loss, metrics = fn(x, data, n_seq, n_tok)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True) if loss.requires_grad else [None] * len(leaves)
    return loss.detach(), metrics, [torch.zeros_like(t) if gr is None else gr for t, gr in zip(leaves, grads)]


def _plugin(config):
    fn = build_loss_fn(config)
    return lambda x, data, n_seq, n_tok: fn(
        next_token_logprobs=x, data=data, global_valid_seqs=n_seq, global_valid_toks=n_tok
    )


def _bitwise(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _same(a: float, b: float, rel: float) -> bool:
    if math.isnan(b) or math.isinf(b):
        return a == b or (math.isnan(a) and math.isnan(b))
    return abs(a - b) <= rel * abs(b) + 1e-12


def trial(seed: int) -> str:
    rng = random.Random(seed)
    cfg = random_config(rng)
    batch_seed = rng.randrange(2**31)
    x, data, n_seq, n_tok, edge = random_batch(random.Random(batch_seed), torch.float64)
    try:
        want = _run(lambda *a: nemo_rl_loss(cfg, *a), x, data, n_seq, n_tok)
    except Rejected:
        want = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # input-tolerance and ignored-key notices
        try:
            plugin = _plugin(cfg)
        except ConfigValidationError as exc:
            if want is not None:  # only the documented refusals of values outside a key's valid range
                keys = [k for k, r in NUMERIC_RANGES.items() if cfg.get(k) is not None and not r.contains(cfg[k])]
                assert keys and "is outside its valid range" in str(exc) and all(f"{k}=" in str(exc) for k in keys), (
                    f"seed {seed}: NeMo-RL accepts {cfg}, the plugin refuses it: {exc}"
                )
                return "out of range"
            return "both reject"
        assert want is not None, f"seed {seed}: NeMo-RL refuses {cfg}, the plugin accepts it"
        got = _run(plugin, x, data, n_seq, n_tok)
    (loss, metrics, grads), (ref_loss, ref_metrics, ref_grads) = got, want
    where = f"seed {seed} ({edge}) {cfg}"
    assert _same(loss.item(), ref_loss.item(), 1e-9), f"{where}: loss {loss.item()} vs {ref_loss.item()}"
    for gr, ref in zip(grads, ref_grads):
        torch.testing.assert_close(gr, ref, rtol=1e-9, atol=1e-12, msg=lambda m: f"{where}: gradient: {m}")
    bad = {k: (metrics.get(k), v) for k, v in ref_metrics.items() if k not in metrics or not _same(metrics[k], v, 1e-9)}
    assert not bad, f"{where}: metrics (plugin, NeMo-RL): {bad}"

    # float32, NeMo-RL's dtype: the loss and NeMo-RL's metrics bit for bit (its tests compare some with ==)
    x32, data32, n_seq32, n_tok32, _ = random_batch(random.Random(batch_seed), torch.float32)
    ref_loss, ref_metrics, _ = _run(lambda *a: nemo_rl_loss(cfg, *a), x32, data32, n_seq32, n_tok32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss, metrics, _ = _run(plugin, x32, data32, n_seq32, n_tok32)
    assert loss.dtype == torch.float32 and loss.item() == ref_loss.item(), f"{where}: float32 loss"
    bad = {k: (metrics[k], v) for k, v in ref_metrics.items() if not _bitwise(metrics[k], v)}
    assert not bad, f"{where}: float32 metrics not bit-exact (plugin, NeMo-RL): {bad}"
    return "agree"


@pytest.mark.parametrize("chunk", range(6))
def test_nemo_rl_exact_path_equals_nemo_rl(chunk):
    """300 (config, batch) trials in all. Where NeMo-RL accepts a config the plugin computes the same, except for values
    outside a key's valid range (config.NUMERIC_RANGES, e.g. a negative positive_example_nll_weight), which the
    plugin refuses on purpose (docs/nemo_rl.md, "Where the plugin deliberately differs")."""
    outcomes = [trial(1000 * chunk + i) for i in range(50)]
    assert outcomes.count("agree") >= 30 and "both reject" in outcomes, outcomes


def test_the_reference_sees_the_edges():
    """The trials do draw every edge input and the rejections (so the agreement above means something)."""
    rng = random.Random(0)
    edges = {random_batch(random.Random(rng.randrange(2**31)), torch.float64)[4] for _ in range(60)}
    assert edges == {"none", "neg_inf_gen", "positive"}
    cfgs = [random_config(random.Random(s)) for s in range(300)]
    assert sum(map(nemo_rl_rejects, cfgs)) > 20
    assert any(c["force_on_policy_ratio"] and c["disable_ppo_ratio"] for c in cfgs)
    assert any(c["positive_example_nll_weight"] < 0 for c in cfgs) and any(c["use_cispo"] for c in cfgs)
