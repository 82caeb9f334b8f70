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

import contextlib
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass, field, replace

import torch
from adapters.slime_host import loss_function, namespace, tis_call

from helpers.golden_ctpo import ctpo_config, ctpo_inputs, loss_rtol
from helpers.golden_objectives import objective_loss
from helpers.golden_utils import GOLDEN, finite_grad, load_named_cases, metric_close
from helpers.golden_verl import loss_inputs, plugin_keys
from helpers.golden_verl_sc import adapter_call, assert_like_verl, neg_inf_slots, plugin_refuses
from nemo_is_plugin import build_loss_fn
from nemo_is_plugin.adapters.slime import SlimeISCorrection, SlimePolicyLoss
from nemo_is_plugin.loss import LossInputs
from nemo_is_plugin.loss.layout import TokenLayout
from tools.golden import common, nemo_rl

# data keys that hold log-probs in a NeMo-RL call: cast to the dtype under test.
NEMO_RL_LOGPROB_KEYS = ("prev_logprobs", "generation_logprobs", "reference_policy_logprobs", "curr_logprobs_unfiltered")
# per-sample lists of log-probs in a slime batch or TIS call: cast to the dtype under test (as the logits).
SLIME_LOGPROB_KEYS = ("log_probs", "rollout_log_probs", "ref_log_probs", "train_log_probs")


class UnknownGoldenFormat(ValueError):
    """A golden case this driver cannot map to plugin calls."""


@dataclass
class Outcome:
    """A loss call's results: the loss, d loss / d each differentiable input (zeros when unused), the metrics, and any
    further tensors the call returns (a slime TIS function's masks and per-token metrics; its ``loss`` is the
    per-token ``pg_loss``)."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    metrics: dict[str, float]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    device: str = ""  # the device type the call ran on (kept by ``cpu()``): some golden tolerances depend on it

    def __post_init__(self) -> None:
        self.device = self.device or self.loss.device.type

    def cpu(self) -> Outcome:
        return Outcome(
            self.loss.detach().cpu(),
            {k: g.cpu() for k, g in self.grads.items()},
            dict(self.metrics),
            {k: t.detach().cpu() for k, t in self.tensors.items()},
            self.device,
        )


Runner = Callable[[torch.device | str, torch.dtype | None, Callable[[], ContextManager]], Outcome]


@dataclass
class PluginCall:
    """One plugin call made from a golden case.

    ``run(device, dtype, guard)`` builds the inputs on ``device`` (log-prob tensors cast to ``dtype`` when given),
    then builds the loss, calls it and differentiates it inside ``guard()``. ``check_golden(outcome)`` asserts the
    golden values (None when the suite's golden values are not a loss call's outputs).
    """

    suite: str
    label: str
    run: Runner
    check_golden: Callable[[Outcome], None] | None = None
    fmt: str = "nemo_rl"  # the case format (case_format): "nemo_rl" calls go through ClippedPGLoss.__call__

    @property
    def id(self) -> str:
        return f"{self.suite}/{self.label}"


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
        return [PluginCall(suite, case["id"], _nemo_rl_runner(case), _nemo_rl_check(case), fmt)]
    if fmt == "slime_policy":
        return [PluginCall(suite, case["id"], _slime_policy_runner(case), _slime_policy_check(case), fmt)]
    if fmt == "slime_tis":
        return [PluginCall(suite, case["id"], _slime_tis_runner(case), _slime_tis_check(case), fmt)]
    if fmt == "ctpo":
        inputs, _ = ctpo_inputs(case)
        return [
            PluginCall(suite, case["id"], _compute_runner(ctpo_config(case["params"]), inputs), _ctpo_check(case), fmt)
        ]
    if fmt == "verl_loss_modes":
        return [PluginCall(suite, case["id"], _objective_runner(case), _objective_check(case), fmt)]
    if fmt == "verl_score_centering":
        check = None if neg_inf_slots(case) else _verl_sc_check(case)
        return [PluginCall(suite, case["id"], _verl_sc_runner(case), check, fmt)]
    # verl's call through the project's own mapping of algorithm.rollout_correction (weights, rejections, metrics)
    configs = {"mapping": plugin_keys(case["params"])}
    inputs, _ = loss_inputs(case)
    return [
        PluginCall(suite, f"{case['id']}/{name}", _compute_runner(cfg, inputs), None, fmt)
        for name, cfg in configs.items()
    ]


# ---------------------------------------------------------------------------------------------------- runners
def _grads(loss: torch.Tensor, leaves: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    names = list(leaves)
    if not loss.requires_grad:
        return {k: torch.zeros_like(leaves[k]) for k in names}
    grads = torch.autograd.grad(loss, [leaves[k] for k in names], allow_unused=True)
    return {k: torch.zeros_like(leaves[k]) if g is None else g for k, g in zip(names, grads)}


def _nemo_rl_runner(case: dict) -> Runner:
    def run(device, dtype, guard) -> Outcome:
        inp = case["inputs"]

        def cast(key: str, t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype if dtype is not None and key in NEMO_RL_LOGPROB_KEYS else t.dtype)

        x = inp["next_token_logprobs"].detach().to(device=device, dtype=dtype or inp["next_token_logprobs"].dtype)
        leaves = {"next_token_logprobs": x.requires_grad_(True)}
        data = {k: cast(k, v.detach()) for k, v in inp.items() if k != "next_token_logprobs"}
        for key in data:
            if f"grad_{key}" in case["expected"]:  # the golden call differentiated this input too
                leaves[key] = data[key].requires_grad_(True)
        n_seq, n_tok = (torch.as_tensor(case[k]).to(device) for k in ("global_valid_seqs", "global_valid_toks"))
        with guard():
            loss, metrics = build_loss_fn(case["config"])(
                next_token_logprobs=x, data=data, global_valid_seqs=n_seq, global_valid_toks=n_tok
            )
            grads = _grads(loss, leaves)
        return Outcome(loss.detach(), grads, metrics)

    return run


def _compute_runner(config: dict, cpu_inputs: LossInputs) -> Runner:
    """``build_loss_fn(config).compute`` on ``cpu_inputs`` moved to the device (log-probs cast to the dtype)."""

    def run(device, dtype, guard) -> Outcome:
        def move(t: torch.Tensor | None, logprob: bool) -> torch.Tensor | None:
            if t is None:
                return None
            return t.detach().to(device=device, dtype=dtype if logprob and dtype is not None else t.dtype)

        i = cpu_inputs
        inputs = replace(
            i,
            curr_logprobs=move(i.curr_logprobs, True).requires_grad_(True),
            prev_logprobs=move(i.prev_logprobs, True),
            generation_logprobs=move(i.generation_logprobs, True),
            reference_logprobs=move(i.reference_logprobs, True),
            advantages=move(i.advantages, False),
            token_mask=move(i.token_mask, False),
            sample_mask=move(i.sample_mask, False),
            rewards=move(i.rewards, False),
        )
        layout = TokenLayout.padded(*inputs.curr_logprobs.shape, device=device)
        with guard():
            loss, metrics = build_loss_fn(config).compute(inputs, layout)
            grads = _grads(loss, {"curr_logprobs": inputs.curr_logprobs})
        return Outcome(loss.detach(), grads, metrics)

    return run


def _objective_runner(case: dict) -> Runner:
    """verl's loss mode as the plugin's functions composed (helpers/golden_objectives.py): not a config call yet."""

    def run(device, dtype, guard) -> Outcome:
        with guard():
            loss, grad, metrics = objective_loss(case, device, dtype)
        return Outcome(loss, {"curr_logprobs": grad}, {k: float(v) for k, v in metrics.items()})

    return run


def _verl_sc_runner(case: dict) -> Runner:
    """The verl adapter on a verl score-centering case (helpers/golden_verl_sc.py), logits cast to the dtype."""

    def run(device, dtype, guard) -> Outcome:
        with guard():
            loss, grad, metrics = adapter_call(case, device, dtype)
        return Outcome(loss, {"logits": grad}, {k: float(v) for k, v in metrics.items()})

    return run


def _verl_sc_check(case: dict) -> Callable[[Outcome], None]:
    def check(out: Outcome) -> None:
        assert_like_verl(case, out.loss, out.grads["logits"], out.metrics)

    return check


def _slime_values(values: dict, device, dtype) -> dict:
    """A slime batch / TIS call's entries on ``device``: tensors (and lists of them) moved, log-probs cast to
    ``dtype``."""

    def move(key: str, t):
        if not isinstance(t, torch.Tensor):
            return t
        return t.detach().to(device=device, dtype=dtype if dtype is not None and key in SLIME_LOGPROB_KEYS else t.dtype)

    return {k: [move(k, t) for t in v] if isinstance(v, list) else move(k, v) for k, v in values.items()}


def _slime_policy_runner(case: dict) -> Runner:
    """The adapter's full loss as slime calls it (``loss_function``, one rank), no plugin keys: slime's policy loss."""

    def run(device, dtype, guard) -> Outcome:
        batch = _slime_values(case["batch"], device, dtype)
        x = case["logits"].detach().to(device=device, dtype=dtype or case["logits"].dtype).requires_grad_(True)
        with guard():
            scaled, _, metrics = loss_function(
                SlimePolicyLoss(),
                namespace(case["args"]),
                batch,
                x,
                num_microbatches=case["num_microbatches"],
                step_global_batch_size=case["step_global_batch_size"],
            )
            grads = _grads(scaled, {"logits": x})
        return Outcome(scaled.detach(), grads, {k: float(v) for k, v in metrics.items()})

    return run


def _slime_tis_runner(case: dict) -> Runner:
    """The adapter's TIS function on the stored call (IcePop's keys for ``icepop_function``): slime's TIS function.
    Its per-token ``pg_loss`` is the outcome's loss; masks and per-token metrics are its tensors."""
    keys = {"truncated_importance_sampling_type": "icepop"} if case["function"] == "icepop_function" else {}

    def run(device, dtype, guard) -> Outcome:
        inputs = _slime_values(case["inputs"], device, dtype)
        with guard():
            pg_loss, masks, metrics = tis_call(SlimeISCorrection(), namespace(case["args"], nemo_is=keys), inputs)
        tensors = {**{f"masks/{i}": m for i, m in enumerate(masks)}, **{f"metrics/{k}": v for k, v in metrics.items()}}
        return Outcome(pg_loss.detach(), {}, {}, tensors)

    return run


# ---------------------------------------------------------------------------------------------------- golden checks
def _nemo_rl_check(case: dict) -> Callable[[Outcome], None]:
    def check(out: Outcome) -> None:
        want = case["expected"]
        rtol, atol = nemo_rl.tolerance(case, ("loss",))  # the suites' tolerance of the loss and the gradients
        torch.testing.assert_close(out.loss.float(), want["loss"].float(), rtol=rtol, atol=atol)
        for key, grad in out.grads.items():
            torch.testing.assert_close(
                grad.float(),
                finite_grad(want[f"grad_{key}"]).float(),
                rtol=rtol,
                atol=atol,
                msg=lambda m, key=key: f"d loss / d {key}: {m}",
            )
        bad = {
            k: (out.metrics.get(k), v)
            for k, v in want["metrics"].items()
            if k not in out.metrics or not metric_close(k, out.metrics[k], v)
        }
        assert not bad, f"metric mismatches (got, want): {bad}"

    return check


def _ctpo_check(case: dict) -> Callable[[Outcome], None]:
    def check(out: Outcome) -> None:
        want, rtol = case["expected"], loss_rtol(case)
        torch.testing.assert_close(out.loss.float(), want["pg_loss"].float(), rtol=rtol, atol=1e-6)
        torch.testing.assert_close(
            out.grads["curr_logprobs"].float(), want["grad_log_prob"].float(), rtol=rtol, atol=1e-6
        )

    return check


def _objective_check(case: dict) -> Callable[[Outcome], None]:
    def check(out: Outcome) -> None:
        want = case["expected"]
        torch.testing.assert_close(out.loss.float(), want["loss"].float(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.grads["curr_logprobs"].float(), want["grad_log_prob"], rtol=1e-5, atol=1e-7)
        assert out.metrics.keys() == want["metrics"].keys()
        bad = {
            k: (out.metrics[k], v) for k, v in want["metrics"].items() if abs(out.metrics[k] - v) > 1e-7 + 1e-5 * abs(v)
        }
        assert not bad, f"metric mismatches (got, want): {bad}"

    return check


def _slime_policy_check(case: dict) -> Callable[[Outcome], None]:
    """The suite README's tolerances: loss and metrics rtol 1e-5 / atol 1e-6, logit gradients rtol 1e-4 / atol 1e-6;
    every slime metric under its name, the plugin's own under ``nemo_is/``."""

    def check(out: Outcome) -> None:
        torch.testing.assert_close(out.loss.float(), case["loss"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.grads["logits"].float(), case["logits_grad"], rtol=1e-4, atol=1e-6)
        assert all(k.startswith("nemo_is/") for k in set(out.metrics) - set(case["metrics"])), set(out.metrics)
        bad = {
            k: (out.metrics.get(k), v)
            for k, v in case["metrics"].items()
            if k not in out.metrics or not common.close(out.metrics[k], v, (1e-5, 1e-6))
        }
        assert not bad, f"metric mismatches (got, want): {bad}"

    return check


# fp32 relative tolerance of the slime TIS outputs (exp of a log-ratio): the suite README's 1 ulp on the CPU, where the
# golden values were written; CUDA's expf is accurate to 2 ulp (CUDA C Programming Guide, "Mathematical Functions"),
# so a CUDA run may differ from the CPU's by up to 3 ulp (measured on an H100: 1.7e-7 relative, under 2 ulp).
SLIME_TIS_RTOL = {"cpu": 1.2e-7, "cuda": 3.6e-7}


def _slime_tis_check(case: dict) -> Callable[[Outcome], None]:
    """The suite README's tolerances: ``pg_loss`` and the per-token metrics to 1 ulp (3 on CUDA), the masks exactly."""

    def check(out: Outcome) -> None:
        rtol = SLIME_TIS_RTOL[out.device]
        torch.testing.assert_close(out.loss, case["pg_loss"], rtol=rtol, atol=0)
        for i, want in enumerate(case["masks"]):
            assert torch.equal(out.tensors[f"masks/{i}"], want), f"masks/{i}"
        for name, want in case["metrics"].items():
            # tis_abs = |w - 1| cancels: its error is the weight's, rtol relative to |w| <= tis_abs + 1
            atol = rtol if name == "tis_abs" else 0.0
            torch.testing.assert_close(out.tensors[f"metrics/{name}"], want, rtol=rtol, atol=atol, msg=name)

    return check


# ---------------------------------------------------------------------------------------------------- comparisons
def assert_same_outcome(
    got: Outcome,
    want: Outcome,
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
    grad_rtol: float | None = None,
    metric_rtol: float | None = None,
) -> None:
    """``got`` equals ``want`` (both moved to CPU) within the tolerances; NaN equals NaN, inf must match exactly."""
    got, want = got.cpu(), want.cpu()
    grad_rtol = rtol if grad_rtol is None else grad_rtol
    torch.testing.assert_close(got.loss, want.loss, rtol=rtol, atol=atol, equal_nan=True)
    assert got.grads.keys() == want.grads.keys()
    for key in want.grads:
        torch.testing.assert_close(
            got.grads[key],
            want.grads[key],
            rtol=grad_rtol,
            atol=atol,
            equal_nan=True,
            msg=lambda m, key=key: f"d loss / d {key}: {m}",
        )
    assert got.tensors.keys() == want.tensors.keys()
    for key in want.tensors:
        torch.testing.assert_close(
            got.tensors[key],
            want.tensors[key],
            rtol=rtol,
            atol=atol,
            equal_nan=True,
            msg=lambda m, key=key: f"{key}: {m}",
        )
    assert got.metrics.keys() == want.metrics.keys(), set(got.metrics) ^ set(want.metrics)
    m_rtol = rtol if metric_rtol is None else metric_rtol
    bad = {
        k: (got.metrics[k], v) for k, v in want.metrics.items() if not common.close(got.metrics[k], v, (m_rtol, atol))
    }
    assert not bad, f"metrics differ (got, want): {bad}"


def no_guard() -> ContextManager:
    return contextlib.nullcontext()
