"""The CTPO golden cases as plugin calls: the config and the inputs equivalent to one reference call (the mapping is
tests/test_golden_ctpo.py's docstring), and the loss tolerance of a case."""

from __future__ import annotations

import torch

from nemo_is_plugin.loss import LossInputs
from nemo_is_plugin.loss.layout import TokenLayout


def is_la(params: dict) -> bool:
    return params["loss_mode"].endswith("-la")


def ctpo_config(params: dict, power: float | None = None) -> dict:
    """The plugin config equivalent to one CTPO reference call (see module docstring)."""
    ref = params["config"]
    cfg = {
        "reference_policy_kl_penalty": 0.0,
        "ratio_level": "cumulative" if params["ratio_mode"] == "cumprod" else "cumulative_mean",
        "token_log_ratio_clamp": 20.0,
        "max_log_ratio": 10.0,
        "loss_aggregation": params["loss_agg_mode"],
    }
    if is_la(params):
        if power is None:
            power = 0.0 if params.get("p0_workaround") else ref["clip_ratio_la_power"]
        cfg.update(
            log_ratio_clip_low=ref["la_clip_low"],
            log_ratio_clip_high=ref["la_clip_high"],
            log_ratio_clip_c=ref["la_clip_c"],
            clip_position_power=power,
        )
    else:
        cfg.update(
            ratio_clip_min=ref["clip_ratio_low"],
            ratio_clip_max=ref["clip_ratio_high"],
            ratio_clip_c=ref["clip_ratio_c"],
        )
    if params["uses_rollout_is_weights"]:
        cfg.update(use_importance_sampling_correction=True, is_correction_level="token")
    return cfg


def ctpo_inputs(case: dict, dtype=torch.float32) -> tuple[LossInputs, TokenLayout]:
    inp = case["inputs"]
    old, lp = inp["old_log_prob"].to(dtype), inp["log_prob"].to(dtype)
    m = inp["response_mask"].to(dtype)
    w = inp["rollout_is_weights"]
    if w is not None:
        # g = old - log w on unmasked tokens, so that the plugin's token IS weight exp(p - g) is w.
        w = w.to(dtype)
        assert bool((w[m > 0] > 0).all()), "a zero IS weight on an unmasked token cannot be written as exp(p - g)"
        gen = torch.where(m > 0, old - torch.log(torch.where(m > 0, w, torch.ones_like(w))), old)
    else:
        gen = old.clone()
    B, T = old.shape
    has_tokens = (m.sum(-1) > 0).to(dtype)
    agg = case["params"]["loss_agg_mode"]
    sample_mask = torch.ones(B, dtype=dtype) if agg == "token-mean" else has_tokens
    inputs = LossInputs(
        curr_logprobs=lp.clone().requires_grad_(True),
        prev_logprobs=old,
        generation_logprobs=gen,
        reference_logprobs=None,
        advantages=inp["advantages"].to(dtype),
        token_mask=m,
        sample_mask=sample_mask,
        global_valid_seqs=float(sample_mask.sum()),
        global_valid_toks=float(m.sum()),
    )
    return inputs, TokenLayout.padded(B, T)


def loss_rtol(case: dict) -> float:
    # README: rtol 1e-5 for pg_loss / grad, 1e-4 for the T = 2048 cases (long float32 prefix sums).
    return 1e-4 if case["params"]["T"] >= 2048 else 1e-5
