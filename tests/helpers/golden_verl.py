"""The verl rollout-correction golden cases as plugin calls: the plugin config of a verl call (through the project's
mapping) and the loss inputs at ratio 1 whose gradient is the applied weight (tests/test_golden_verl.py's docstring)."""

from __future__ import annotations

import warnings

import torch

from nemo_is_plugin.adapters.verl.config import ROLLOUT_CORRECTION_KEYS, rollout_correction_keys
from nemo_is_plugin.loss.clipped_pg import LossInputs
from nemo_is_plugin.loss.layout import TokenLayout


def plugin_keys(params: dict) -> dict:
    """The plugin config of a verl call, through the project's mapping (verl's ignored keys warn, as verl ignores)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        keys = rollout_correction_keys({k: params[k] for k in ROLLOUT_CORRECTION_KEYS if k in params})
    return {"reference_policy_kl_penalty": 0.0, **keys}


def loss_inputs(case: dict) -> tuple[LossInputs, TokenLayout]:
    inp = case["inputs"]
    p, g, m = inp["old_log_prob"], inp["rollout_log_prob"], inp["response_mask"]
    B, T = p.shape
    return LossInputs(
        curr_logprobs=p.clone().requires_grad_(True),
        prev_logprobs=p,
        generation_logprobs=g,
        reference_logprobs=None,
        advantages=torch.ones_like(p),
        token_mask=m,
        sample_mask=torch.ones(B),
        global_valid_seqs=float(B),
        global_valid_toks=float(m.sum()),
    ), TokenLayout.padded(B, T)
