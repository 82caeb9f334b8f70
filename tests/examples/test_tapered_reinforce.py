"""The third-party example package, examples/tapered_reinforce/ (``make setup`` installs it, so CI runs this): found
through its entry point, it validates with its own key's range in ``nemo-is validate``, computes the hand formula
L_t = -w_t A_t gamma^(n_t - 1) c_t in float64 (loss and gradient; w the token TIS weight), takes both fused passes
(single pass and two-pass, equal to the naive path at 1e-10 in float64), runs through the verl adapter, and is
selectable by import path. Skipped where the package is not installed (pip install --no-deps --no-build-isolation -e
examples/tapered_reinforce); the check that docs/writing_an_objective.md quotes its module runs everywhere."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest
import torch
from distributed._fused_cases import OBJECTIVE_IS, assert_parity, fused, pg_problem, run
from distributed.test_fused_linear_objectives import naive_logprobs_fp64
from typer.testing import CliRunner

from nemo_is_plugin.loss import ClippedPGLoss, LossInputs
from nemo_is_plugin.loss.config_model import load_loss_config
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.objectives import ENTRY_POINT_GROUP, objective_names

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "tapered_reinforce" / "recipe.yaml"
F64 = torch.float64

installed = pytest.mark.skipif(
    "tapered_reinforce" not in {e.name for e in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)},
    reason="the example package is not installed (make setup installs it)",
)
CONFIG = {"policy_objective": "tapered_reinforce", "tapered_reinforce_decay": 0.9, "reference_policy_kl_penalty": 0.0}


def _batch(seed: int = 0):
    """float64 log-probs around each other, advantages of both signs, and a mask with a prompt-like masked head and
    a masked tail (so that the positions n_t count only the counted tokens)."""
    g = torch.Generator().manual_seed(seed)
    b, t = 3, 7
    prev = torch.log(torch.rand(b, t, generator=g, dtype=F64) * 0.9 + 0.05)
    gen = (prev + 0.3 * torch.randn(b, t, generator=g, dtype=F64)).clamp(max=-1e-4)
    curr = (prev + 0.3 * torch.randn(b, t, generator=g, dtype=F64)).clamp(max=-1e-4)
    adv = torch.randn(b, 1, generator=g, dtype=F64).expand(b, t).clone()
    mask = torch.ones(b, t, dtype=F64)
    mask[0, :2] = 0
    mask[1, 5:] = 0
    mask[2, 3] = 0
    return prev, gen, curr, adv, mask


@installed
def test_the_entry_point_registers_it_after_the_built_ins():
    names = objective_names()
    assert "tapered_reinforce" in names and names.index("tapered_reinforce") >= 13


@installed
def test_nemo_is_validate_shows_it_and_refuses_a_decay_outside_its_range():
    from nemo_is_plugin.apps.cli.main import app

    runner = CliRunner()
    shown = runner.invoke(app, ["validate", str(RECIPE), "--show-effective"], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    assert "none (-A 0.98^(n-1) log pi)" in shown.output and "tapered_reinforce_decay" in shown.output
    bad = runner.invoke(app, ["validate", str(RECIPE), "-o", "loss_fn.tapered_reinforce_decay=0"])
    assert bad.exit_code == 2
    assert "tapered_reinforce_decay=0 is outside its valid range (0, 1]" in bad.output
    assert "use a decay in (0, 1]" in bad.output


@installed
def test_loss_and_gradient_are_the_float64_hand_formula():
    prev, gen, c0, adv, mask = _batch()
    section = {**CONFIG, **OBJECTIVE_IS}  # token TIS at 2: w = min(exp(prev - gen), 2)
    assert load_loss_config(section).truncated_importance_sampling_type == "tis"
    c = c0.clone().requires_grad_(True)
    b, t = mask.shape
    inputs = LossInputs(c, prev, gen, prev, adv, mask, torch.ones(b, dtype=F64), float(b), float(mask.sum()))
    loss, _ = ClippedPGLoss(section).compute(inputs, TokenLayout.padded(b, t))
    (grad,) = torch.autograd.grad(loss, c)
    # by hand: n_t = 1, 2, ... over each sequence's counted tokens; token-mean over the counted tokens, / (N + 1e-8)
    positions = torch.cumsum(mask, dim=1)
    weight = torch.exp(prev - gen).clamp(max=OBJECTIVE_IS["truncated_importance_sampling_ratio"])
    per_token = -weight * adv * 0.9 ** (positions - 1) * mask
    n = float(mask.sum()) + 1e-8
    assert float(loss.detach()) == pytest.approx(float((per_token * c0).sum() / n), rel=1e-12, abs=1e-15)
    assert torch.allclose(grad, per_token / n, rtol=1e-12, atol=1e-15)
    assert float(grad.abs().max()) > 0 and float(grad[0, :2].abs().max()) == 0  # masked tokens get nothing


@installed
@pytest.mark.parametrize("single_pass", [True, False], ids=["single-pass", "two-pass"])
def test_both_fused_passes_equal_the_naive_path(single_pass):
    p = pg_problem(dtype=F64)
    cfg = {**OBJECTIVE_IS, **CONFIG, "reference_policy_kl_penalty": 0.05}
    want = run(p, naive_logprobs_fp64, cfg)
    assert_parity(fused(p, cfg, single_pass=single_pass), want, rtol=1e-10, grad_rtol=1e-10, metric_atol=1e-13)


@installed
def test_the_verl_adapter_computes_it():
    """verl's call (old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, actor config): the token mean
    over the counted tokens of -A gamma^(n-1) c (verl's settings add nothing here: no IS weights, no KL; verl's clip
    ratios are PPO's, left out for an objective without one)."""
    from nemo_is_plugin.adapters.verl import VerlPolicyLoss

    prev, _, c0, adv, mask = _batch(1)
    c = c0.clone().requires_grad_(True)
    actor = {"clip_ratio": 0.2, "clip_ratio_c": 3.0, "global_batch_info": {}}
    loss, _ = VerlPolicyLoss(dict(CONFIG))(prev, c, adv, mask.bool(), "token-mean", actor)
    (grad,) = torch.autograd.grad(loss, c)
    per_token = -adv * 0.9 ** (torch.cumsum(mask, dim=1) - 1) * mask
    n = float(mask.sum()) + 1e-8  # the plugin's token-mean under verl's token-mean: / (N + 1e-8)
    assert float(loss.detach()) == pytest.approx(float((per_token * c0).sum() / n), rel=1e-12)
    assert torch.allclose(grad, per_token / n, rtol=1e-12, atol=1e-15)


@installed
def test_it_is_selectable_by_import_path_too():
    """The registered class by import path resolves to its registered name (its keys included)."""
    cfg = load_loss_config({"policy_objective": "tapered_reinforce.objective:TaperedReinforce"})
    assert cfg.policy_objective == "tapered_reinforce" and cfg.tapered_reinforce_decay == 0.999


def test_the_authors_guide_quotes_the_example_module_as_it_is():
    """docs/writing_an_objective.md shows the example's objective module: the file this test runs, verbatim."""
    guide = (ROOT / "docs" / "writing_an_objective.md").read_text()
    (quoted,) = re.findall(r"^```py\n(.*?)^```", guide, flags=re.S | re.M)
    assert quoted == (ROOT / "examples" / "tapered_reinforce" / "tapered_reinforce" / "objective.py").read_text()
