"""The slime adapter under context parallelism (CP=2) and vocab parallelism (TP=2), in two gloo processes.

Each check runs the single-process call in every rank (the reference, no collectives) and the sharded call through
slime's model (tests/adapters/slime_host.py); slime sums the CP ranks' losses and metrics (its loss_function rescales
by the DP x CP size and Megatron averages the gradients), so under CP the ranks' losses and metrics must add up to the
single-process ones and each rank's logit gradient must be its shard of the single-process gradient. Under TP every
rank holds the whole loss. Sequence-level and cumulative IS, sequence ratios and rejections span the CP shards.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed._spawn import run_checks
from helpers.golden_utils import GOLDEN

from adapters.slime_host import loss_function, namespace, shard_logits, shard_vocab, tis_call
from adapters.test_slime_score_centering import head_args, head_case
from nemo_is_plugin.adapters.slime import SlimeISCorrection, SlimePolicyLoss
from nemo_is_plugin.distributed.parallel.groups import ParallelGroups

WORLD = 2
POLICY = {
    c["id"]: c for c in (torch.load(p, weights_only=True) for p in sorted((GOLDEN / "slime" / "policy").glob("*.pt")))
}
TIS = [torch.load(p, weights_only=True) for p in sorted((GOLDEN / "slime" / "tis").glob("case_*.pt"))]
GROUP: dict[str, dist.ProcessGroup] = {}
# plugin keys on top of slime's flags (vanilla_tis case: --use-tis)
PLUGIN_KEYS = {
    "sequence_is": {"is_correction_level": "sequence", "truncated_importance_sampling_ratio": 5.0},
    "sequence_mean_icepop": {"is_correction_level": "sequence_mean", "truncated_importance_sampling_type": "icepop"},
    "cumulative_is": {"is_correction_level": "cumulative"},
    "ctpo_cumulative_ratio": {
        "ratio_level": "cumulative",
        "log_ratio_clip_low": 0.025,
        "log_ratio_clip_high": 0.05,
        "clip_position_power": 0.5,
    },
    "sequence_token_ratio_geo_rs": {
        "ratio_level": "sequence_token",
        "importance_sampling_rejection": "geo-rs",
        "importance_sampling_rejection_min": 0.9,
        "importance_sampling_rejection_max": 1.1,
    },
    "plugin_kl_veto": {"reference_policy_kl_penalty": 0.05, "importance_sampling_veto_threshold": 0.3},
}
TIS_KEYS = {
    "sequence": {"is_correction_level": "sequence", "truncated_importance_sampling_ratio": 3.0},
    "cumulative": {"is_correction_level": "cumulative"},
    "seq_mask_tis": {
        "truncated_importance_sampling_type": "seq-mask-tis",
        "truncated_importance_sampling_ratio": 1.2,
        "truncated_importance_sampling_ratio_min": 0.8,
    },
    "rules": {
        "importance_sampling_rejection_rules": [{"statistic": "k3", "aggregation": "sequence_mean", "max": 0.05}]
    },
}


def setup_workers(rank: int, world_size: int) -> None:
    GROUP["all"] = dist.new_group(list(range(world_size)))


def _run(case, entry, logits, rank=0, cp=1, **overrides):
    x = logits.detach().clone().requires_grad_(True)
    args = namespace(case["args"], **overrides)
    _, loss, metrics = loss_function(
        entry, args, case["batch"], x, num_microbatches=2, step_global_batch_size=8, rank=rank, cp=cp
    )
    loss.backward()
    return loss.detach(), metrics, x.grad


def _summed(t: torch.Tensor) -> torch.Tensor:
    t = t.clone().double()
    dist.all_reduce(t, group=GROUP["all"])
    return t


def _check_cp(case, rank, cp_entry=None, **overrides) -> None:
    cp_entry = SlimePolicyLoss(groups=ParallelGroups(cp=GROUP["all"])) if cp_entry is None else cp_entry
    single = SlimePolicyLoss(groups=ParallelGroups())  # the reference: no groups, whatever parallel_state holds
    want_loss, want_metrics, want_grad = _run(case, single, case["logits"], **overrides)
    local = shard_logits(case["logits"], case["batch"]["total_lengths"], rank, WORLD)
    loss, metrics, grad = _run(case, cp_entry, local, rank=rank, cp=WORLD, **overrides)
    total = _summed(loss)
    sums = {k: _summed(v) for k, v in sorted(metrics.items())}
    torch.testing.assert_close(total, want_loss.double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        grad, shard_logits(want_grad, case["batch"]["total_lengths"], rank, WORLD), atol=1e-6, rtol=1e-4
    )
    assert set(sums) == set(want_metrics)
    for k, v in sums.items():
        torch.testing.assert_close(v, want_metrics[k].double(), rtol=1e-5, atol=1e-6, msg=k)


def check_cp_golden(rank, world):
    for case in POLICY.values():
        _check_cp(case, rank)


def check_cp_plugin_keys(rank, world):
    for keys in PLUGIN_KEYS.values():
        _check_cp(POLICY["vanilla_tis"], rank, nemo_is=keys)
    _check_cp(
        POLICY["gspo"],
        rank,
        nemo_is={
            "is_correction_level": "cumulative",
            "use_importance_sampling_correction": True,
            "truncated_importance_sampling_type": "tis",
            "truncated_importance_sampling_ratio": 2.0,
        },
    )


def check_cp_tis(rank, world):
    from adapters.slime_host import local_positions

    cp_entry = SlimeISCorrection(groups=ParallelGroups(cp=GROUP["all"]))
    for case in TIS:
        inputs = case["inputs"]
        for keys in TIS_KEYS.values():
            args = namespace(case["args"], nemo_is=keys)
            want_loss, want_masks, want_metrics = tis_call(SlimeISCorrection(), args, inputs)
            loss, masks, metrics = tis_call(cp_entry, args, inputs, rank=rank, cp=WORLD)
            pos = [
                local_positions(t, r, rank, WORLD) for t, r in zip(inputs["total_lengths"], inputs["response_lengths"])
            ]
            mine = torch.cat([x[p] for x, p in zip(want_loss.split(inputs["response_lengths"]), pos)])
            torch.testing.assert_close(loss, mine, rtol=1e-6, atol=1e-7)
            for got, want, p in zip(masks, want_masks, pos):
                assert torch.equal(got[p], want[p])
            for k, v in want_metrics.items():
                local = torch.cat([x[p] for x, p in zip(v.split(inputs["response_lengths"]), pos)])
                torch.testing.assert_close(metrics[k], local, rtol=1e-6, atol=1e-7, msg=k)
            rejects = any(not torch.equal(a, b) for a, b in zip(want_masks, inputs["loss_masks"]))
            assert rejects == ("is_correction_level" not in keys)  # the rejection configs do reject here


def check_tp(rank, world):
    tp_entry = SlimePolicyLoss(groups=ParallelGroups(tp=GROUP["all"]))
    for name in ("grpo_defaults", "clip_higher_dual_clip_entropy", "kl_low_var_unbiased", "temperature_chunked"):
        case = POLICY[name]
        # slime pads the vocabulary to a multiple of TP; the padded column never wins the softmax
        logits = torch.cat([case["logits"], torch.full_like(case["logits"][..., :1], -1e4)], dim=-1)
        keys = {"nemo_is": {"is_correction_level": "sequence", "truncated_importance_sampling_ratio": 4.0}}
        want_loss, want_metrics, want_grad = _run(case, SlimePolicyLoss(), logits, use_tis=True, **keys)
        loss, metrics, grad = _run(case, tp_entry, shard_vocab(logits, rank, WORLD), use_tis=True, **keys)
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad, shard_vocab(want_grad, rank, WORLD), atol=1e-6, rtol=1e-4)
        for k, v in want_metrics.items():
            torch.testing.assert_close(metrics[k], v, rtol=1e-5, atol=1e-6, msg=k)


def _run_head(entry, args, case, logits, rank=0, cp=1):
    x = logits.detach().clone().requires_grad_(True)
    _, loss, metrics = loss_function(
        entry, args, case["batch"], x, num_microbatches=1, step_global_batch_size=3, rank=rank, cp=cp
    )
    loss.backward()
    return loss.detach(), metrics, x.grad


def check_score_centering(rank, world):
    """Score centering with upstream slime's head (float64, TIS f): under TP 2 the head ids fall on both vocab shards
    (each rank gathers its own, one log-sum-exp with the label's); under CP 2 the ranks' losses and metrics add up
    to the single-process ones and each rank's logit gradient is its shard of the single-process gradient."""
    case, args = head_case(), head_args({"use_tis": True, "tis_clip": 1.5, "tis_clip_low": 0.5}, {})
    ids = torch.cat(case["batch"]["rollout_topk_token_ids"])
    width = (case["logits"].shape[-1] + 1) // 2
    assert bool((ids < width).any()) and bool((ids >= width).any())  # the head spans both vocab shards
    logits = torch.cat([case["logits"], torch.full_like(case["logits"][..., :1], -1e4)], dim=-1)  # V padded to 2x
    want_loss, want_metrics, want_grad = _run_head(SlimePolicyLoss(groups=ParallelGroups()), args, case, logits)
    tp = SlimePolicyLoss(groups=ParallelGroups(tp=GROUP["all"]))
    loss, metrics, grad = _run_head(tp, args, case, shard_vocab(logits, rank, WORLD))
    torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, shard_vocab(want_grad, rank, WORLD), rtol=1e-10, atol=1e-12)
    assert set(metrics) == set(want_metrics)
    for k, v in want_metrics.items():
        torch.testing.assert_close(metrics[k], v, rtol=1e-10, atol=1e-12, msg=k)
    want_loss, want_metrics, want_grad = _run_head(SlimePolicyLoss(groups=ParallelGroups()), args, case, case["logits"])
    cp = SlimePolicyLoss(groups=ParallelGroups(cp=GROUP["all"]))
    totals = case["batch"]["total_lengths"]
    loss, metrics, grad = _run_head(cp, args, case, shard_logits(case["logits"], totals, rank, WORLD), rank, WORLD)
    torch.testing.assert_close(_summed(loss), want_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, shard_logits(want_grad, totals, rank, WORLD), rtol=1e-10, atol=1e-12)
    assert set(metrics) == set(want_metrics) and "nemo_is/score_centering_drift" in metrics
    for k, v in metrics.items():
        torch.testing.assert_close(_summed(v), want_metrics[k].double(), rtol=1e-10, atol=1e-12, msg=k)


def check_rebuilt_parallel_state(rank, world):
    """The entries slime loads (groups from megatron-core's parallel_state) in a process that destroys and rebuilds its
    groups, CP 2 -> CP 1 (DP 2) -> CP 2: every call uses the groups of that moment (a group kept from the first call
    would shard a CP-1 batch in two and refuse it)."""
    from megatron.core import parallel_state as ps

    from adapters.slime_host import local_positions

    tis_entry, loss_entry = SlimeISCorrection(), SlimePolicyLoss()  # what slime loads: groups="parallel_state"
    case = TIS[0]
    inputs, args = case["inputs"], namespace(case["args"], nemo_is=TIS_KEYS["sequence"])
    want_tis = tis_call(SlimeISCorrection(groups=ParallelGroups()), args, inputs)[0].split(inputs["response_lengths"])
    policy = POLICY["vanilla_tis"]
    try:
        for cp in (2, 1, 2):
            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()
            ps.initialize_model_parallel(context_parallel_size=cp)
            here = rank if cp > 1 else 0
            got = tis_call(tis_entry, args, inputs, rank=here, cp=cp)[0]
            pos = [local_positions(t, r, here, cp) for t, r in zip(inputs["total_lengths"], inputs["response_lengths"])]
            torch.testing.assert_close(got, torch.cat([x[p] for x, p in zip(want_tis, pos)]), rtol=1e-6, atol=1e-7)
            if cp > 1:  # the CP ranks' losses add up to the single-process loss
                _check_cp(policy, rank, cp_entry=loss_entry, nemo_is=PLUGIN_KEYS["sequence_is"])
            else:  # DP 2, no CP: each rank's loss is the single-process loss
                want = _run(policy, SlimePolicyLoss(groups=ParallelGroups()), policy["logits"])
                got_loss = _run(policy, loss_entry, policy["logits"])
                torch.testing.assert_close(got_loss[0], want[0], rtol=1e-6, atol=1e-7)
    finally:
        ps.destroy_model_parallel()


CHECKS = [
    ("cp_golden", check_cp_golden),
    ("cp_plugin_keys", check_cp_plugin_keys),
    ("cp_tis", check_cp_tis),
    ("tp", check_tp),
    ("score_centering", check_score_centering),
    ("rebuilt_parallel_state", check_rebuilt_parallel_state),
]


@pytest.fixture(scope="module")
def gloo_results() -> dict[str, str | None]:
    return run_checks(__name__, WORLD)


@pytest.mark.parametrize("name", [name for name, _ in CHECKS])
def test_slime_parallel(gloo_results, name):
    assert gloo_results[name] is None, gloo_results[name]
