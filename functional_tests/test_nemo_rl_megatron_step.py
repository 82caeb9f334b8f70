"""NeMo-RL's real Megatron training step with the plugin: ``MegatronPolicyWorkerImpl.train``
(nemo_rl/models/policy/workers/megatron_policy_worker.py @7ea279ab) on CPU gloo processes, on a tiny megatron-core
MoE GPT (2 layers, 4 experts top-2, local layer spec), fp32, two optimizer steps per run.

- NeMo-RL's ``ClippedPGLossFn`` and the plugin's ``NeMoRLLossFn``, each given NeMo-RL's ``ClippedPGLossConfig`` of
  the same ``loss_fn`` section (GSPO with NeMo-RL's exp(sum) IS weight and a k3 KL): the same ``global_loss``,
  ``grad_norm``, per-call metrics and parameters after the second step, 1e-6 relative, in every layout of
  ``LAYOUTS``;
- the plugin's CTPO (cumulative ratio) at CP 2 equal to CP 1, both packed.

The harness (worker built without ``__init__``, model, driver's sharding) is functional_tests/_nemo_rl_megatron_step.py;
the shims (Megatron-Bridge, devices, gloo) functional_tests/host_shims/nemo_rl_megatron.py. NeMo-RL's source comes from
``NEMO_RL_PATH`` or the pinned snapshot beside the project; absent, the tests skip naming the variable.
"""

from __future__ import annotations

import math
from dataclasses import replace
from importlib.metadata import PackageNotFoundError, version

import pytest
import torch
from _nemo_rl_megatron_step import EXPERTS, LAYERS, TOPK, VOCAB, Layout, run_steps
from _nemo_rl_step import make_batch, nemo_rl_reduction
from host_shims.nemo_rl import SKIP_REASON, nemo_rl_path
from host_shims.nemo_rl_megatron import SKIP_REASON as BRIDGE_SKIP_REASON
from host_shims.nemo_rl_megatron import megatron_bridge_path
from host_shims.plugin_settings import NEMO_RL_CTPO, NEMO_RL_M2PO, SEQ_MIS_REJECTION

from nemo_is_plugin import finalize_metrics
from nemo_is_plugin.adapters.nemo_rl import NeMoRLLossFn


def _megatron_core_version() -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in version("megatron-core").split(".")[:2])
    except PackageNotFoundError:
        return (0,)


# NeMo-RL @7ea279ab's Megatron path needs megatron-core >= 0.19 (router replay, pg_collection on the model): the
# stacks tier (Python 3.13, requirements/ci-py313.lock); the main tier's 0.16.1 skips.
pytestmark = [
    pytest.mark.skipif(
        _megatron_core_version() < (0, 19),
        reason="NeMo-RL's Megatron step needs megatron-core >= 0.19: it runs in the stacks tier (make test-stacks)",
    ),
    pytest.mark.skipif(nemo_rl_path() is None, reason=SKIP_REASON),
    pytest.mark.skipif(megatron_bridge_path(nemo_rl_path()) is None, reason=BRIDGE_SKIP_REASON),
]

BATCH, MICRO_BATCH = 8, 2
TOP_K = 4  # score centering's head size

# GSPO as NeMo-RL has it (sequence-level ratio, NeMo-RL's exp(sum) IS weight), a k3 KL; plugin keys unset.
NEMO_RL_GSPO = {
    "reference_policy_kl_penalty": 0.01,
    "reference_policy_kl_type": "k3",
    "ratio_clip_min": 0.2,
    "ratio_clip_max": 0.28,
    "sequence_level_importance_ratios": True,
    "token_level_loss": False,
    "use_importance_sampling_correction": True,
}

# The layouts of each spawn (a spawn's layouts share its world size); router replay with the routes the initial
# weights' router takes (recorded in the ranks, as vLLM records them at rollout).
LAYOUTS = {
    1: [
        Layout(),
        Layout(packing=True),
        Layout(packing=True, fuse_loss=True),
        Layout(router_replay=True),
        Layout(packing=True, router_replay=True),
    ],
    2: [
        Layout(tp=2),
        Layout(dp=2),
        Layout(pp=2),
        Layout(tp=2, packing=True),
        Layout(dp=2, packing=True, fuse_loss=True),
        Layout(tp=2, router_replay=True),
        # context parallelism (the CP core attention of host_shims/megatron_cp_attention.py), packed with both
        # wrappers: NeMo-RL's Megatron path takes CP only with sequence packing (nemo_rl/models/megatron/setup.py:881)
        Layout(cp=2, packing=True),
        Layout(cp=2, packing=True, fuse_loss=True),
        # expert parallelism 2 (DP 2, each rank 2 of the 4 experts) with the allgather token dispatcher
        Layout(ep=2, dp=2),
    ],
}
# The plugin's CTPO (its cumulative ratio needs each whole sequence) at CP 1 and CP 2, both packed
CTPO_ACROSS_CP = (Layout(packing=True), Layout(cp=2, packing=True))
ALL_LAYOUTS = [layout for layouts in LAYOUTS.values() for layout in layouts]
HOSTS = ("nemo_rl", "plugin")

# The plugin's own settings in NeMo-RL's loss_fn section, run at world size 1 (unpacked) with the plugin's loss.
PLUGIN_SETTINGS = {
    "gspo_sequence_mean_tis": {
        **NEMO_RL_GSPO,
        "is_correction_level": "sequence_mean",
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 2.0,
    },
    "ctpo": NEMO_RL_CTPO,
    "m2po": NEMO_RL_M2PO,
    "seq_mis_rejection": {
        **NEMO_RL_GSPO,
        "is_correction_level": "sequence_mean",
        **SEQ_MIS_REJECTION,
    },
    # docs/score_centering.md: the sampler's top-k head in the batch, the logits handed to the plugin (input_type
    # LOGIT) so that the label's and the head's log-probs come from one log-softmax
    "score_centering": {
        "reference_policy_kl_penalty": 0.01,
        "reference_policy_kl_type": "k3",
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 2.0,
        "score_centering": True,
        "score_centering_top_k": TOP_K,
    },
}


def _rel(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-12)


def routed_experts(batch: dict[str, torch.Tensor], seed: int) -> dict[str, list]:
    """``routed_experts [B, S, layers, top-k]`` as NeMo-RL's rollout records them (nemo_rl/models/megatron/
    router_replay.py, ``build_router_replay_assignments``): per token and MoE layer, TOPK distinct experts."""
    g = torch.Generator().manual_seed(seed)
    b, s = batch["input_ids"].shape
    routes = torch.rand(b, s, LAYERS, EXPERTS, generator=g).argsort(-1)[..., :TOPK]
    return {"routed_experts": routes.tolist()}


def sampler_head(batch: dict[str, torch.Tensor], seed: int) -> dict[str, list]:
    """``rollout_topk_ids`` / ``rollout_topk_logprobs [B, S, k]`` (docs/score_centering.md, aligned like
    ``generation_logprobs``): the k most likely tokens of a random sampler distribution per response token; outside
    the response, ids 0..k-1 at -inf."""
    g = torch.Generator().manual_seed(seed)
    b, s = batch["input_ids"].shape
    logp = torch.log_softmax(2.0 * torch.randn(b, s, VOCAB, generator=g, dtype=torch.float64), -1)
    top, ids = logp.topk(TOP_K, dim=-1)
    response = batch["token_mask"].bool()[..., None].expand_as(top)
    ids = torch.where(response, ids, torch.arange(TOP_K).expand_as(ids))
    top = torch.where(response, top, torch.full_like(top, -math.inf))
    return {"rollout_topk_ids": ids.tolist(), "rollout_topk_logprobs": top.float().tolist()}


@pytest.fixture(scope="module")
def batches():
    return [make_batch(1, BATCH), make_batch(2, BATCH)]


def _spec(host: str, loss_fn: dict, extra: list | None = None, input_type: str = "logprob", **more: bool) -> dict:
    return {"host": host, "loss_fn": loss_fn, "extra": extra, "input_type": input_type, **more}


@pytest.fixture(scope="module")
def step_runs(batches):
    """One spawn per world size: per layout NeMo-RL's loss and the plugin's on the same section; at world size 1 also
    the plugin's settings. Keyed by (layout name, host or setting)."""
    routes = [routed_experts(b, 10 + i) for i, b in enumerate(batches)]
    heads = [sampler_head(b, 20 + i) for i, b in enumerate(batches)]
    out = {}
    for world, layouts in LAYOUTS.items():
        keys, runs = [], []
        for layout in layouts:
            for host in HOSTS:
                keys.append((layout.name, host))
                runs.append((layout, _spec(host, NEMO_RL_GSPO, record_routes=layout.router_replay)))
        if world == 1:
            keys.append((Layout(router_replay=True).name, "random_routes"))
            runs.append((Layout(router_replay=True), _spec("nemo_rl", NEMO_RL_GSPO, routes)))
            for name, section in PLUGIN_SETTINGS.items():
                centred = name == "score_centering"
                keys.append((Layout().name, name))
                runs.append(
                    (Layout(), _spec("plugin", section, heads if centred else None, "logit" if centred else "logprob"))
                )
        for layout in (layout for layout in CTPO_ACROSS_CP if layout.world == world):
            keys.append((layout.name, "ctpo"))
            runs.append((layout, _spec("plugin", PLUGIN_SETTINGS["ctpo"])))
        out.update(zip(keys, run_steps(nemo_rl_path(), world, runs, batches, MICRO_BATCH), strict=True))
    return out


@pytest.mark.parametrize("layout", ALL_LAYOUTS, ids=lambda layout: layout.name)
def test_plugin_equals_nemo_rl_in_megatron_step(step_runs, layout):
    native, plugin = step_runs[(layout.name, "nemo_rl")], step_runs[(layout.name, "plugin")]
    ranks = [r["ranks"] for r in native]
    assert sorted(r["tp"] for r in ranks) == sorted(list(range(layout.tp)) * (layout.world // layout.tp))
    assert sorted(r["pp"] for r in ranks) == sorted(list(range(layout.pp)) * (layout.world // layout.pp))
    assert sorted(r["dp"] for r in ranks) == sorted(list(range(layout.dp)) * (layout.world // layout.dp))
    calls = len(native[-1]["steps"][0]["all_mb_metrics"]["loss"])
    # unpacked: the DP rank's sequences in micro-batches of MICRO_BATCH; packed: fewer, longer micro-batches
    per_rank = BATCH // layout.dp // MICRO_BATCH
    assert calls < per_rank if layout.packing else calls == per_rank
    for native_rank, plugin_rank in zip(native, plugin, strict=True):
        steps = native_rank["steps"]
        assert steps[0]["global_loss"] != steps[1]["global_loss"]
        for theirs, ours in zip(steps, plugin_rank["steps"], strict=True):
            assert math.isfinite(theirs["global_loss"]) and theirs["grad_norm"] > 0
            assert _rel(ours["global_loss"], theirs["global_loss"]) < 1e-6
            assert _rel(ours["grad_norm"], theirs["grad_norm"]) < 1e-6
            for name, values in theirs["all_mb_metrics"].items():
                assert name in ours["all_mb_metrics"], name
                for a, b in zip(ours["all_mb_metrics"][name], values, strict=True):
                    assert _rel(a, b) < 1e-6, (name, a, b)
        for name, values in native_rank["params"].items():
            got = plugin_rank["params"][name]
            # relative to the tensor's scale: the two losses sum the same terms in another order, so entries differ
            # by fp32 rounding (an ulp of the tensor's largest entries), which near-zero entries cannot be judged by
            worst = max(abs(a - b) for a, b in zip(got, values, strict=True))
            assert worst <= 1e-6 * max(abs(b) for b in values), (name, worst)


REPLAYED = [layout for layout in ALL_LAYOUTS if layout.router_replay]


@pytest.mark.parametrize("layout", REPLAYED, ids=lambda layout: layout.name)
def test_router_replay_replays_the_recorded_routes(step_runs, layout):
    """The first step sees the weights the routes were recorded with: replaying them gives the router's own
    routing's loss and gradient norm in the same layout (to fp32 rounding); routes drawn at random give another
    loss."""
    replayed = step_runs[(layout.name, "nemo_rl")][0]["steps"][0]
    own = step_runs[(replace(layout, router_replay=False).name, "nemo_rl")][0]["steps"][0]
    assert _rel(replayed["global_loss"], own["global_loss"]) < 1e-6
    assert _rel(replayed["grad_norm"], own["grad_norm"]) < 1e-6
    if layout == Layout(router_replay=True):
        drawn = step_runs[(layout.name, "random_routes")][0]["steps"][0]
        assert _rel(drawn["global_loss"], own["global_loss"]) > 1e-4


@pytest.mark.parametrize("setting", sorted(PLUGIN_SETTINGS))
def test_plugin_settings_run_and_every_metric_reaches_nemo_rl(step_runs, setting):
    """The step runs and stays finite; every metric the loss declares, under the name NeMo-RL gets, is in the step's
    ``all_mb_metrics`` at both steps, finite; after grpo_train's reduction and finalize_metrics the derived metrics
    are there and finite (docs/nemo_rl.md)."""
    (run,) = step_runs[(Layout().name, setting)]
    assert all(math.isfinite(v) for values in run["params"].values() for v in values)
    declared = set(NeMoRLLossFn(PLUGIN_SETTINGS[setting]).metric_normalizations)
    for step in run["steps"]:
        assert math.isfinite(step["global_loss"]) and math.isfinite(step["grad_norm"]) and step["grad_norm"] > 0
        per_call = step["all_mb_metrics"]
        assert declared <= set(per_call), declared - set(per_call)
        assert not {k: v for k, v in per_call.items() if not all(math.isfinite(x) for x in v)}
        reduced = finalize_metrics(nemo_rl_reduction(per_call))
        derived = {"is_weight_std", "is_weight_ess", "chi2_token", "chi2_seq"}
        if setting == "m2po":
            derived |= {"m2po_m2", "m2po_m2_after"}
        assert derived <= set(reduced) and all(math.isfinite(reduced[k]) for k in derived)
        assert 0 < reduced["is_weight_ess"] <= 1


def test_ctpo_cumulative_ratio_is_exact_across_cp(step_runs):
    """The plugin's CTPO step at CP 2 equals the CP 1 one (NeMo-RL's packed CP path hands the loss each whole
    sequence's log-probs, gathered over the CP group): every CP rank's loss, grad norm and parameters after two
    steps to 1e-6, its metrics after grpo_train's reduction to 5e-6 (the CP forward sums in another order, so the
    log-probs differ by fp32 rounding; the per-token ratio extrema, exp of a log-ratio of two ~-4 log-probs, carry it
    at up to 2.4e-6 measured, every other metric below 1e-6)."""
    (whole,) = step_runs[(CTPO_ACROSS_CP[0].name, "ctpo")]
    for rank in step_runs[(CTPO_ACROSS_CP[1].name, "ctpo")]:
        for want, got in zip(whole["steps"], rank["steps"], strict=True):
            assert _rel(got["global_loss"], want["global_loss"]) < 1e-6
            assert _rel(got["grad_norm"], want["grad_norm"]) < 1e-6
            # other micro-batches (CP pads each sequence to 2 x CP): compared after grpo_train's reduction
            expected, reduced = nemo_rl_reduction(want["all_mb_metrics"]), nemo_rl_reduction(got["all_mb_metrics"])
            assert set(reduced) == set(expected)
            for name, value in expected.items():
                assert abs(reduced[name] - value) <= 5e-6 * max(abs(value), 1e-3), (name, reduced[name], value)
        for name, values in whole["params"].items():
            worst = max(abs(a - b) for a, b in zip(rank["params"][name], values, strict=True))
            assert worst <= 1e-6 * max(abs(b) for b in values), (name, worst)
