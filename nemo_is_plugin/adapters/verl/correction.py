"""Who owns the rollout correction in a verl call, and the rollout log-probs log mu the plugin's loss then sees.

verl computes ``rollout_is_weights`` itself (``algorithm.rollout_correction``: token or sequence level, truncated,
optionally batch-normalised) and passes only those; the plugin computes its weights from the rollout log-probs. By who
owns the correction (the rule every host shares: :func:`~nemo_is_plugin.adapters.shared.owns_correction`; with
bypass mode, the loss reads log mu: :func:`~nemo_is_plugin.adapters.shared.reads_rollout_logprobs`):

- plugin IS off (``use_importance_sampling_correction: false``, no rejection, no veto): verl owns it. verl's weights
  multiply the per-token loss, exactly as in verl's own losses (none given: weight 1).
- plugin IS on (or a rejection / veto configured): the plugin owns it and needs log mu. It uses ``rollout_log_probs``
  when the caller passes them; otherwise it recovers ``log mu = old_log_prob - log w`` from verl's weights, which is
  exact only for *raw token ratios*: ``rollout_is: token``, ``rollout_is_threshold`` above any ratio (e.g. ``1e9``),
  no batch normalisation, no RS (verl's ``+-20`` clamp of log w is never reached in practice). Weights that are 0 on a
  valid token cannot be raw ratios and raise. Without either input the call raises.
- bypass (``old_policy_logprobs: generation``, verl's ``bypass_mode: true``): verl passes ``old_log_prob`` = log mu
  and no weights; the plugin's IS weights and rejections measure the current policy against it.

The weights enter as ``generation_logprobs = old_log_prob - log w`` on valid tokens (masked tokens: ``old_log_prob``).
"""

from __future__ import annotations

import torch

from nemo_is_plugin.loss.config_model import ClippedPGLossConfig


def generation_logprobs(old: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``old - log w`` on valid tokens, ``old`` elsewhere: the rollout log-probs that make exp(old - gen) = w.

    A weight of 0 (icepop / rejection in verl) becomes the smallest positive normal weight, ~1e-38 in float32.
    """
    w = weights.detach().to(old.dtype)
    log_w = torch.log(w.clamp_min(torch.finfo(old.dtype).tiny))
    return old.detach() - torch.where(mask, log_w, torch.zeros_like(log_w))


def rollout_logprobs(
    cfg: ClippedPGLossConfig,
    reads_mu: bool,
    weights_only: bool,
    old_log_prob: torch.Tensor,
    mask: torch.Tensor,
    rollout_is_weights: torch.Tensor | None,
    rollout_log_probs: torch.Tensor | None,
    *,
    loss_name: str,
) -> torch.Tensor:
    """The rollout log-probs log mu the loss sees (see the module docstring); ``loss_name`` names the registered loss
    in the error raised when the plugin owns the correction and has neither input."""
    if rollout_log_probs is not None and reads_mu:
        return rollout_log_probs.detach().to(old_log_prob.dtype)
    if cfg.bypasses_prev:
        if rollout_is_weights is not None:
            raise ValueError(
                "old_policy_logprobs='generation' (bypass) needs verl's bypass mode: set "
                "algorithm.rollout_correction.bypass_mode=true (verl then passes old_log_prob = the "
                "rollout log-probs and no rollout_is_weights)"
            )
        return old_log_prob.detach()
    if reads_mu and rollout_is_weights is not None:
        if bool(((rollout_is_weights <= 0) & mask).any()):
            raise ValueError(
                "the plugin's IS correction reads verl's rollout_is_weights as raw token ratios, but "
                "some valid tokens have weight 0: set algorithm.rollout_correction.rollout_is=token, "
                "a huge rollout_is_threshold (e.g. 1e9), no rollout_rs, or pass rollout_log_probs"
            )
        return generation_logprobs(old_log_prob, mask, rollout_is_weights)
    if reads_mu:
        raise ValueError(
            f"{loss_name}: the plugin's IS correction / rejection needs the rollout log-probs: "
            "enable verl's token-level rollout_is with a huge threshold (raw ratios) or pass "
            "rollout_log_probs; or set use_importance_sampling_correction: false to let verl correct"
        )
    if weights_only and rollout_is_weights is not None:  # weights_only means verl passed its weights
        return generation_logprobs(old_log_prob, mask, rollout_is_weights)
    return old_log_prob.detach()
