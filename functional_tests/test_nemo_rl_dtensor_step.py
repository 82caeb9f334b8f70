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
import torch
from _nemo_rl_step import make_batch, nemo_rl_reduction, run_steps, write_tiny_model
from host_shims.nemo_rl import SKIP_REASON, nemo_rl_path
from host_shims.plugin_settings import NEMO_RL_CTPO, NEMO_RL_M2PO, SEQ_MIS_REJECTION

from nemo_is_plugin import finalize_metrics
from nemo_is_plugin.adapters.nemo_rl import NeMoRLLossFn
from nemo_is_plugin.loss import ClippedPGLoss

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


# The plugin's own settings, in NeMo-RL's loss_fn section (NeMo-RL's keys and the plugin's).
PLUGIN_SETTINGS = {
    "sequence_mean_tis": {**NEMO_RL_TIS, "is_correction_level": "sequence_mean"},
    "ctpo": NEMO_RL_CTPO,
    "m2po": NEMO_RL_M2PO,
    "seq_mis_rejection": {
        **NEMO_RL_TIS,
        **SEQ_MIS_REJECTION,
    },
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
def dp2_steps(model_dir, batches):
    """One spawn of 4 processes (DP 2 x TP 2): a fresh worker per loss, two optimizer steps each."""
    losses = [{"host": "nemo_rl", "loss_fn": NEMO_RL_TIS}, {"host": "plugin", "loss_fn": NEMO_RL_TIS}]
    losses += [{"host": "plugin", "loss_fn": cfg} for cfg in PLUGIN_SETTINGS.values()]
    results = run_steps(nemo_rl_path(), model_dir, 4, 2, losses, batches, MICRO_BATCH)
    return {"native": results[0], "plugin": results[1], **dict(zip(PLUGIN_SETTINGS, results[2:]))}


@pytest.fixture(scope="module")
def dp1_m2po(model_dir, batches):
    """M2PO at DP 1 (2 processes, TP 2), the same micro-batch size."""
    return run_steps(
        nemo_rl_path(), model_dir, 2, 2, [{"host": "plugin", "loss_fn": PLUGIN_SETTINGS["m2po"]}], batches, MICRO_BATCH
    )[0]


def test_the_step_ran_dp2_tp2_and_trained(dp2_steps):
    native = dp2_steps["native"]
    assert native["dp"] == 2
    steps = native["steps"]
    for step in steps:
        assert math.isfinite(step["global_loss"]) and math.isfinite(step["grad_norm"])
        # 2 DP ranks x 2 micro-batches, each a call of the loss that NeMo-RL records
        assert len(step["all_mb_metrics"]["loss"]) == 4
    assert steps[0]["global_loss"] != steps[1]["global_loss"]


def test_plugin_equals_nemo_rl_in_nemo_rl_step(dp2_steps):
    native, plugin = dp2_steps["native"], dp2_steps["plugin"]
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


@pytest.mark.parametrize("setting", sorted(PLUGIN_SETTINGS))
def test_plugin_settings_run_and_every_metric_reaches_nemo_rl(dp2_steps, setting):
    """The step runs and stays finite; every metric the loss declares for the setting, under the name NeMo-RL gets,
    is in NeMo-RL's per-call metrics at both steps, finite; after grpo_train's reduction and finalize_metrics the
    derived metrics are there and finite, and each share-weighted extremum is a mean of the calls' extrema."""
    run = dp2_steps[setting]
    assert all(math.isfinite(v) for values in run["params"].values() for v in values)
    declared = set(NeMoRLLossFn(PLUGIN_SETTINGS[setting]).metric_normalizations)
    for step in run["steps"]:
        assert math.isfinite(step["global_loss"]) and math.isfinite(step["grad_norm"]) and step["grad_norm"] > 0
        per_call = step["all_mb_metrics"]
        assert declared <= set(per_call), declared - set(per_call)
        bad = {k: v for k, v in per_call.items() if not all(math.isfinite(x) for x in v)}
        assert not bad
        reduced = finalize_metrics(nemo_rl_reduction(per_call))
        derived = {"is_weight_std", "is_weight_ess", "chi2_token", "chi2_seq"}
        if setting == "m2po":
            derived |= {"m2po_m2", "m2po_m2_after"}
        assert derived <= set(reduced) and all(math.isfinite(reduced[k]) for k in derived)
        assert 0 < reduced["is_weight_ess"] <= 1
        shares = [n / g for n, g in zip(per_call["num_valid_samples"], per_call["global_valid_seqs"])]
        assert sum(shares) == pytest.approx(1.0)
        for name in (k for k in declared if k.endswith("_mb_mean")):
            extrema = [v / s for v, s in zip(per_call[name], shares) if s > 0]  # each call's own extremum
            assert min(extrema) - 1e-9 <= reduced[name] <= max(extrema) + 1e-9
        assert reduced["is_weight/min_mb_mean"] <= reduced["is_weight/max_mb_mean"]


def _initial_next_token_logprobs(model_dir: str, input_ids: torch.Tensor) -> torch.Tensor:
    """float64 log-probs of the step's first micro-batches (every one of them sees the initial weights)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float64)
    with torch.no_grad():
        logits = model(input_ids=input_ids, use_cache=False).logits
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def _m2po_bound(lp: torch.Tensor, batch: dict, rows: slice, n_seq: float, n_tok: float) -> float:
    data = {k: v[rows] for k, v in batch.items() if k != "input_lengths"}
    _, metrics = ClippedPGLoss(PLUGIN_SETTINGS["m2po"])(lp[rows], data, n_seq, n_tok)
    return metrics["m2po_clip_high_max"]


def test_m2po_statistic_spans_one_micro_batch_of_one_rank_at_dp1_and_dp2(dp2_steps, dp1_m2po, model_dir, batches):
    """docs/nemo_rl.md: in NeMo-RL's DTensor v1 step M2PO's bounds come from one loss call, one micro-batch of one DP
    rank. At DP 1 and DP 2, with the same micro-batches, every call's bound equals the bound of M2PO on that
    micro-batch's tokens alone (float64, the initial weights); the whole batch's bound is another."""
    batch = batches[0]
    lp = _initial_next_token_logprobs(model_dir, batch["input_ids"])
    sm = batch["sample_mask"].double()
    n_seq, n_tok = float(sm.sum()), float((batch["token_mask"][:, 1:].double() * sm[:, None]).sum())
    want = [_m2po_bound(lp, batch, slice(i, i + MICRO_BATCH), n_seq, n_tok) for i in range(0, BATCH, MICRO_BATCH)]
    whole = _m2po_bound(lp, batch, slice(0, BATCH), n_seq, n_tok)
    assert any(_rel(whole, w) > 1e-3 for w in want)
    for run, dp in ((dp1_m2po, 1), (dp2_steps["m2po"], 2)):
        assert run["dp"] == dp
        per_call = run["steps"][0]["all_mb_metrics"]  # DP rank 0's calls first, as Policy.train concatenates them
        shares = [n / g for n, g in zip(per_call["num_valid_samples"], per_call["global_valid_seqs"])]
        got = [v / s for v, s in zip(per_call["m2po_clip_high/max_mb_mean"], shares)]
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert _rel(g, w) < 1e-4, (dp, got, want)
