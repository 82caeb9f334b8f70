"""NeMo-RL's real Megatron training step with the plugin: ``MegatronPolicyWorkerImpl.train``
(nemo_rl/models/policy/workers/megatron_policy_worker.py @7ea279ab) on CPU gloo processes, on a tiny megatron-core
MoE GPT (2 layers, 4 experts top-2, local layer spec), fp32, two optimizer steps per run.

- NeMo-RL's ``ClippedPGLossFn`` and the plugin's ``NeMoRLLossFn``, each given NeMo-RL's ``ClippedPGLossConfig`` of
  the same ``loss_fn`` section (GSPO with NeMo-RL's exp(sum) IS weight and a k3 KL): the same ``global_loss``,
  ``grad_norm``, per-call metrics and parameters after the second step, 1e-6 relative, in every layout of
  ``LAYOUTS``.

The harness (worker built without ``__init__``, model, driver's sharding) is functional_tests/_nemo_rl_megatron_step.py;
the shims (Megatron-Bridge, devices, gloo) functional_tests/host_shims/nemo_rl_megatron.py. NeMo-RL's source comes from
``NEMO_RL_PATH`` or the pinned snapshot beside the project; absent, the tests skip naming the variable.
"""

from __future__ import annotations

import math

import pytest
from _nemo_rl_megatron_step import Layout, run_steps
from _nemo_rl_step import make_batch
from host_shims.nemo_rl import SKIP_REASON, nemo_rl_path
from host_shims.nemo_rl_megatron import SKIP_REASON as BRIDGE_SKIP_REASON
from host_shims.nemo_rl_megatron import megatron_bridge_path

pytestmark = [
    pytest.mark.skipif(nemo_rl_path() is None, reason=SKIP_REASON),
    pytest.mark.skipif(megatron_bridge_path(nemo_rl_path()) is None, reason=BRIDGE_SKIP_REASON),
]

BATCH, MICRO_BATCH = 8, 2

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

# The layouts of each spawn (a spawn's layouts share its world size).
LAYOUTS = {
    1: [Layout(), Layout(packing=True), Layout(packing=True, fuse_loss=True)],
    2: [Layout(tp=2), Layout(dp=2), Layout(pp=2)],
}


HOSTS = ("nemo_rl", "plugin")


def _rel(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-12)


@pytest.fixture(scope="module")
def batches():
    return [make_batch(1, BATCH), make_batch(2, BATCH)]


@pytest.fixture(scope="module")
def parity_runs(batches):
    """Per layout, NeMo-RL's loss and the plugin's on the same section: one spawn per world size."""
    out = {}
    for world, layouts in LAYOUTS.items():
        runs = [
            (layout, {"host": host, "loss_fn": NEMO_RL_GSPO}) for layout in layouts for host in ("nemo_rl", "plugin")
        ]
        results = run_steps(nemo_rl_path(), world, runs, batches, MICRO_BATCH)
        for i, layout in enumerate(layouts):
            out[layout.name] = {"native": results[2 * i], "plugin": results[2 * i + 1]}
    return out


ALL_LAYOUTS = [layout for layouts in LAYOUTS.values() for layout in layouts]


@pytest.mark.parametrize("layout", ALL_LAYOUTS, ids=lambda layout: layout.name)
def test_plugin_equals_nemo_rl_in_megatron_step(parity_runs, layout):
    run = parity_runs[layout.name]
    ranks = [r["ranks"] for r in run["native"]]
    assert sorted(r["tp"] for r in ranks) == sorted(list(range(layout.tp)) * (layout.world // layout.tp))
    assert sorted(r["pp"] for r in ranks) == sorted(list(range(layout.pp)) * (layout.world // layout.pp))
    assert sorted(r["dp"] for r in ranks) == sorted(list(range(layout.dp)) * (layout.world // layout.dp))
    calls = len(run["native"][-1]["steps"][0]["all_mb_metrics"]["loss"])
    # unpacked: the DP rank's sequences in micro-batches of MICRO_BATCH; packed: fewer, longer micro-batches
    per_rank = BATCH // layout.dp // MICRO_BATCH
    assert calls < per_rank if layout.packing else calls == per_rank
    for native_rank, plugin_rank in zip(run["native"], run["plugin"], strict=True):
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
