"""A small model of the NeMo-RL side of the loss interface (commit 7ea279ab), for tests: NeMo-RL cannot be installed.

Written from NeMo-RL's documented behaviour, not from its code:

- :class:`HostLossConfig`: NeMo-RL's ``ClippedPGLossConfig``, a pydantic model with ``extra="allow"`` holding NeMo-RL's
  keys and defaults and no cross-field checks (NeMo-RL checks combinations in the loss constructor);
- :func:`prepare_loss_input`: what NeMo-RL's ``prepare_loss_input`` hands a LOGPROB loss: ``next_token_logprobs``
  ``[B, S-1]`` from ``[B, S, V]`` logits (log-softmax in float32 at ``input_ids[:, 1:]``); with top-k filtering the
  filtered log-probs (``-inf`` outside the top-k set, then set to 0 where ``-inf`` or masked) plus, when
  ``loss_fn.reference_policy_kl_penalty != 0``, ``data["curr_logprobs_unfiltered"]``; with
  ``loss_fn.use_fused_linear_logprobs`` the model output already holds ``[B, >= S-1]`` log-probs, cast to float32 and
  cut to ``S-1``;
- :func:`logits_for`: logits whose log-softmax at the target tokens equals given log-probs;
- NeMo-RL's unit-test batches (:func:`host_batch`, :func:`filled`), the call its tests make (:func:`run`) and their
  hand formulas (:func:`clip_loss`, :func:`k3`).
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from nemo_is_plugin.adapters.nemo_rl.protocol import LossInputType


class HostLossConfig(BaseModel):
    """NeMo-RL's loss_fn config model: its keys and defaults, extra keys allowed, no combination checks."""

    model_config = ConfigDict(extra="allow")

    disable_ppo_ratio: bool = False
    token_level_loss: bool = True
    sequence_level_importance_ratios: bool = False
    ratio_clip_min: float = 0.2
    ratio_clip_max: float = 0.2
    ratio_clip_c: float | None = None
    reference_policy_kl_penalty: float = 0.01
    reference_policy_kl_type: str = "k3"
    kl_input_clamp_value: float | None = 20.0
    kl_output_clamp_value: float | None = 10.0
    use_kl_in_reward: bool = False
    use_importance_sampling_correction: bool = False
    truncated_importance_sampling_type: str | None = None
    truncated_importance_sampling_ratio: float | None = None
    truncated_importance_sampling_ratio_min: float | None = None
    use_on_policy_kl_approximation: bool = False
    force_on_policy_ratio: bool = False
    use_cispo: bool = False
    positive_example_nll_weight: float = 0.0


def _gather_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return lp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def prepare_loss_input(
    logits: torch.Tensor, data: dict[str, Any], loss_fn: Any, top_k: int | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(loss_input, data)`` as NeMo-RL's ``prepare_loss_input`` builds them for a LOGPROB loss."""
    assert loss_fn.input_type == LossInputType.LOGPROB, "this model covers the LOGPROB branch only"
    seq_len = data["input_ids"].shape[1]
    if getattr(loss_fn, "use_fused_linear_logprobs", False):
        return {"next_token_logprobs": logits.to(torch.float32)[:, : seq_len - 1]}, data
    if top_k is None:
        return {"next_token_logprobs": _gather_logprobs(logits, data["input_ids"])}, data
    kth = logits.topk(top_k, dim=-1).values[..., -1:]
    filtered = _gather_logprobs(logits.masked_fill(logits < kth, float("-inf")), data["input_ids"])
    mask = (data["token_mask"] * data["sample_mask"].unsqueeze(-1))[:, 1:]
    keep = (mask != 0) & torch.isfinite(filtered)
    filtered = torch.where(keep, filtered, torch.zeros_like(filtered))
    if getattr(loss_fn, "reference_policy_kl_penalty", 0) != 0:
        data = dict(data, curr_logprobs_unfiltered=_gather_logprobs(logits, data["input_ids"]))
    return {"next_token_logprobs": filtered}, data


def logits_for(target_logprobs: torch.Tensor, input_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[B, S, V]`` logits whose log-softmax at ``input_ids[:, 1:]`` is ``target_logprobs [B, S-1]`` (<= 0).

    The target token gets logit 0 and one other token log(e^{-lp} - 1), so that the partition function is e^{-lp};
    every other token sits at -1e4 (weight 0 in float32).
    """
    b, s = input_ids.shape
    logits = torch.full((b, s, vocab), -1e4, dtype=torch.float64)
    for i in range(b):
        for t in range(s - 1):
            tok = int(input_ids[i, t + 1])
            lp = float(target_logprobs[i, t])
            logits[i, t, tok] = 0.0
            if lp < 0:
                logits[i, t, (tok + 1) % vocab] = torch.log(torch.expm1(torch.tensor(-lp, dtype=torch.float64)))
    return logits.float()


# ----------------------------------------------------------------------------------- NeMo-RL's unit-test batches
V = 8


def host_batch(batch: int = 1, seq: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """NeMo-RL's test batch layout: int64 masks with token 0 masked, zero-filled float tensors to overwrite."""
    g = torch.Generator().manual_seed(seed)
    tm = torch.ones(batch, seq, dtype=torch.int64)
    tm[:, 0] = 0
    zeros = lambda: torch.zeros(batch, seq)  # noqa: E731
    return {
        "input_ids": torch.randint(0, V, (batch, seq), generator=g),
        "token_mask": tm,
        "sample_mask": torch.ones(batch, dtype=torch.int64),
        "advantages": zeros(),
        "prev_logprobs": zeros(),
        "reference_policy_logprobs": zeros(),
        "generation_logprobs": zeros(),
    }


def run(loss_fn, data, curr=None, logits=None, **kw):
    """prepare_loss_input from exact logits for ``curr`` [B, S-1], then the call as NeMo-RL's tests make it."""
    logits = logits_for(curr, data["input_ids"], V) if logits is None else logits
    loss_input, data = prepare_loss_input(logits, data, loss_fn, **kw)
    return loss_fn(
        data=data,
        global_valid_seqs=torch.sum(data["sample_mask"]),
        global_valid_toks=torch.sum(data["sample_mask"].unsqueeze(-1) * data["token_mask"]),
        **loss_input,
    )


def clip_loss(adv, curr, prev, lo=0.2, hi=0.2):
    r = torch.exp(curr - prev)
    return torch.maximum(-adv * r, -adv * r.clamp(1 - lo, 1 + hi))


ADV = torch.tensor([[2.0, -1.0, 1.0]])
PREV = torch.tensor([[-1.2, -1.2, -1.2]])
CURR = PREV + torch.log(torch.tensor([[0.6, 1.1, 1.4]]))  # one ratio below, one inside, one above the band


def filled(data=None, adv=ADV, prev=PREV, gen=None, ref=None):
    data = host_batch() if data is None else data
    data["advantages"][:, 1:] = adv
    data["prev_logprobs"][:, 1:] = prev
    if gen is not None:
        data["generation_logprobs"][:, 1:] = gen
    if ref is not None:
        data["reference_policy_logprobs"][:, 1:] = ref
    return data


def k3(c, ref):
    logr = ref - c
    return torch.exp(logr) - 1 - logr
