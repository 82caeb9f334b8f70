"""Shared inputs for the parallel-loss tests: loss configurations covering every ratio level, IS level and
truncation type, a seeded NeMo-RL-style batch, and the single-process reference (loss, metrics, d loss / d logits)."""

from __future__ import annotations

import math

import torch

from nemo_is_plugin.loss import ClippedPGLoss

IS_ON = {"use_importance_sampling_correction": True}
SEQ_LOSS = {"token_level_loss": False}
CTPO = {"log_ratio_clip_low": 0.025, "log_ratio_clip_high": 0.05, "clip_position_power": 0.5}

# Tolerances. fp64 logits run the same code in fp64 and isolate the parallel algorithms from rounding: 1e-10 relative.
# fp32 is held to the noise floor of the single-process loss itself: on these batches the fp32 reference is off from its
# fp64 value by up to 2.4e-7 relative on the loss and 1.6e-6 of max|g| on the gradient (ill-conditioned terms such as
# the k3 KL e^x - 1 - x at small x amplify the ~1 ulp log-prob rounding), and a parallel fp32 result may be off as much
# the other way (test_logit_loss checks these numbers). So fp32: loss and metrics 2e-6 relative (metrics: or 1e-7
# absolute), gradients 5e-6 of max|g|.
TOL = {torch.float32: {"rtol": 2e-6, "atol": 1e-7}, torch.float64: {"rtol": 1e-10, "atol": 1e-13}}
GRAD_RTOL = {torch.float32: 5e-6, torch.float64: 1e-10}


def assert_tensor_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, grad: bool = False) -> None:
    """Relative to the largest entry: a gradient's tiny entries carry the absolute error of the big ones."""
    rtol = GRAD_RTOL[dtype] if grad else TOL[dtype]["rtol"]
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * float(want.abs().max()) + 1e-30)


# name -> loss_fn section. Together: every ratio_level, is_correction_level and truncation type, every aggregation.
LOSS_CONFIGS: dict[str, dict] = {
    "nemo_rl_default": {},
    "gspo_nemo_rl": {"sequence_level_importance_ratios": True, **SEQ_LOSS, "reference_policy_kl_penalty": 0.0, **IS_ON},
    "gspo_token_seqmean_is_tis": {
        "ratio_level": "sequence_token",
        **IS_ON,
        "is_correction_level": "sequence_mean",
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 1.01,
        **SEQ_LOSS,
    },
    "ctpo_cumulative_is": {
        "ratio_level": "cumulative",
        **CTPO,
        **IS_ON,
        "is_correction_level": "cumulative",
        "log_ratio_clip_c": 0.2,
        "token_log_ratio_clamp": 20.0,
        "max_log_ratio": 10.0,
    },
    "cumulative_mean_seq_is_icepop": {
        "ratio_level": "cumulative_mean",
        **CTPO,
        **IS_ON,
        "is_correction_level": "sequence",
        "truncated_importance_sampling_type": "icepop",
        "truncated_importance_sampling_ratio": 1.4,
        "truncated_importance_sampling_ratio_min": 0.7,
    },
    "token_icepop": {
        **IS_ON,
        "truncated_importance_sampling_type": "icepop",
        "truncated_importance_sampling_ratio": 1.1,
        "truncated_importance_sampling_ratio_min": 0.9,
    },
    "seq_mask_tis": {
        **IS_ON,
        "is_correction_level": "sequence_mean",
        "truncated_importance_sampling_type": "seq-mask-tis",
        "truncated_importance_sampling_ratio": 1.03,
        "truncated_importance_sampling_ratio_min": 0.97,
    },
    "seq_mis_veto": {
        "truncated_importance_sampling_type": "seq-mis",
        "truncated_importance_sampling_ratio": 1.4,
        "truncated_importance_sampling_ratio_min": 0.7,
        "importance_sampling_veto_threshold": 0.7,
        "loss_aggregation": "seq-mean-token-sum",
    },
    "geo_rs_batch_norm": {
        **IS_ON,
        "truncated_importance_sampling_type": "geo-rs",
        "truncated_importance_sampling_ratio": 1.05,
        "truncated_importance_sampling_ratio_min": 0.95,
        "importance_sampling_batch_normalize": True,
        "is_correction_level": "sequence_mean",
    },
    "cispo_tis": {
        "use_cispo": True,
        "ratio_clip_min": 1.0,
        "ratio_clip_max": 0.05,
        "reference_policy_kl_penalty": 0.0,
        **IS_ON,
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 1.05,
    },
    "dual_clip_k2_norm": {
        "ratio_clip_c": 3.0,
        "reference_policy_kl_type": "k1",
        "reference_policy_kl_gradient": "k2",
        "loss_aggregation": "seq-mean-token-sum-norm",
        "loss_aggregation_norm": 16.0,
    },
    "reinforce_on_policy_kl_nll": {
        "disable_ppo_ratio": True,
        "use_on_policy_kl_approximation": True,
        **IS_ON,
        "positive_example_nll_weight": 0.1,
    },
    # verl's rejection options, every aggregation (sequence max through the CP layout's max), several at once; bounds
    # set between the batches' statistics so each one keeps and rejects sequences
    "verl_rejection_rules_token_sum": {
        **IS_ON,
        "is_correction_level": "token",
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 1.1,
        "loss_aggregation": "token-sum",
        "importance_sampling_rejection_rules": [
            {"option": "token_k1", "threshold": "0.8_1.25"},
            {"option": "seq_sum_k2", "threshold": 0.05},
            {"option": "seq_mean_k3", "threshold": 0.008},
            {"option": "seq_max_k3", "threshold": 0.03},
        ],
    },
    "verl_bypass_reinforce_seq_max": {
        "old_policy_logprobs": "generation",
        "disable_ppo_ratio": True,
        **IS_ON,
        "is_correction_level": "sequence",
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 2.0,
        "importance_sampling_rejection_rules": [{"option": "seq_max_k2", "threshold": 0.1}],
    },
    # the probability-difference statistic |pi_prev - mu| under every aggregation, beside a k2 rule; bounds between the
    # batches' values (token quantiles ~0.9, sequence values of the larger sequences), far from them in float32 terms
    "prob_diff_rejection_rules": {
        **IS_ON,
        "is_correction_level": "sequence_mean",
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 1.1,
        "importance_sampling_rejection_rules": [
            {"statistic": "prob_diff", "aggregation": "token", "max": 0.01},
            {"statistic": "prob_diff", "aggregation": "sequence_sum", "max": 0.02},
            {"statistic": "prob_diff", "aggregation": "sequence_mean", "max": 0.004},
            {"statistic": "prob_diff", "aggregation": "sequence_max", "max": 0.01},
            {"option": "seq_max_k2", "threshold": 0.02},
        ],
    },
    # policy objectives (docs/objectives.md) with IS weights and the KL term; thresholds that drop tokens here
    "dppo_tv_is": {
        "policy_objective": "dppo_tv",
        "dppo_delta_low": 0.02,
        "dppo_delta_high": 0.03,
        "dppo_ratio_cap": 1.2,
        **IS_ON,
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 1.1,
    },
    "sapo_seq_mean": {
        "policy_objective": "sapo",
        "sapo_tau_pos": 1.0,
        "sapo_tau_neg": 1.05,
        "loss_aggregation": "seq-mean-token-mean",
        **IS_ON,
    },
    "gmpo_seq_mean_is": {
        "policy_objective": "gmpo",
        "gmpo_clip_low": 0.1,
        "gmpo_clip_high": 0.15,
        "loss_aggregation": "seq-mean-token-mean",
        **IS_ON,
        "is_correction_level": "sequence_mean",
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 1.05,
    },
}

# Every policy_objective (docs/objectives.md), with token TIS weights and the KL term; thresholds that drop tokens on
# these batches (test_logit_loss checks that each trust region bites and that every objective is here).
OBJECTIVE_IS = {**IS_ON, "truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 1.1}
OBJECTIVE_LOSS_CONFIGS: dict[str, dict] = {
    name: {**OBJECTIVE_IS, "policy_objective": name, **keys}
    for name, keys in {
        "ppo_clip": {"ratio_clip_min": 0.1, "ratio_clip_max": 0.1},
        "dppo_tv": {"dppo_delta_low": 0.002, "dppo_delta_high": 0.002, "dppo_ratio_cap": 1.2},
        "dppo_kl": {"dppo_delta_low": 1e-4, "dppo_delta_high": 1e-4},
        "prob_diff": {"prob_diff_threshold": 0.002},
        "cppo": {"cppo_delta": 0.002, "cppo_w_min": 0.8, "cppo_delta_b": 0.0005},
        "sapo": {"sapo_tau_pos": 1.0, "sapo_tau_neg": 1.05, "loss_aggregation": "seq-mean-token-mean"},
        "gmpo": {
            "gmpo_clip_low": 0.1,
            "gmpo_clip_high": 0.15,
            "loss_aggregation": "seq-mean-token-mean",
            "is_correction_level": "sequence_mean",
        },
        "gpg": {},
        "dro": {"dro_beta": 0.5},
        "m2po": {"m2po_budget": 0.01},
        "cispo": {"ratio_clip_min": 0.1, "ratio_clip_max": 0.1},
        "reinforce": {},
        "on_policy": {},
    }.items()
}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_batch(seed: int, num_seqs: int = 4, seq_len: int = 10, vocab: int = 16, dtype=torch.float32):
    """Full logits ``[B, S, V]`` and NeMo-RL ``data`` with prompts, responses, padding and one masked sample.

    Returns (logits, data, lengths): ``lengths[i]`` = tokens of sequence i (prompt + response), the rest is padding.
    """
    g = gen(seed)
    logits = (torch.randn(num_seqs, seq_len, vocab, generator=g) * 2).to(dtype)
    lengths = [seq_len - (3 * i) % 4 for i in range(num_seqs)]
    pos = torch.arange(seq_len).unsqueeze(0)
    length = torch.tensor(lengths).unsqueeze(1)
    token_mask = ((pos >= 2) & (pos < length)).float()  # two prompt tokens, then the response, then padding
    input_ids = torch.randint(0, vocab, (num_seqs, seq_len), generator=g) * (pos < length)
    lp = torch.log_softmax(logits.double(), -1)
    curr = torch.zeros(num_seqs, seq_len, dtype=torch.float64)
    curr[:, 1:] = lp[:, :-1].gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    noise = lambda scale: torch.randn(num_seqs, seq_len, generator=g, dtype=torch.float64) * scale  # noqa: E731
    prev = curr + noise(0.2)
    data = {
        "input_ids": input_ids,
        "token_mask": token_mask,
        "sample_mask": torch.tensor([1.0] * (num_seqs - 1) + [0.0]) if num_seqs > 2 else torch.ones(num_seqs),
        "advantages": torch.randn(num_seqs, 1, generator=g).expand(num_seqs, seq_len).contiguous() + noise(0.1).float(),
        "prev_logprobs": prev.float(),
        "generation_logprobs": (prev + noise(0.1)).float(),
        "reference_policy_logprobs": (curr + noise(0.1)).float(),
        "rewards": torch.randn(num_seqs, generator=g),
    }
    return logits, data, lengths


def global_counts(data: dict) -> tuple[torch.Tensor, torch.Tensor]:
    sm = data["sample_mask"].double()
    return sm.sum(), (data["token_mask"][:, 1:].double() * sm.unsqueeze(-1)).sum()


def reference(config: dict, logits: torch.Tensor, data: dict, counts=None):
    """Single-process loss, metrics and gradient w.r.t. the full logits (fp32 math, fp64 for fp64 logits)."""
    gvs, gvt = global_counts(data) if counts is None else counts
    x = logits.detach().clone().requires_grad_(True)
    logp = torch.log_softmax(x.to(torch.promote_types(x.dtype, torch.float32)), -1)
    lp = logp[:, :-1].gather(-1, data["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
    loss, metrics = ClippedPGLoss(config)(
        next_token_logprobs=lp, data=data, global_valid_seqs=gvs, global_valid_toks=gvt
    )
    loss.backward()
    return loss.detach(), metrics, x.grad


def assert_metrics_close(got: dict, want: dict, rtol: float, context: str = "", atol: float = 1e-7) -> None:
    """Every metric within ``rtol`` relative, or ``atol`` absolute for sums that cancel (fp32 log-prob rounding of
    ~1e-7 per token survives in e.g. a k1 KL of -4e-3 summed from +-0.1 terms)."""
    assert set(got) == set(want), f"{context}: metric names differ: {sorted(set(got) ^ set(want))}"
    bad = {}
    for k in sorted(want):
        a, b = float(got[k]), float(want[k])
        if math.isnan(b) and math.isnan(a):
            continue
        if not (abs(a - b) <= rtol * abs(b) + atol or (math.isinf(b) and a == b)):
            bad[k] = (a, b)
    assert not bad, f"{context}: metrics differ (got, want): {bad}"


def padded_lengths(lengths: list[int], multiple: int) -> list[int]:
    """Each sequence's length rounded up to a multiple (Megatron pads packed sequences to a multiple of 2*cp)."""
    return [-(-n // multiple) * multiple for n in lengths]


def pack(x: torch.Tensor, lengths_padded: list[int], fill: float = 0.0) -> torch.Tensor:
    """``x [B, S, ...]`` -> packed ``[sum(P), ...]``: sequence i's first ``P_i`` positions (``fill`` past S)."""
    rows = []
    for i, p in enumerate(lengths_padded):
        row = x[i, : min(p, x.shape[1])]
        if p > x.shape[1]:
            row = torch.cat([row, torch.full((p - x.shape[1],) + tuple(x.shape[2:]), fill, dtype=x.dtype)])
        rows.append(row)
    return torch.cat(rows)


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()))
