"""The golden-case formats' runners and golden checks (helpers/golden_calls.py says which case is which format): a
runner builds a case's inputs on a device in a dtype and makes the plugin call inside a guard; a check asserts the
suite's golden values on the call's :class:`~helpers.golden_outcome.Outcome`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from adapters.slime_host import loss_function, namespace, tis_call

from helpers.golden_ctpo import loss_rtol
from helpers.golden_objectives import objective_loss
from helpers.golden_outcome import Outcome, Runner
from helpers.golden_utils import finite_grad, metric_close
from helpers.golden_verl_sc import adapter_call, assert_like_verl
from nemo_is_plugin import build_loss_fn
from nemo_is_plugin.adapters.slime import SlimeISCorrection, SlimePolicyLoss
from nemo_is_plugin.loss import LossInputs
from nemo_is_plugin.loss.layout import TokenLayout
from tools.golden import common, nemo_rl

# data keys that hold log-probs in a NeMo-RL call: cast to the dtype under test.
NEMO_RL_LOGPROB_KEYS = ("prev_logprobs", "generation_logprobs", "reference_policy_logprobs", "curr_logprobs_unfiltered")
# per-sample lists of log-probs in a slime batch or TIS call: cast to the dtype under test (as the logits).
SLIME_LOGPROB_KEYS = ("log_probs", "rollout_log_probs", "ref_log_probs", "train_log_probs")


def _grads(loss: torch.Tensor, leaves: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    names = list(leaves)
    if not loss.requires_grad:
        return {k: torch.zeros_like(leaves[k]) for k in names}
    grads = torch.autograd.grad(loss, [leaves[k] for k in names], allow_unused=True)
    return {k: torch.zeros_like(leaves[k]) if g is None else g for k, g in zip(names, grads)}


def nemo_rl_runner(case: dict) -> Runner:
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


def compute_runner(config: dict, cpu_inputs: LossInputs) -> Runner:
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


def objective_runner(case: dict) -> Runner:
    """verl's loss mode as the plugin's functions composed (helpers/golden_objectives.py): not a config call yet."""

    def run(device, dtype, guard) -> Outcome:
        with guard():
            loss, grad, metrics = objective_loss(case, device, dtype)
        return Outcome(loss, {"curr_logprobs": grad}, {k: float(v) for k, v in metrics.items()})

    return run


def verl_sc_runner(case: dict) -> Runner:
    """The verl adapter on a verl score-centering case (helpers/golden_verl_sc.py), logits cast to the dtype."""

    def run(device, dtype, guard) -> Outcome:
        with guard():
            loss, grad, metrics = adapter_call(case, device, dtype)
        return Outcome(loss, {"logits": grad}, {k: float(v) for k, v in metrics.items()})

    return run


def verl_sc_check(case: dict) -> Callable[[Outcome], None]:
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


def slime_policy_runner(case: dict) -> Runner:
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


def slime_tis_runner(case: dict) -> Runner:
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
def nemo_rl_check(case: dict) -> Callable[[Outcome], None]:
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


def ctpo_check(case: dict) -> Callable[[Outcome], None]:
    def check(out: Outcome) -> None:
        want, rtol = case["expected"], loss_rtol(case)
        torch.testing.assert_close(out.loss.float(), want["pg_loss"].float(), rtol=rtol, atol=1e-6)
        torch.testing.assert_close(
            out.grads["curr_logprobs"].float(), want["grad_log_prob"].float(), rtol=rtol, atol=1e-6
        )

    return check


def objective_check(case: dict) -> Callable[[Outcome], None]:
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


def slime_policy_check(case: dict) -> Callable[[Outcome], None]:
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


def slime_tis_check(case: dict) -> Callable[[Outcome], None]:
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
