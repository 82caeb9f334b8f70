"""Hypothesis strategies of random valid loss configs and random NeMo-RL batches, shared by the property tests and the
device-guard tests. ``NEMO_IS_PROPERTY_SCALE=<k>`` multiplies the example counts built on ``PROPERTY_SCALE``."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from hypothesis import HealthCheck, assume
from hypothesis import strategies as st
from pydantic import ValidationError

from nemo_is_plugin import ClippedPGLossConfig

PROPERTY_SCALE = max(1, int(os.environ.get("NEMO_IS_PROPERTY_SCALE", "1")))
HYPOTHESIS_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

RATIO_LEVELS = (None, "token", "sequence", "sequence_token", "cumulative", "cumulative_mean")
IS_LEVELS = ("token", "sequence", "sequence_mean", "cumulative")
BOUNDS = {
    "tis": (None, 2.0),
    "icepop": (0.5, 5.0),
    "seq-mask-tis": (0.9, 1.1),
    "seq-mis": (0.5, 2.0),
    "geo-rs": (0.9, 1.1),
}


# --------------------------------------------------------------------------------------------- strategies
@st.composite
def loss_configs(draw, *, force_is: bool = False) -> ClippedPGLossConfig:
    """A valid loss config covering every option family (invalid draws are rejected with ``assume``)."""
    kw: dict[str, Any] = {}
    family = draw(st.sampled_from(["ppo", "ppo_dual", "log_clip", "cispo", "reinforce", "force_on_policy"]))
    gspo = family in ("ppo", "ppo_dual", "log_clip") and draw(st.booleans())
    if gspo:
        kw["sequence_level_importance_ratios"] = True
        kw["token_level_loss"] = False
    if family in ("ppo", "ppo_dual", "log_clip"):
        kw["ratio_level"] = draw(st.sampled_from(RATIO_LEVELS))
        kw["ratio_clip_min"], kw["ratio_clip_max"] = draw(st.sampled_from([(0.2, 0.2), (0.2, 0.28), (1e-3, 1e-3)]))
    if family == "ppo_dual":
        kw["ratio_clip_c"] = draw(st.sampled_from([3.0, 10.0]))
    if family == "log_clip":
        kw.update(log_ratio_clip_low=0.025, log_ratio_clip_high=0.05)
        kw["clip_position_power"] = draw(st.sampled_from([0.0, 0.5]))
        kw["log_ratio_clip_c"] = draw(st.sampled_from([None, 1.0]))
    if family == "cispo":
        kw.update(use_cispo=True, ratio_clip_min=1.0, ratio_clip_max=5.0)
    if family == "reinforce":
        kw["disable_ppo_ratio"] = True
    if family == "force_on_policy":
        kw["force_on_policy_ratio"] = True
    if family != "reinforce":
        kw["token_log_ratio_clamp"] = draw(st.sampled_from([None, 20.0]))
    if family not in ("reinforce", "force_on_policy"):  # a cap on a ratio fixed to 1 is refused (it never binds)
        kw["max_log_ratio"] = draw(st.sampled_from([None, 10.0]))

    use_is = force_is or draw(st.booleans())
    kw["use_importance_sampling_correction"] = use_is
    trunc = draw(st.sampled_from([None, "tis", "icepop", "seq-mask-tis", "seq-mis", "geo-rs"]))
    if trunc is not None and (use_is or trunc in ("seq-mis", "geo-rs")):
        low, high = BOUNDS[trunc]
        kw.update(
            truncated_importance_sampling_type=trunc,
            truncated_importance_sampling_ratio=high,
            truncated_importance_sampling_ratio_min=low,
        )
    if use_is or kw.get("truncated_importance_sampling_type") in ("seq-mis", "geo-rs"):
        kw["is_correction_level"] = draw(st.sampled_from([None, *IS_LEVELS]))
        kw["importance_sampling_batch_normalize"] = draw(st.booleans())
    kw["importance_sampling_veto_threshold"] = draw(st.sampled_from([None, 1e-4]))

    kw["reference_policy_kl_penalty"] = draw(st.sampled_from([0.0, 0.01, 0.1]))
    kw["reference_policy_kl_type"] = draw(st.sampled_from(["k1", "k2", "k3"]))
    kw["use_on_policy_kl_approximation"] = draw(st.booleans())
    kw["use_kl_in_reward"] = draw(st.booleans())
    if kw["reference_policy_kl_penalty"] and not kw["use_kl_in_reward"]:
        kw["reference_policy_kl_gradient"] = draw(st.sampled_from(["estimator", "k2"]))
    if draw(st.booleans()):
        kw["kl_input_clamp_value"], kw["kl_output_clamp_value"] = None, None
    if not gspo and family != "cispo":
        agg = draw(
            st.sampled_from(
                [None, "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
            )
        )
        kw["loss_aggregation"] = agg
        if agg == "seq-mean-token-sum-norm":
            kw["loss_aggregation_norm"] = 16.0
    kw["positive_example_nll_weight"] = draw(st.sampled_from([0.0, 0.0, 0.1]))
    try:
        return ClippedPGLossConfig(**kw)
    except ValidationError:
        assume(False)
        raise  # unreachable


@st.composite
def batches(
    draw,
    *,
    is_scale: float | None = None,
    policy_scale: float | None = None,
    dtype: torch.dtype | None = None,
    min_b: int = 1,
    max_b: int = 4,
    max_t: int = 12,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(next_token_logprobs [B, S-1], data of [B, S] tensors) with random masks and log-prob scales.

    p ~ -|N| * a, g ~ -|N| * b, so p - g reaches about +-is_scale; c = min(p + N * policy_scale, 0).
    """
    b = draw(st.integers(min_b, max_b))
    t = draw(st.integers(1, max_t))
    seed = draw(st.integers(0, 2**32 - 1))
    is_s = is_scale if is_scale is not None else draw(st.sampled_from([1e-3, 0.1, 1.0, 30.0, 1e3, 1e4]))
    pol_s = policy_scale if policy_scale is not None else draw(st.sampled_from([0.0, 1e-2, 0.3, 2.0]))
    dt = dtype if dtype is not None else draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    mask_p = draw(st.sampled_from([1.0, 0.8, 0.3]))
    rng = np.random.default_rng(seed)
    shape = (b, t + 1)
    prev = -np.abs(rng.standard_normal(shape)) * rng.choice([1.0, is_s], size=shape)
    gen = -np.abs(rng.standard_normal(shape)) * rng.choice([1.0, is_s], size=shape)
    curr = np.minimum(prev + rng.standard_normal(shape) * pol_s, 0.0)
    token_mask = (rng.random(shape) < mask_p).astype(np.float32)
    token_mask[:, 0] = 0
    data = {
        "token_mask": torch.as_tensor(token_mask),
        "sample_mask": torch.as_tensor((rng.random(b) < 0.85).astype(np.float32)),
        "advantages": torch.as_tensor(rng.standard_normal(shape), dtype=torch.float32),
        "prev_logprobs": torch.as_tensor(prev).to(dt),
        "generation_logprobs": torch.as_tensor(gen).to(dt),
        "reference_policy_logprobs": torch.as_tensor(np.minimum(prev + 0.1 * rng.standard_normal(shape), 0)).to(dt),
        "rewards": torch.as_tensor(rng.integers(0, 2, size=b), dtype=torch.float32),
    }
    x = torch.as_tensor(curr[:, 1:]).to(dt)
    return x, data


def counts(data: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """NeMo-RL's global counts of a (whole) batch."""
    sm = data["sample_mask"]
    return sm.sum(), (data["token_mask"][:, 1:] * sm[:, None]).sum()
