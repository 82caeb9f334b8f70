"""NeMo-RL's real training step with the plugin: the DTensor v1 policy worker's own ``__init__`` and ``train``
(nemo_rl/models/policy/workers/dtensor_policy_worker.py @7ea279ab) on 4 CPU gloo processes, DP 2 x TP 2 (FSDP2 over
DP, NeMo-RL's tensor-parallel plan for Qwen2 over TP), a tiny random Qwen2 in fp32, two optimizer steps.

- NeMo-RL's ``ClippedPGLossFn`` and the plugin's ``NeMoRLLossFn`` (what docs/nemo_rl.md puts in ``grpo.setup``), each
  given NeMo-RL's ``ClippedPGLossConfig`` of the same ``loss_fn`` section (GRPO with TIS, as
  configs/examples/nemo_rl_grpo_tis.yaml): the same ``global_loss`` and ``grad_norm`` at both steps, every metric
  NeMo-RL reports, and the same parameters after the second step, to 1e-6 relative;
- the plugin's own settings (sequence_mean IS with TIS, CTPO, M2PO, a rejection rule) in the same step: see
  ``test_plugin_settings_*``.

NeMo-RL's source comes from ``NEMO_RL_PATH`` or the pinned snapshot beside the project; absent, the tests skip naming
the variable. The shims (devices, gloo, unused imports) are functional_tests/host_shims/nemo_rl.py.
"""

from __future__ import annotations

import math

import pytest
from _nemo_rl_step import make_batch, run_steps, write_tiny_model
from host_shims.nemo_rl import SKIP_REASON, nemo_rl_path

pytestmark = pytest.mark.skipif(nemo_rl_path() is None, reason=SKIP_REASON)

BATCH, MICRO_BATCH = 8, 2  # per DP rank: 4 sequences in 2 micro-batches

# A loss_fn section NeMo-RL has (GRPO + TIS: configs/examples/nemo_rl_grpo_tis.yaml), plugin keys unset.
NEMO_RL_TIS = {
    "reference_policy_kl_penalty": 0.01,
    "reference_policy_kl_type": "k2",
    "ratio_clip_min": 0.2,
    "ratio_clip_max": 0.28,
    "use_importance_sampling_correction": True,
    "truncated_importance_sampling_type": "tis",
    "truncated_importance_sampling_ratio": 2.0,
    "token_level_loss": True,
}


def _rel(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-12)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("nemo_rl_tiny_qwen2")))


@pytest.fixture(scope="module")
def batches():
    return [make_batch(1, BATCH), make_batch(2, BATCH)]


@pytest.fixture(scope="module")
def native_and_plugin(model_dir, batches):
    losses = [{"host": "nemo_rl", "loss_fn": NEMO_RL_TIS}, {"host": "plugin", "loss_fn": NEMO_RL_TIS}]
    return run_steps(nemo_rl_path(), model_dir, 4, 2, losses, batches, MICRO_BATCH)


def test_the_step_ran_dp2_tp2_and_trained(native_and_plugin):
    native, _ = native_and_plugin
    assert native["dp"] == 2
    steps = native["steps"]
    for step in steps:
        assert math.isfinite(step["global_loss"]) and math.isfinite(step["grad_norm"])
        # 2 DP ranks x 2 micro-batches, each a call of the loss that NeMo-RL records
        assert len(step["all_mb_metrics"]["loss"]) == 4
    assert steps[0]["global_loss"] != steps[1]["global_loss"]


def test_plugin_equals_nemo_rl_in_nemo_rl_step(native_and_plugin):
    native, plugin = native_and_plugin
    for theirs, ours in zip(native["steps"], plugin["steps"]):
        assert _rel(ours["global_loss"], theirs["global_loss"]) < 1e-6
        assert _rel(ours["grad_norm"], theirs["grad_norm"]) < 1e-6
        for name, values in theirs["all_mb_metrics"].items():  # every metric NeMo-RL reports, per micro-batch
            assert name in ours["all_mb_metrics"], name
            for a, b in zip(ours["all_mb_metrics"][name], values):
                assert _rel(a, b) < 1e-6, (name, a, b)
    worst = max(
        _rel(a, b)
        for name, values in native["params"].items()
        for a, b in zip(plugin["params"][name], values)
        if abs(b) > 1e-6
    )
    assert worst < 1e-6
