"""slime's real ``train_one_step`` (THUDM/slime @624b824a) with the plugin enabled through slime's own entry point
(``--loss-type custom_loss --custom-loss-function-path nemo_is_plugin.adapters.slime.policy_loss``), on 4 CPU gloo
ranks (TP 2 x DP 2; TP 4 x DP 1 for the DP 1 runs), see ``_slime_step``. slime's source comes from ``SLIME_PATH``
(default: the pinned snapshot folder slime-624b824a in the hosts folder beside the project); without it every test
here skips, naming the variable.

- slime's own PPO loss (GRPO, eps 0.2 / 0.28, TIS at 1.5, low_var_kl, entropy) against the plugin with no plugin key,
  as the whole loss and as slime's TIS function, and with --calculate-per-token-loss: the same loss, slime metrics,
  grad norm and parameters after two optimizer steps (fp32, 1e-6 relative);
- the plugin's own settings (sequence_mean IS with TIS, CTPO, M2PO, a rejection rule): the step runs, every metric
  docs/slime.md lists for the setting reaches slime's logged metrics under that name, nothing non-finite;
- what M2PO's batch statistic spans in slime: one loss call on every DP rank together (slime deals micro-batch k of a
  step to DP rank k mod DP): DP 2 at micro-batch size 1 makes the update of DP 1 at micro-batch size 2, and differs
  from DP 1 at micro-batch size 1, while the sequence_mean IS + TIS update is the same at DP 1 and DP 2.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
from distributed._spawn import run_checks
from host_shims import slime as slime_shims
from host_shims.plugin_settings import CTPO

WORLD = 4
# across layouts (TP 2 x DP 2 against TP 4 x DP 1) the fp32 reductions differ in order (the vocab-parallel softmax,
# DDP's average): two Adam steps agree to a few 1e-6; within one layout (native against plugin) to 1e-6
LAYOUT_RTOL = 1e-5
DOCS = Path(__file__).resolve().parents[1] / "docs" / "slime.md"

# the slime metrics slime's own loss logs with these flags (loss.py:1142-1163), which the plugin must match
SLIME_NAMES = ("loss", "pg_loss", "entropy_loss", "pg_clipfrac", "ppo_kl", "train_rollout_logprob_abs_diff")
SLIME_NAMES += ("kl_loss", "ois", "tis", "tis_clipfrac", "tis_abs")
IS_NAMES = ("nemo_is/is_weight", "nemo_is/is_rejected_fraction")
CLIP_NAMES = ("nemo_is/clip_fraction_low", "nemo_is/clip_fraction_high", "nemo_is/clip_fraction_dual")
M2PO_NAMES = (
    "nemo_is/m2po_harmful_fraction",
    "nemo_is/m2po_harmful_log_ratio_sq",
    "nemo_is/m2po_capped_log_ratio_sq",
    "nemo_is/m2po_clip_low_mean",
    "nemo_is/m2po_clip_high_mean",
    "nemo_is/m2po_m2",
    "nemo_is/m2po_m2_after",
)
RULE_NAMES = (
    "nemo_is/is_rejection_sequence_max_k2_mean",
    "nemo_is/is_rejection_sequence_max_k2_rejected_fraction",
    "nemo_is/is_rejection_rejected_fraction",
)
TIS_FUNCTION = "nemo_is_plugin.adapters.slime.tis_function"
M2PO = {"policy_objective": "m2po", "m2po_budget": 0.02}
SEQUENCE_MEAN_TIS = {"is_correction_level": "sequence_mean", "truncated_importance_sampling_type": "tis"}
# the plugin's settings: (name, plugin keys, the metrics docs/slime.md lists for them beyond slime's and the clip ones)
SETTINGS: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    ("sequence_mean_tis", SEQUENCE_MEAN_TIS, IS_NAMES),
    ("ctpo", {**CTPO, "is_correction_level": "cumulative", "truncated_importance_sampling_ratio": 5.0}, IS_NAMES),
    ("m2po", M2PO, IS_NAMES + M2PO_NAMES),
    (
        "rejection_rule",
        {"importance_sampling_rejection_rules": [{"statistic": "k2", "aggregation": "sequence_max", "max": 0.05}]},
        IS_NAMES + RULE_NAMES,
    ),
]
# what each run of the module's spawn produced, on rank 0: name -> StepRun (read by the checks after the runs)
RUNS: dict[str, Any] = {}


def setup_workers(rank: int, world_size: int) -> None:
    import _slime_step

    _slime_step.setup_rank()


def _native_vs_plugin(rank: int, world_size: int) -> None:
    import _slime_step as step

    native = step.run_steps(step.slime_args(), tp=2)
    plugin = step.run_steps(step.plugin_args({}), tp=2)
    step.assert_same_update(plugin, native, keys=("loss",))
    for i, (got, want) in enumerate(zip(plugin.metrics, native.metrics, strict=True)):
        for name in SLIME_NAMES:  # the metrics too; ppo_kl is a mean of both signs: relative to max(|value|, 1)
            assert abs(got[name] - want[name]) <= 1e-6 * max(abs(want[name]), 1.0), (i, name, got[name], want[name])
    # the other entry point: slime's own PPO loss with the plugin's TIS function (--custom-tis-function-path)
    tis = step.run_steps(step.slime_args(custom_tis_function_path=TIS_FUNCTION, nemo_is={}), tp=2)
    step.assert_same_update(tis, native, keys=SLIME_NAMES, floor=1.0)
    # slime's per-token reduction (--calculate-per-token-loss: token sums, megatron divides by the step's tokens)
    per_token = step.run_steps(step.slime_args(calculate_per_token_loss=True), tp=2)
    per_token_plugin = step.run_steps(step.plugin_args({}, calculate_per_token_loss=True), tp=2)
    step.assert_same_update(per_token_plugin, per_token, keys=SLIME_NAMES, floor=1.0)
    assert abs(per_token.metrics[0]["loss"] - native.metrics[0]["loss"]) > 1e-4  # another reduction
    clipped = [(m["pg_clipfrac"], m["tis_clipfrac"]) for m in native.metrics]
    assert all(pg > 0 for pg, _ in clipped) and any(tis > 0 for _, tis in clipped), clipped  # both clips act


def _plugin_settings(rank: int, world_size: int) -> None:
    import _slime_step as step

    for name, keys, extra in SETTINGS:
        run = step.run_steps(step.plugin_args(keys), tp=2)
        for i, logged in enumerate(run.metrics):
            missing = [n for n in (*SLIME_NAMES, *CLIP_NAMES, *extra) if n not in logged]
            assert not missing, (name, i, missing, sorted(logged))
            bad = {k: v for k, v in logged.items() if not math.isfinite(v)}
            assert not bad, (name, i, bad)
        assert all(math.isfinite(g) for g in run.grad_norms), (name, run.grad_norms)
        assert all(p.isfinite().all() for p in run.params.values()), name
        RUNS[name] = run
    # the settings bite: M2PO's bound applies to some calls, the rule rejects some tokens
    m2po = RUNS["m2po"].metrics
    assert any(m["nemo_is/m2po_clip_high_mean"] < 1.0 for m in m2po), m2po
    assert any(m["nemo_is/m2po_m2_after"] < m["nemo_is/m2po_m2"] for m in m2po), m2po
    runs = RUNS["rejection_rule"].metrics
    rejected = [(m["nemo_is/is_rejected_fraction"], m[RULE_NAMES[1]], m[RULE_NAMES[2]]) for m in runs]
    assert any(r > 0 for r, _, _ in rejected), rejected
    assert all(abs(a - b) < 1e-7 and abs(a - c) < 1e-7 for a, b, c in rejected), rejected  # the one rule rejects


def _m2po_spans_one_call_across_dp(rank: int, world_size: int) -> None:
    import _slime_step as step

    dp2 = step.run_steps(step.plugin_args(M2PO, micro_batch_size=1), tp=2)
    dp1_same_call = step.run_steps(step.plugin_args(M2PO, micro_batch_size=2), tp=4)
    dp1 = step.run_steps(step.plugin_args(M2PO, micro_batch_size=1), tp=4)
    # DP 2, micro-batches of 1: call k spans samples 2k and 2k + 1 of the step, as DP 1 with micro-batches of 2
    m2po_keys = ("loss", "nemo_is/m2po_m2", "nemo_is/m2po_clip_high_mean")
    step.assert_same_update(dp2, dp1_same_call, rtol=LAYOUT_RTOL, keys=m2po_keys, floor=1.0)
    # DP 1, micro-batches of 1: each call's statistic spans one sample: other bounds, another gradient (Adam's first
    # steps are near sign(g), so the parameters move alike: the grad norm and the loss show it)
    m2 = [(a["nemo_is/m2po_m2"], b["nemo_is/m2po_m2"]) for a, b in zip(dp1.metrics, dp2.metrics, strict=True)]
    norms = list(zip(dp1.grad_norms, dp2.grad_norms, strict=True))
    losses = [(a["loss"], b["loss"]) for a, b in zip(dp1.metrics, dp2.metrics, strict=True)]
    assert all(abs(a - b) > 1e-2 * abs(b) for a, b in m2), m2
    assert any(step.relative(a, b) > 100 * LAYOUT_RTOL for a, b in norms), norms
    assert any(abs(a - b) > 100 * LAYOUT_RTOL for a, b in losses), losses
    # without a batch statistic the split does not matter: sequence_mean IS + TIS at DP 1 and DP 2
    tis_dp2 = step.run_steps(step.plugin_args(SEQUENCE_MEAN_TIS, micro_batch_size=1), tp=2)
    tis_dp1 = step.run_steps(step.plugin_args(SEQUENCE_MEAN_TIS, micro_batch_size=1), tp=4)
    step.assert_same_update(tis_dp2, tis_dp1, rtol=LAYOUT_RTOL, keys=("loss", "nemo_is/is_weight"), floor=1.0)


CHECKS = [
    ("native_vs_plugin", _native_vs_plugin),
    ("plugin_settings", _plugin_settings),
    ("m2po_spans_one_call_across_dp", _m2po_spans_one_call_across_dp),
]


@pytest.fixture(scope="module")
def gloo_results() -> dict[str, str | None]:
    """Every check of ``CHECKS`` in one spawn of ``WORLD`` gloo ranks (slime's and megatron-core's imports once)."""
    if slime_shims.slime_path() is None:
        pytest.skip(slime_shims.SKIP_REASON)
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (requirements/ci.lock)")
    return run_checks(__name__, WORLD)


@pytest.mark.parametrize("name", [name for name, _ in CHECKS])
def test_slime_train_one_step(gloo_results, name):
    assert gloo_results[name] is None, gloo_results[name]


def test_the_documented_metrics_are_the_tested_ones():
    """Every name these tests require of slime's logged metrics is in docs/slime.md's metrics section, and every
    ``nemo_is/`` name that section lists is required by one of them."""
    text = DOCS.read_text()
    section = text[text.index("## Metrics") : text.index("## Tests")]
    required = {n for _, _, extra in SETTINGS for n in (*SLIME_NAMES, *CLIP_NAMES, *extra)}
    documented = {f"nemo_is/{n}" for n in re.findall(r"`(?:nemo_is/)?((?:m2po|is|clip)_[a-z0-9_]+)`", section)}
    for name in required:
        assert f"`{name.removeprefix('nemo_is/')}`" in section or f"`{name}`" in section, name
    assert documented <= required, documented - required
