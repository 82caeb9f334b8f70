"""``reinforce`` (objectives/reinforce.py): -A log pi by hand in float64 with and without NeMo-RL's dual clip, the
whole loss written out, NeMo-RL's ``disable_ppo_ratio`` selecting it bit for bit like ``policy_objective:
reinforce``, the keys it ignores as NeMo-RL does, its refusals."""

from __future__ import annotations

import pydantic
import pytest
import torch
from helpers.switch_objectives import F64, loss_and_grad, switch_batch

from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
from nemo_is_plugin.loss.effective import effective_settings
from nemo_is_plugin.loss.objectives import objective_of
from nemo_is_plugin.loss.objectives.reinforce import reinforce_surrogate


def test_reinforce_surrogate_by_hand():
    c = torch.tensor([-0.5, -2.0, -4.0], dtype=F64, requires_grad=True)
    adv = torch.tensor([1.0, -1.0, -1.0], dtype=F64)
    out = reinforce_surrogate(c, adv, dual_clip=None)
    assert torch.equal(out.loss.detach(), torch.tensor([0.5, -2.0, -4.0], dtype=F64))
    assert out.ratio is None and out.clipped_ratio is None  # no ratio: its log-prob is not one
    assert out.clipped is None and not out.dual_clipped.any()  # only the dual clip, inactive without ratio_clip_c
    # NeMo-RL's dual clip after REINFORCE (A < 0): min(-A c, -A 3) = min(c, 3) here: never binds for c < 0
    capped = reinforce_surrogate(c, adv, dual_clip=3.0)
    assert torch.equal(capped.loss.detach(), out.loss.detach()) and not capped.dual_clipped.any()
    (grad,) = torch.autograd.grad(capped.loss.sum(), c)
    assert torch.equal(grad, -adv)


@pytest.mark.parametrize(
    "selected", [dict(disable_ppo_ratio=True), dict(policy_objective="reinforce")], ids=["disable_ppo_ratio", "name"]
)
def test_the_whole_loss_is_the_token_mean_of_minus_a_log_pi(selected):
    inputs, layout = switch_batch(3)
    loss, grad, _ = loss_and_grad(selected, inputs, layout)
    c, a, m = inputs.curr_logprobs, inputs.advantages, inputs.token_mask
    torch.testing.assert_close(loss, (-a * c * m).sum() / (m.sum() + 1e-8), rtol=1e-14, atol=0)
    torch.testing.assert_close(grad, -a * m / (m.sum() + 1e-8), rtol=1e-14, atol=0)


def test_disable_ppo_ratio_and_the_name_compute_the_same_bits():
    inputs, layout = switch_batch(4)
    kwargs = dict(ratio_clip_c=1.5, use_importance_sampling_correction=True)
    by_key = loss_and_grad(dict(disable_ppo_ratio=True, **kwargs), inputs, layout)
    by_name = loss_and_grad(dict(policy_objective="reinforce", **kwargs), inputs, layout)
    assert torch.equal(by_key[0], by_name[0]) and torch.equal(by_key[1], by_name[1])
    # the metrics agree but for NeMo-RL's ratio metrics: reported under NeMo-RL's switch as NeMo-RL does (its
    # "ratio" is the log-prob), and not under the name, whose objective has no ratio
    nemo_rl_names = {f"probs_ratio{c}{e}" for c in ("", "_clamped") for e in ("", "_min", "_max")}
    assert set(by_key[2]) - set(by_name[2]) == nemo_rl_names and set(by_name[2]) <= set(by_key[2])
    assert {k: by_key[2][k] for k in by_name[2]} == by_name[2]
    c, m = inputs.curr_logprobs, inputs.token_mask
    mean = (c * m).sum() / (m.sum() + 1e-8)
    for name in ("probs_ratio", "probs_ratio_clamped"):
        assert by_key[2][name] == pytest.approx(mean.item(), rel=1e-12)
        assert by_key[2][f"{name}_min"] == c[m != 0].min().item() and by_key[2][f"{name}_max"] == c[m != 0].max()


def test_nemo_rl_key_selects_reinforce_and_its_ignored_clip_bounds_pass():
    cfg = ClippedPGLossConfig(disable_ppo_ratio=True, ratio_clip_min=0.1, ratio_clip_max=0.28)  # NeMo-RL ignores them
    assert cfg.effective_objective == "reinforce" and objective_of(cfg).name == "reinforce"
    said = effective_settings(cfg)
    assert said["policy objective"] == "reinforce (selected by NeMo-RL's disable_ppo_ratio: true)"
    assert said["policy ratio"].startswith("none: REINFORCE") and said["ratio clip"] == "none"
    assert effective_settings(ClippedPGLossConfig(disable_ppo_ratio=True, ratio_clip_c=3.0))["ratio clip"] == (
        "none, dual clip c = 3"
    )


REFUSED = [
    (dict(policy_objective="reinforce", ratio_clip_max=0.28), "ratio_clip_max configures PPO's ratio clip"),
    (dict(disable_ppo_ratio=True, max_log_ratio=10.0), "max_log_ratio configures PPO's ratio clip"),
    (
        dict(disable_ppo_ratio=True, log_ratio_clip_low=0.1, log_ratio_clip_high=0.1),
        "unset log_ratio_clip_low",
    ),
    (dict(disable_ppo_ratio=True, ratio_level="sequence"), "no policy ratio .*: unset ratio_level='sequence'"),
    (dict(policy_objective="reinforce", use_cispo=True), "use_cispo=true chooses another policy ratio"),
    (
        dict(disable_ppo_ratio=True, score_centering=True, old_policy_logprobs="prev", score_centering_top_k=2),
        None,
    ),
]


@pytest.mark.parametrize("kwargs, message", REFUSED, ids=[str(m)[:40] for _, m in REFUSED])
def test_refusals_name_the_field_and_the_fix(kwargs, message):
    if message is None:  # composes: score centering centres REINFORCE's token score
        ClippedPGLossConfig(**kwargs)
        return
    with pytest.raises(pydantic.ValidationError, match=message):
        ClippedPGLossConfig(**kwargs)
