"""The verl score-centering golden cases (tests/data/golden/verl_score_centering) as verl adapter calls, shared by
tests/test_golden_verl_score_centering.py and the device-guard / CUDA drivers (helpers/golden_calls.py)."""

from __future__ import annotations

import torch

from nemo_is_plugin.adapters.verl import VerlPolicyLoss
from nemo_is_plugin.adapters.verl.metrics import verl_step_name
from nemo_is_plugin.loss.score_centering import label_and_head_logprobs

RTOL, ATOL = 1e-5, 1e-6  # the suite README's tolerances
# verl's actor defaults the adapter reads (bypass REINFORCE uses none of the clip ratios)
ACTOR = {
    "clip_ratio": 0.2,
    "clip_ratio_low": 0.2,
    "clip_ratio_high": 0.2,
    "clip_ratio_c": 3.0,
    "loss_scale_factor": None,
}


def actor_config(params: dict) -> dict:
    """verl's actor config of a case: its ``global_batch_info``, its ``rollout_correction`` (verl's keys) in the
    plugin's section ``policy_loss.nemo_is``."""
    return {
        **ACTOR,
        "global_batch_info": dict(params["global_batch_info"]),
        "policy_loss": {"nemo_is": {"rollout_correction": dict(params["rollout_correction"])}},
    }


def plugin_refuses(case: dict) -> bool:
    """The valid verl case the plugin refuses: score centering with a rejection rule (docs/verl.md)."""
    return "error" not in case["expected"] and bool(case["params"]["rollout_correction"]["rollout_rs"])


def neg_inf_slots(case: dict) -> bool:
    """A case with -inf head slots, which the plugin reads differently from verl (docs/verl.md)."""
    return bool(case["params"]["generator"].get("neg_inf_slots"))


def adapter_call(
    case: dict,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    head_log_probs: torch.Tensor | None = None,
):
    """(loss, d loss / d logits, metrics) of ``VerlPolicyLoss`` on a case, as verl would call it in bypass mode:
    verl's key names and batch fields, the trainer's label and head log-probs from one log-softmax of the logits (cast
    to ``dtype``). ``head_log_probs`` replaces the sampler's recorded head log-probs."""
    params, inputs = case["params"], {k: v.to(device) for k, v in case["inputs"].items()}
    logits = inputs["logits"].to(dtype or inputs["logits"].dtype).requires_grad_(True)
    label, head = label_and_head_logprobs(logits, inputs["responses"], inputs["rollout_topk_ids"])
    sampler = inputs["rollout_topk_log_probs"] if head_log_probs is None else head_log_probs.to(device)
    loss, metrics = VerlPolicyLoss()(
        inputs["rollout_log_probs"].to(label.dtype),  # bypass mode: verl's old_log_prob is the rollout's
        label,
        inputs["advantages"],
        inputs["response_mask"],
        params["loss_agg_mode"],
        actor_config(params),
        rollout_topk_ids=inputs["rollout_topk_ids"],
        rollout_topk_log_probs=sampler,
        topk_log_probs=head,
    )
    (grad,) = torch.autograd.grad(loss, logits)
    return loss.detach(), grad, metrics


def verl_metrics(case: dict) -> dict[str, float]:
    """Every metric verl reports for the case, by its name (``actor/pg_loss`` is the loss)."""
    expected = case["expected"]
    return {**expected["metrics"], **expected["ppo_loss_metrics"]}


def assert_like_verl(case: dict, loss: torch.Tensor, grad: torch.Tensor, metrics: dict, rtol=RTOL, atol=ATOL) -> None:
    """The adapter's loss, logit gradient and every verl metric within the suite's tolerance of verl's."""
    expected = case["expected"]
    torch.testing.assert_close(loss.float().cpu(), expected["loss"], rtol=rtol, atol=atol)
    torch.testing.assert_close(grad.float().cpu(), expected["grad_logits"], rtol=rtol, atol=atol)
    got = {**metrics, "actor/pg_loss": float(loss)}
    for verl_name, want in verl_metrics(case).items():
        name = verl_step_name(verl_name)  # a rollout_corr/ extremum: named for verl's mean over micro-batches
        assert name in got, f"{case['id']}: verl's metric {verl_name} missing (as {name})"
        assert abs(got[name] - want) <= atol + rtol * abs(want), (case["id"], name, got[name], want)
