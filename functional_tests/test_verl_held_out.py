"""A held-out comparison of the verl adapter with verl 0.9.1's own policy losses, as a verl user calls them.

Random cases per verl ``loss_mode`` (every ``loss_agg_mode``, ragged rows, empty and one-token rows, per-token or
per-sequence advantages, token log-ratios beyond +-20, with and without verl's rollout weights, direct calls without
``global_batch_info`` as verl's own tests make, and with the counts verl's ``ppo_loss`` passes at DP 1 and 2 or a
mini-batch larger than the micro-batch) go through ``verl.trainer.ppo.core_algos.get_policy_loss_fn(mode)`` and through
the plugin's loss told the same mode (``policy_loss.nemo_is.loss_mode``). Each case must either agree -- loss,
gradient and every metric verl returns to 1e-6 in float64, the plugin returning verl's metric names exactly, or both
raising the same error -- or be one of the documented outcomes :func:`expected_outcome` names (docs/verl.md,
docs/objectives.md). ``python functional_tests/test_verl_held_out.py`` prints the counts.
Needs verl (the ``verl`` extra); skipped only if verl does not import.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

core_algos = pytest.importorskip(
    "verl.trainer.ppo.core_algos",
    reason="verl is not importable: pip install 'nemo-is-plugin[verl]' (see docs/verl.md)",
)
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402

from nemo_is_plugin.adapters.verl import VerlPolicyLoss  # noqa: E402
from nemo_is_plugin.adapters.verl.config import VerlConfigError  # noqa: E402
from nemo_is_plugin.adapters.verl.hydra import PolicyLossConfig as PluginPolicyLossConfig  # noqa: E402

MODES = ("vanilla", "gspo", "cispo", "dppo_tv", "dppo_kl", "sapo", "geo_mean", "gpg", "dro", "clip_cov", "kl_cov")
AGGREGATIONS = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
INFO_KINDS = ("none", "local", "dp2", "minibatch", "dp2_no_counts")
CASES_PER_MODE = 100
REFUSED_MODE_CASES = 10  # clip_cov / kl_cov: every case is the same refusal
TOL = 1e-6


def make_case(mode: str, index: int) -> dict:
    """One random case of ``mode`` (reproducible from ``mode`` and ``index``)."""
    rng = random.Random(f"{mode}-{index}")
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    b, t = rng.randint(1, 6), rng.randint(1, 12)
    lengths = torch.tensor([rng.choice([0, 1, rng.randint(1, t)]) for _ in range(b)])
    if rng.random() < 0.8:  # mostly at least one row with tokens
        lengths[rng.randrange(b)] = rng.randint(1, t)
    if rng.random() < 0.05:  # an all-masked micro-batch
        lengths[:] = 0
    mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).double()
    old = torch.log(0.01 + 0.98 * torch.rand(b, t, generator=g, dtype=torch.float64))
    spread = rng.choice([0.05, 0.5, 2.0])
    curr = (old + spread * torch.randn(b, t, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    if rng.random() < 0.4:  # log-ratios beyond +-20 on some tokens (verl clamps them in some modes only)
        far = torch.rand(b, t, generator=g) < 0.3
        curr = torch.where(far, old + rng.choice([-30.0, -25.0, 22.0]), curr)
    per_seq = rng.random() < 0.5
    adv = torch.randn(b, 1 if per_seq else t, generator=g, dtype=torch.float64).expand(b, t)
    actor = {
        "clip_ratio_low": rng.choice([0.1, 0.2, 3e-4]),
        "clip_ratio_high": rng.choice([0.2, 0.28, 4e-4]),
        "clip_ratio_c": rng.choice([2.0, 3.0, 10.0]),
    }
    if mode == "sapo":
        actor = {"tau_pos": rng.choice([1.0, 2.0]), "tau_neg": rng.choice([1.05, 0.5])}
    info_kind = rng.choice(INFO_KINDS)
    toks, rows = float(mask.sum()), b
    info = {
        "none": {},
        "local": {"dp_size": 1, "batch_num_tokens": toks, "global_batch_size": rows},
        "dp2": {"dp_size": 2, "batch_num_tokens": 2 * toks + 3, "global_batch_size": 2 * rows},
        "minibatch": {"dp_size": 1, "batch_num_tokens": 3 * toks + 1, "global_batch_size": 3 * rows},
        "dp2_no_counts": {"dp_size": 2},  # verl's agg_loss refuses it where it needs a count; geo_mean reads none
    }[info_kind]
    if info and rng.random() < 0.5:  # what verl's ppo_loss copies from actor.loss_scale_factor
        info["loss_scale_factor"] = rng.choice([None, 7.0])
    elif rng.random() < 0.3:  # set on the actor only: verl 0.9.1's losses read global_batch_info's alone
        actor["loss_scale_factor"] = 5.0
    weights = 0.5 + torch.rand(b, t, generator=g, dtype=torch.float64) if rng.random() < 0.4 else None
    agg = rng.choice(AGGREGATIONS)
    if mode in ("sapo", "geo_mean") and rng.random() < 0.8:  # mostly the aggregation verl forces (else refused)
        agg = "seq-mean-token-mean"
    if mode == "cispo" and rng.random() < 0.8:  # mostly token-level (else refused)
        agg = rng.choice(AGGREGATIONS[:2])
    return {
        "mode": mode,
        "agg": agg,
        "inputs": {"old_log_prob": old, "log_prob": curr, "advantages": adv * mask, "response_mask": mask},
        "actor": actor,
        "dro_beta": rng.choice([0.05, 0.5]) if mode == "dro" else None,
        "info_kind": info_kind,
        "info": info,
        "weights": weights,
    }


def expected_outcome(case: dict) -> str:
    """What docs/verl.md says this case gives: "agree", "refusal: <a phrase of the plugin's message>" or
    "documented: <the difference>"."""
    mode, agg = case["mode"], case["agg"]
    if mode in ("clip_cov", "kl_cov"):
        return "refusal: changes with micro-batching"
    if mode in ("sapo", "geo_mean") and agg != "seq-mean-token-mean":
        return "refusal: whatever loss_agg_mode says"
    if mode == "cispo" and not agg.startswith("token"):
        return "refusal: CISPO is token-level"
    if mode == "geo_mean" and case["info_kind"] in ("dp2", "minibatch"):
        # the plugin divides by global_batch_size / dp_size, verl's geo_mean by the micro-batch's rows
        return "documented: geo_mean ignores global_batch_info"
    if _divisor(case) == 0:  # verl's agg_loss divides 0 by 0 (NaN); the plugin's loss of an empty batch is 0
        return "documented: an empty batch"
    if agg == "seq-mean-token-sum-norm" and "loss_scale_factor" in case["actor"] and mode not in ("geo_mean", "sapo"):
        # no global_batch_info["loss_scale_factor"]: verl divides by the response length, the plugin by the actor's
        return "documented: actor.loss_scale_factor in a direct call"
    return "agree"


def _divisor(case: dict) -> float | None:
    """The count verl's agg_loss divides this case's loss by (None: it divides by none)."""
    mode, agg, info, mask = case["mode"], case["agg"], case["info"], case["inputs"]["response_mask"]
    agg = "seq-mean-token-mean" if mode == "sapo" else agg
    if mode == "geo_mean" or agg == "token-sum":
        return None
    if agg == "token-mean":
        return info.get("batch_num_tokens", float(mask.sum()))
    return info.get("global_batch_size", float((mask.sum(-1) > 0).sum()))


def _actor(case: dict, plugin: bool) -> ActorConfig:
    mode = case["mode"]
    if plugin:
        policy_loss = PluginPolicyLossConfig(dro_beta=case["dro_beta"], nemo_is={"loss_mode": mode})
    else:
        policy_loss = PolicyLossConfig(loss_mode=mode, dro_beta=case["dro_beta"])
    cfg = ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_gpu=1,
        loss_agg_mode=case["agg"],
        policy_loss=policy_loss,
        **case["actor"],
    )
    cfg.global_batch_info.update(case["info"])
    return cfg


def _call(fn, case: dict, plugin: bool):
    """(loss, gradient, metrics) or the exception raised."""
    inputs = case["inputs"]
    log_prob = inputs["log_prob"].clone().requires_grad_(True)
    try:
        loss, metrics = fn(
            old_log_prob=inputs["old_log_prob"],
            log_prob=log_prob,
            advantages=inputs["advantages"],
            response_mask=inputs["response_mask"],
            loss_agg_mode=case["agg"],
            config=_actor(case, plugin),
            rollout_is_weights=case["weights"],
        )
        (grad,) = torch.autograd.grad(loss, log_prob, allow_unused=True)
    except (ValueError, TypeError, AssertionError) as exc:
        return exc
    return loss.detach(), torch.zeros_like(log_prob) if grad is None else grad, metrics


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=TOL, abs_tol=TOL) or (math.isnan(a) and math.isnan(b))


def outcome(case: dict) -> str:
    """What the two implementations gave: "agree", "refusal: <plugin's message>" or "differ: <what>"."""
    theirs = _call(core_algos.get_policy_loss_fn(case["mode"]), case, False)
    ours = _call(VerlPolicyLoss(), case, True)
    if isinstance(ours, VerlConfigError):
        return f"refusal: {ours}"
    if isinstance(ours, Exception) and not isinstance(theirs, Exception):
        return f"differ: plugin {ours!r}, verl computes"
    if isinstance(ours, Exception) or isinstance(theirs, Exception):
        same = type(ours) is type(theirs) and str(ours) == str(theirs)
        return "agree" if same else f"differ: plugin {ours!r}, verl {theirs!r}"
    (loss, grad, metrics), (v_loss, v_grad, v_metrics) = ours, theirs
    if not _close(float(loss), float(v_loss)):
        return f"differ: loss {float(loss)} vs verl {float(v_loss)}"
    if not torch.allclose(grad, v_grad, rtol=TOL, atol=TOL):
        return f"differ: gradient (max |diff| {float((grad - v_grad).abs().max())})"
    verl_named = {k for k in metrics if not k.startswith("actor/nemo_is/") and k.startswith("actor/")}
    if verl_named != set(v_metrics):
        return f"differ: metric names {sorted(verl_named)} vs verl {sorted(v_metrics)}"
    for name, value in v_metrics.items():
        if not _close(float(metrics[name]), float(value)):
            return f"differ: {name} {float(metrics[name])} vs verl {float(value)}"
    return "agree"


def classify(case: dict) -> tuple[str, str]:
    """(expected, got) with the same vocabulary: a documented difference that shows is "documented", one that does not
    show on this case (e.g. equal counts) is "agree"."""
    expected, got = expected_outcome(case), outcome(case)
    if expected.startswith("documented") and got.startswith("differ"):
        got = expected
    if expected.startswith("documented") and got == "agree":
        expected = "agree"
    return expected, got


@pytest.mark.parametrize("mode", MODES)
def test_every_case_agrees_or_is_documented(mode):
    failures = []
    for index in _cases(mode):
        case = make_case(mode, index)
        expected, got = classify(case)
        refused_as_documented = expected.startswith("refusal") and expected.split(": ", 1)[1] in got
        if got.startswith("differ") or (expected != got and not refused_as_documented):
            failures.append(f"{mode}#{index} ({case['agg']}, {case['info_kind']}): expected {expected}, got {got}")
    assert not failures, "\n".join(failures)


def _cases(mode: str) -> range:
    return range(REFUSED_MODE_CASES if mode in ("clip_cov", "kl_cov") else CASES_PER_MODE)


def counts() -> Counter:
    """Outcomes over every case: agree, each refusal, each documented difference, differ."""
    tally: Counter = Counter()
    for mode in MODES:
        for index in _cases(mode):
            expected, got = classify(make_case(mode, index))
            tally[expected if got.startswith("refusal") else got] += 1
    return tally


def test_docs_quote_these_counts():
    """docs/verl.md ("Against verl's own losses, case by case") quotes the counts of this comparison."""
    import re
    from pathlib import Path

    text = " ".join((Path(__file__).resolve().parents[1] / "docs" / "verl.md").read_text().split())
    quoted = re.search(
        r"Of (\d+) cases, (\d+) agree .*?, (\d+) are the plugin's refusals .*? and (\d+) are the documented "
        r"differences",
        text,
    )
    assert quoted is not None
    tally = counts()
    refusals = sum(n for k, n in tally.items() if k.startswith("refusal"))
    documented = sum(n for k, n in tally.items() if k.startswith("documented"))
    assert [int(g) for g in quoted.groups()] == [sum(tally.values()), tally["agree"], refusals, documented]


if __name__ == "__main__":  # pragma: no cover - prints the counts the test asserts on
    for outcome_name, n in sorted(counts().items()):
        print(f"{n:5d}  {outcome_name}")
