"""The loss's inputs aligned with one TokenLayout (:class:`LossInputs`), and a NeMo-RL call's arguments validated and
aligned into them (:func:`align_nemo_rl_inputs`: ``[B, S]`` data -> ``[B, S-1]`` token tensors)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
from nemo_is_plugin.loss.input_validation import loss_input_checks
from nemo_is_plugin.loss.input_values import POSITIVE_LOGPROB_TOLERANCE, PendingInputChecks
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.score_centering import ScoreCenteringHead, check_head_shapes, head_value_checks

# NeMo-RL's data keys; [B, S] tensors are sliced [:, 1:] to align with next-token log-probs [B, S-1].
TOKEN_KEYS = ("token_mask", "advantages", "prev_logprobs", "generation_logprobs", "reference_policy_logprobs")
# Score centering's head under NeMo-RL's data keys (read here and by the distributed entry points, nowhere else): the
# sampler's head ids and log-probs, [B, S, k] tensors sliced [:, 1:] like generation_logprobs (the head of the token at
# position s is recorded where its log-prob is), and the trainer's log-probs at those ids, [B, S-1, k], aligned like
# next_token_logprobs (not sliced). In the package they are ScoreCenteringHead's head_ids / sampler_head / trainer_head.
HEAD_KEYS = ("rollout_topk_ids", "rollout_topk_logprobs")
TRAINER_HEAD_KEY = "curr_topk_logprobs"


@dataclass
class LossInputs:
    """Token tensors aligned with one TokenLayout (shape *T), plus per-sequence tensors [S] and global counts.

    curr_logprobs requires grad; prev / generation / reference log-probs are treated as constants.
    """

    curr_logprobs: torch.Tensor
    prev_logprobs: torch.Tensor | None
    generation_logprobs: torch.Tensor
    reference_logprobs: torch.Tensor | None
    advantages: torch.Tensor
    token_mask: torch.Tensor
    sample_mask: torch.Tensor
    global_valid_seqs: torch.Tensor | float
    global_valid_toks: torch.Tensor | float
    rewards: torch.Tensor | None = None
    # NeMo-RL's current log-probs without top-k / top-p filtering (same shape as curr_logprobs, requires grad): the
    # KL penalty and its weight use them when present.
    curr_logprobs_unfiltered: torch.Tensor | None = None
    # Score centering (``score_centering: true``): the sampler's top-k head of each token and the trainer's log-probs
    # at it, [*T, k] each (its trainer_head requires grad, from the same log-softmax as curr_logprobs).
    head: ScoreCenteringHead | None = None

    @classmethod
    def from_tokens(
        cls,
        curr_logprobs: torch.Tensor,
        tokens: Mapping[str, torch.Tensor],
        data: Mapping[str, torch.Tensor],
        global_valid_seqs: torch.Tensor | float,
        global_valid_toks: torch.Tensor | float,
    ) -> LossInputs:
        """Build from token tensors under NeMo-RL's keys (``tokens``, already aligned with ``curr_logprobs``, optionally
        ``curr_logprobs_unfiltered`` and score centering's head under :data:`HEAD_KEYS` / :data:`TRAINER_HEAD_KEY`)
        and the per-sequence entries of ``data`` (``sample_mask``, optional ``rewards``)."""
        return cls(
            curr_logprobs=curr_logprobs,
            prev_logprobs=tokens.get("prev_logprobs"),
            generation_logprobs=tokens["generation_logprobs"],
            reference_logprobs=tokens.get("reference_policy_logprobs"),
            advantages=tokens["advantages"],
            token_mask=tokens["token_mask"],
            sample_mask=data["sample_mask"],
            global_valid_seqs=global_valid_seqs,
            global_valid_toks=global_valid_toks,
            rewards=data.get("rewards"),
            curr_logprobs_unfiltered=tokens.get("curr_logprobs_unfiltered"),
            head=nemo_rl_head(tokens),
        )


def nemo_rl_head(tokens: Mapping[str, torch.Tensor]) -> ScoreCenteringHead | None:
    """Score centering's head under NeMo-RL's keys (already aligned); None without the sampler's log-probs."""
    sampler_head = tokens.get(HEAD_KEYS[1])
    if sampler_head is None:
        return None
    return ScoreCenteringHead(tokens.get(HEAD_KEYS[0]), sampler_head, tokens.get(TRAINER_HEAD_KEY))


def align_nemo_rl_inputs(
    cfg: ClippedPGLossConfig,
    next_token_logprobs: torch.Tensor,
    data: Mapping[str, torch.Tensor],
    global_valid_seqs: torch.Tensor | float,
    global_valid_toks: torch.Tensor | float,
    layout: TokenLayout | None = None,
) -> tuple[LossInputs, TokenLayout]:
    """Validate a NeMo-RL call's arguments for ``cfg`` and align them: ``[B, S]`` data -> ``[B, S-1]`` token tensors
    (``layout`` None: the padded layout of ``next_token_logprobs``)."""
    inputs, layout, pending = align_nemo_rl_inputs_unread(
        cfg, next_token_logprobs, data, global_valid_seqs, global_valid_toks, layout
    )
    pending.run()  # the one host read of the inputs' values
    return inputs, layout


def align_nemo_rl_inputs_unread(
    cfg: ClippedPGLossConfig,
    next_token_logprobs: torch.Tensor,
    data: Mapping[str, torch.Tensor],
    global_valid_seqs: torch.Tensor | float,
    global_valid_toks: torch.Tensor | float,
    layout: TokenLayout | None = None,
) -> tuple[LossInputs, TokenLayout, PendingInputChecks]:
    """:func:`align_nemo_rl_inputs` with the inputs' value checks returned unread (shapes, dtypes and keys checked):
    the compiled epilogue (``loss/compiled.py``) reads them with the metrics, in the call's one host read."""
    pending = loss_input_checks(
        next_token_logprobs,
        data,
        global_valid_seqs,
        global_valid_toks,
        num_seqs=None if layout is None else layout.num_seqs,
        needs_prev=not cfg.objective.pi_old_is_current and not cfg.bypasses_prev,
        needs_generation=True,
        needs_reference=cfg.effective_kl_penalty != 0,
        needs_rewards=cfg.positive_example_nll_weight > 0,
        strict=cfg.strict_input_checks,
        generation_is_old_policy=cfg.bypasses_prev,
    )
    sliced = {k: data[k][:, 1:] for k in TOKEN_KEYS if k in data}
    if "curr_logprobs_unfiltered" in data and cfg.effective_kl_penalty != 0:  # NeMo-RL reads it only then
        sliced["curr_logprobs_unfiltered"] = data["curr_logprobs_unfiltered"]  # already [B, S-1]
    curr = next_token_logprobs
    if layout is None:
        layout = TokenLayout.padded(curr.shape[0], curr.shape[1], device=curr.device)
    if cfg.score_centering:
        head = {k: data[k][:, 1:] if k in data else None for k in HEAD_KEYS}
        head[TRAINER_HEAD_KEY] = data.get(TRAINER_HEAD_KEY)  # already [B, S-1, k]
        check_head_shapes(
            tuple(next_token_logprobs.shape),
            cfg.score_centering_top_k,
            head[HEAD_KEYS[0]],
            head[HEAD_KEYS[1]],
            head[TRAINER_HEAD_KEY],
            names=(f"data['{HEAD_KEYS[0]}']", f"data['{HEAD_KEYS[1]}']", f"data['{TRAINER_HEAD_KEY}']"),
            hint=f" (the rollout_topk_* data are [B, S, k], sliced [:, 1:]; {TRAINER_HEAD_KEY} is [B, S-1, k])",
        )
        sliced.update({k: v for k, v in head.items() if v is not None})
        counted = (sliced["token_mask"] != 0) & (layout.to_tokens(data["sample_mask"]) != 0)
        sampler_head, trainer_head = sliced[HEAD_KEYS[1]], sliced[TRAINER_HEAD_KEY]
        names = (f"data['{HEAD_KEYS[1]}']", f"data['{TRAINER_HEAD_KEY}']")
        tolerance = POSITIVE_LOGPROB_TOLERANCE.get(sampler_head.dtype, 1e-4)
        # read with the inputs' own checks: score centering adds no host read
        pending.add(head_value_checks(counted, sampler_head, trainer_head, names, tolerance))
    return LossInputs.from_tokens(curr, sliced, data, global_valid_seqs, global_valid_toks), layout, pending
