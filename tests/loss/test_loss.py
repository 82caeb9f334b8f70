"""ClippedPGLoss end to end: gradcheck at every ratio and IS level, a hand-computed CTPO case, micro-batch
additivity, picklability."""

import math
import pickle

import pytest
import torch

from nemo_is_plugin import build_loss_fn, finalize_metrics
from nemo_is_plugin.apps.cli.synthetic_batch import synthetic_batch

F64 = torch.float64
# KL off: NeMo-RL's KL weight exp(c - sg[c]) is a stop-gradient device whose gradient is by design not the derivative
# of the value (tested analytically in test_kl.py), so finite differences cannot check it.
BASE = {"reference_policy_kl_penalty": 0.0, "use_importance_sampling_correction": True}


def _batch(B=3, S=7, seed=0):
    logprobs, data = synthetic_batch(B, S, mismatch_std=0.1, policy_drift=0.3, seed=seed, dtype=F64)
    data["token_mask"][:, 1:3] = 1.0
    for key in ("prev_logprobs", "generation_logprobs", "reference_policy_logprobs"):
        data[key] = data[key] - 3.0  # room below 0 for the shifted log-probs of the equivalence test
    return logprobs - 3.0, data


def _call(cfg, logprobs, data):
    m = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    return build_loss_fn(cfg)(
        next_token_logprobs=logprobs, data=data, global_valid_seqs=data["sample_mask"].sum(), global_valid_toks=m.sum()
    )


# Levels whose gradient is the true derivative of the loss value: checked by finite differences.
DIFFERENTIABLE = {
    "ratio=token": {},
    "ratio=sequence": {"ratio_level": "sequence"},
    "is=token": {"is_correction_level": "token"},
    "is=sequence": {"is_correction_level": "sequence"},
    "is=sequence_mean": {"is_correction_level": "sequence_mean"},
    "is=cumulative": {"is_correction_level": "cumulative"},
    "gspo-nemo-rl": {"sequence_level_importance_ratios": True, "token_level_loss": False},
    "log-clip-ratio=sequence": {
        "ratio_level": "sequence",
        "log_ratio_clip_low": 0.025,
        "log_ratio_clip_high": 0.05,
        "log_ratio_clip_c": 0.05,
        "clip_position_power": 0.5,
    },
    "tis": {"truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 1.1},
    "icepop": {
        "truncated_importance_sampling_type": "icepop",
        "truncated_importance_sampling_ratio": 1.1,
        "truncated_importance_sampling_ratio_min": 0.9,
    },
    "seq-mis": {
        "truncated_importance_sampling_type": "seq-mis",
        "truncated_importance_sampling_ratio": 3.0,
        "truncated_importance_sampling_ratio_min": 0.3,
        "is_correction_level": "sequence",
    },
    "seq-mean-token-sum": {"loss_aggregation": "seq-mean-token-sum"},
    "cispo": {"use_cispo": True},
    "dual-clip": {"ratio_clip_c": 1.5},
}


@pytest.mark.parametrize("name", list(DIFFERENTIABLE))
def test_gradcheck(name):
    logprobs, data = _batch()
    cfg = {**BASE, **DIFFERENTIABLE[name]}
    x = logprobs.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda v: _call(cfg, v, data)[0], (x,), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("level", ["sequence_token", "cumulative", "cumulative_mean"])
@pytest.mark.parametrize("clip", ["ratio", "log"])
def test_stop_gradient_levels_equal_a_gradchecked_token_surrogate(level, clip):
    """sequence_token / cumulative / cumulative_mean are straight-through ratios exp(sg[a_t] + c_t - sg[c_t]): at the
    point c0 they have the value and gradient of the token-level loss with prev' = c0 - a(c0) (and gen shifted by the
    same amount so the IS weights do not move). That token-level loss is gradchecked."""
    logprobs, data = _batch(seed=1)
    extra = (
        {"log_ratio_clip_low": 0.025, "log_ratio_clip_high": 0.05, "clip_position_power": 0.5} if clip == "log" else {}
    )
    cfg = {**BASE, "ratio_level": level, **extra}
    x = logprobs.clone().requires_grad_(True)
    loss, _ = _call(cfg, x, data)
    (grad,) = torch.autograd.grad(loss, x)

    from nemo_is_plugin.loss.layout import TokenLayout
    from nemo_is_plugin.loss.ratios import policy_log_ratio

    tm = data["token_mask"][:, 1:]
    anchor = policy_log_ratio(level, logprobs, data["prev_logprobs"][:, 1:], tm, TokenLayout.padded(*logprobs.shape))
    shift = torch.zeros_like(data["prev_logprobs"])
    shift[:, 1:] = (logprobs - anchor - data["prev_logprobs"][:, 1:]) * tm
    token_data = {
        **data,
        "prev_logprobs": data["prev_logprobs"] + shift,
        "generation_logprobs": data["generation_logprobs"] + shift,
    }
    token_cfg = {**cfg, "ratio_level": "token"}
    y = logprobs.clone().requires_grad_(True)
    token_loss, _ = _call(token_cfg, y, token_data)
    (token_grad,) = torch.autograd.grad(token_loss, y)
    assert torch.allclose(loss, token_loss) and torch.allclose(grad, token_grad)
    assert torch.autograd.gradcheck(lambda v: _call(token_cfg, v, token_data)[0], (y,), eps=1e-6, atol=1e-7)


def test_ctpo_cumulative_loss_hand_computed():
    """One sequence, advantage +1, cumulative ratio without clipping: loss = -mean_t exp(sum_{j<=t} d_j),
    gradient d loss / d c_t = -exp(S_t) / n (only the current token of each term)."""
    d = torch.tensor([0.1, -0.3, 0.2], dtype=F64)
    prev = torch.tensor([[-9.0, -1.0, -2.0, -0.5]], dtype=F64)  # column 0 is the prompt (sliced away)
    curr = (prev[:, 1:] + d).clone().requires_grad_(True)
    data = {
        "token_mask": torch.tensor([[0.0, 1, 1, 1]], dtype=F64),
        "sample_mask": torch.ones(1, dtype=F64),
        "advantages": torch.ones(1, 4, dtype=F64),
        "prev_logprobs": prev,
        "generation_logprobs": prev,
    }
    cfg = {
        "reference_policy_kl_penalty": 0.0,
        "ratio_level": "cumulative",
        "ratio_clip_min": 1.0,
        "ratio_clip_max": 10.0,
    }
    loss, metrics = _call(cfg, curr, data)
    s = torch.cumsum(d, 0)
    assert math.isclose(loss.item(), -torch.exp(s).mean().item(), rel_tol=1e-8)  # denominators carry +1e-8
    (grad,) = torch.autograd.grad(loss, curr)
    assert torch.allclose(grad[0], -torch.exp(s) / 3, rtol=1e-8)
    assert math.isclose(metrics["probs_ratio"], torch.exp(s).mean().item(), rel_tol=1e-8)


def test_microbatches_with_global_counts_sum_to_the_batch():
    logprobs, data = _batch(B=6, S=9, seed=3)
    cfg = {
        **BASE,
        "reference_policy_kl_penalty": 0.01,
        "sequence_level_importance_ratios": True,
        "token_level_loss": False,
        "is_correction_level": "sequence_mean",
    }
    m = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    n_seq, n_tok = data["sample_mask"].sum(), m.sum()
    fn = build_loss_fn(cfg)
    x = logprobs.clone().requires_grad_(True)
    whole, whole_m = fn(next_token_logprobs=x, data=data, global_valid_seqs=n_seq, global_valid_toks=n_tok)
    (g_whole,) = torch.autograd.grad(whole, x)
    parts, grads, summed = [], [], {}
    for sl in (slice(0, 2), slice(2, 6)):
        xs = logprobs[sl].clone().requires_grad_(True)
        loss, met = fn(
            next_token_logprobs=xs,
            data={k: v[sl] for k, v in data.items()},
            global_valid_seqs=n_seq,
            global_valid_toks=n_tok,
        )
        parts.append(loss)
        grads.append(torch.autograd.grad(loss, xs)[0])
        for k, v in met.items():
            summed[k] = (
                min(summed.get(k, v), v)
                if k.endswith("_min")
                else (max(summed.get(k, v), v) if k.endswith("_max") else summed.get(k, 0.0) + v)
            )
    assert math.isclose(sum(p.item() for p in parts), whole.item(), rel_tol=1e-10, abs_tol=1e-12)
    assert torch.allclose(torch.cat(grads), g_whole)
    for k in ("loss", "probs_ratio", "is_weight_mean", "mismatch_kl_k3", "log_ppl_diff", "num_valid_samples"):
        assert math.isclose(summed[k], whole_m[k], rel_tol=1e-9, abs_tol=1e-12), k
    assert finalize_metrics(summed)["is_weight_ess"] == pytest.approx(finalize_metrics(whole_m)["is_weight_ess"])


def test_loss_is_picklable_and_rebuilt_equal():
    fn = build_loss_fn({"use_importance_sampling_correction": True, "is_correction_level": "cumulative"})
    clone = pickle.loads(pickle.dumps(fn))
    assert clone.config == fn.config


@pytest.mark.parametrize(
    "cfg", [{}, {"ratio_level": "sequence"}, {"log_ratio_clip_low": 0.2, "log_ratio_clip_high": 0.2}]
)
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_masked_padding_far_below_the_current_logprob_leaves_the_gradient_finite(cfg, dtype):
    """A padding position (token_mask 0) whose old log-prob is far below the current one has exp(c - p) = inf; the
    value is masked out, and the gradient must be too (0, not 0 * inf = NaN), for every other token unchanged."""
    logprobs, data = _batch()
    logprobs, data = logprobs.to(dtype), {k: v.to(dtype) if v.is_floating_point() else v for k, v in data.items()}
    masked = (data["token_mask"][:, 1:] == 0).nonzero()
    assert len(masked) > 0
    grads = []
    for poison in (False, True):
        d = {k: v.clone() for k, v in data.items()}
        if poison:
            b, t = masked[0].tolist()
            d["prev_logprobs"][b, t + 1] = -1e4  # finite: validation accepts it
        c = logprobs.clone().requires_grad_(True)
        loss, _ = _call(cfg, c, d)
        loss.backward()
        grads.append(c.grad)
    assert torch.isfinite(grads[1]).all() and grads[1][tuple(masked[0])] == 0
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


def test_packed_layout_takes_per_sequence_tensors_of_its_length():
    """A packed [1, N] batch of several sequences: sample_mask / rewards are [num_seqs], checked against the layout."""
    from nemo_is_plugin.loss.layout import TokenLayout

    logprobs, data = _batch(B=1, S=9)
    layout = TokenLayout.packed([0, 3, 8])  # two sequences in the 8 next-token positions
    data["sample_mask"] = torch.tensor([1.0, 1.0], dtype=F64)
    loss, _ = build_loss_fn({})(logprobs, data, 2, data["token_mask"][:, 1:].sum(), layout=layout)
    assert torch.isfinite(loss)
    data["sample_mask"] = torch.tensor([1.0], dtype=F64)
    with pytest.raises(ValueError, match=r"expected \[num_seqs\] = \[2\]"):
        build_loss_fn({})(logprobs, data, 2, data["token_mask"][:, 1:].sum(), layout=layout)
