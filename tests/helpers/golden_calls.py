"""Every golden case of every suite under tests/data/golden as plugin calls on any device and log-prob dtype.

The shared driver of the device-guard tests (CPU, tests/test_device_guard.py) and the CUDA tier
(tests/test_cuda_golden.py). A suite directory is picked up by its ``case_*.pt`` files; each case is recognised by its
format:

- NeMo-RL (``config`` + ``inputs["next_token_logprobs"]``; suites nemo_rl, nemo_rl_compat, ...): one call through
  ``build_loss_fn(config)(...)``, checked against the golden loss, gradients and metrics;
- CTPO (``params["loss_mode"]``): the plugin config of tests/test_golden_ctpo.py through ``ClippedPGLoss.compute``,
  checked against the golden pg_loss and gradient;
- verl rollout correction (``params["rollout_is"]``): the plugin config tests/test_golden_verl.py maps the case's
  ``algorithm.rollout_correction`` settings to, through ``compute``; the golden values there are weights and masks,
  which the CPU suite checks, so these calls are compared with the same call on CPU;
- verl loss modes (``mode`` + ``loss_agg_mode``; suite verl_loss_modes): the plugin's objective functions composed as
  helpers/golden_objectives.py does (not yet a config call), checked against verl's loss, gradient and metrics.
- verl score centering (``params["rollout_correction"]`` + ``inputs["rollout_topk_ids"]``; suite
  verl_score_centering): the verl adapter's ``VerlPolicyLoss`` with verl's keys and batch fields
  (helpers/golden_verl_sc.py), d loss / d logits (cast to the dtype), checked against verl's loss, gradient and metrics
  except on the -inf-slot cases, which the plugin reads differently (docs/verl.md; compared with the same call on CPU);
  the case the plugin refuses (score centering with a rejection rule) is left out like an error case.
- slime (suite slime, parts ``policy/`` and ``tis/``; slime's outputs are top-level entries of the case): the full
  loss ``SlimePolicyLoss`` through slime's ``loss_function`` (tests/adapters/slime_host.py; ``logits`` and the batch's
  log-probs cast to the dtype), checked against slime's loss, logit gradient and metrics; the TIS function
  ``SlimeISCorrection`` on the stored inputs, checked against slime's ``pg_loss``, masks and per-token metrics, as
  tests/adapters/test_slime_golden.py does on the CPU.

A suite is a directory holding ``case_*.pt`` files, at any depth (``slime/policy``). Cases whose expected result is an
error are left out (they raise before any tensor exists). A case of an unknown format raises
:class:`UnknownGoldenFormat`: a new suite must be taught here, not silently skipped.
"""

from __future__ import annotations

import functools

from helpers.golden_ctpo import ctpo_config, ctpo_inputs
from helpers.golden_outcome import PluginCall
from helpers.golden_runners import (
    compute_runner,
    ctpo_check,
    nemo_rl_check,
    nemo_rl_runner,
    objective_check,
    objective_runner,
    slime_policy_check,
    slime_policy_runner,
    slime_tis_check,
    slime_tis_runner,
    verl_sc_check,
    verl_sc_runner,
)
from helpers.golden_utils import GOLDEN, load_named_cases
from helpers.golden_verl import loss_inputs, plugin_keys
from helpers.golden_verl_sc import neg_inf_slots, plugin_refuses


class UnknownGoldenFormat(ValueError):
    """A golden case this driver cannot map to plugin calls."""


def suites() -> list[str]:
    """Every directory under tests/data/golden, at any depth, that holds cases (``ctpo``, ``slime/policy``)."""
    return sorted({p.parent.relative_to(GOLDEN).as_posix() for p in GOLDEN.rglob("case_*.pt")})


@functools.cache
def load_suite(suite: str) -> list[dict]:
    """The suite's cases, :func:`load_named_cases` loaded once per session (treat them as read-only)."""
    return load_named_cases(suite)


def golden_calls(suite_names: tuple[str, ...] | None = None) -> list[PluginCall]:
    """The plugin calls of every non-error case of the given suites (default: all of them)."""
    return list(_golden_calls(tuple(suite_names or suites())))


@functools.cache
def _golden_calls(suite_names: tuple[str, ...]) -> tuple[PluginCall, ...]:
    return tuple(
        call for s in suite_names for case in load_suite(s) if not raises(case) for call in plugin_calls(s, case)
    )


def raises(case: dict) -> bool:
    """Whether the case's expected result is an error (slime's cases, outputs at the top, have none), or a verl
    score-centering case the plugin refuses (it raises before any tensor exists, as an error case does)."""
    if "rollout_correction" in case.get("params", {}):
        return "error" in case["expected"] or plugin_refuses(case)
    return "error" in case.get("expected", {})


def case_format(case: dict) -> str:
    if "config" in case and "next_token_logprobs" in case.get("inputs", {}):
        return "nemo_rl"
    if "logits" in case and "batch" in case:
        return "slime_policy"
    if "function" in case and "pg_loss" in case.get("inputs", {}):
        return "slime_tis"
    params = case.get("params", {})
    if "rollout_correction" in params and "rollout_topk_ids" in case.get("inputs", {}):
        return "verl_score_centering"
    if "loss_mode" in params:
        return "ctpo"
    if "rollout_is" in params:
        return "verl_rollout_corr"
    if "mode" in case and "loss_agg_mode" in case:
        return "verl_loss_modes"
    raise UnknownGoldenFormat(
        f"golden case {case.get('id')!r} ({sorted(case)}) has no known format: teach helpers/golden_calls.py to map "
        "it to plugin calls"
    )


def plugin_calls(suite: str, case: dict) -> list[PluginCall]:
    fmt = case_format(case)
    if fmt == "nemo_rl":
        return [PluginCall(suite, case["id"], nemo_rl_runner(case), nemo_rl_check(case), fmt)]
    if fmt == "slime_policy":
        return [PluginCall(suite, case["id"], slime_policy_runner(case), slime_policy_check(case), fmt)]
    if fmt == "slime_tis":
        return [PluginCall(suite, case["id"], slime_tis_runner(case), slime_tis_check(case), fmt)]
    if fmt == "ctpo":
        inputs, _ = ctpo_inputs(case)
        return [
            PluginCall(suite, case["id"], compute_runner(ctpo_config(case["params"]), inputs), ctpo_check(case), fmt)
        ]
    if fmt == "verl_loss_modes":
        return [PluginCall(suite, case["id"], objective_runner(case), objective_check(case), fmt)]
    if fmt == "verl_score_centering":
        check = None if neg_inf_slots(case) else verl_sc_check(case)
        return [PluginCall(suite, case["id"], verl_sc_runner(case), check, fmt)]
    # verl's call through the project's own mapping of algorithm.rollout_correction (weights, rejections, metrics)
    configs = {"mapping": plugin_keys(case["params"])}
    inputs, _ = loss_inputs(case)
    return [
        PluginCall(suite, f"{case['id']}/{name}", compute_runner(cfg, inputs), None, fmt)
        for name, cfg in configs.items()
    ]
