"""The per-token terms are computed once per loss call (loss/terms.py) and everything else reads them: the chosen
objective's surrogate, the IS correction (with its rejection rules) and the KL are each computed exactly once by
ClippedPGLoss.compute, by the fused single pass (its gradient's constants and its metrics pass share one
correction), and by verl's adapter with its rollout_corr/ statistics; the registry's contract."""

from __future__ import annotations

import collections
from typing import get_args

import pytest
import torch

import nemo_is_plugin.loss.correction as correction_module
import nemo_is_plugin.loss.rejection as rejection_module
from nemo_is_plugin.config.keys import KeySection
from nemo_is_plugin.loss import ClippedPGLoss, LossInputs
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig, PolicyObjective
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.objectives import BUILTIN_OBJECTIVES, OBJECTIVES, objective_names, register_objective
from nemo_is_plugin.loss.objectives import PolicyObjective as Objective
from nemo_is_plugin.loss.terms import KLSpec

F64 = torch.float64
B, T = 3, 6
CONFIG = dict(
    use_importance_sampling_correction=True,
    truncated_importance_sampling_type="tis",
    truncated_importance_sampling_ratio=1.5,
    importance_sampling_rejection_rules=[{"statistic": "k3", "aggregation": "sequence_mean", "max": 0.02}],
    reference_policy_kl_penalty=0.1,
)


@pytest.fixture
def calls(monkeypatch):
    """Counts of every computation of a term: each objective's surrogate, the IS log-weights (the start of every IS
    correction), each rejection rule's evaluation, the KL."""
    counts: collections.Counter[str] = collections.Counter()

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    for objective in OBJECTIVES.values():
        monkeypatch.setattr(objective, "surrogate", counting("surrogate", objective.surrogate))
    monkeypatch.setattr(correction_module, "is_log_weight", counting("is_weights", correction_module.is_log_weight))
    monkeypatch.setattr(rejection_module, "evaluate_rule", counting("rule", rejection_module.evaluate_rule))
    monkeypatch.setattr(KLSpec, "tokens", counting("kl", KLSpec.tokens))
    return counts


def _inputs(seed: int = 0) -> tuple[LossInputs, TokenLayout]:
    g = torch.Generator().manual_seed(seed)
    prev = torch.log(torch.rand(B, T, generator=g, dtype=F64) * 0.9 + 0.05)
    curr = (prev + 0.2 * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-4).requires_grad_(True)
    gen = (prev + 0.2 * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-4)
    ref = (prev + 0.2 * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-4)
    adv = torch.randn(B, T, generator=g, dtype=F64)
    mask = torch.ones(B, T, dtype=F64)
    inputs = LossInputs(curr, prev, gen, ref, adv, mask, torch.ones(B, dtype=F64), float(B), float(B * T))
    return inputs, TokenLayout.padded(B, T)


def test_compute_computes_each_term_once(calls):
    inputs, layout = _inputs()
    loss, metrics = ClippedPGLoss(CONFIG).compute(inputs, layout)
    loss.backward()
    assert calls == {"surrogate": 1, "is_weights": 1, "rule": 1, "kl": 1}
    assert 0 < metrics["is_rejection_rejected_fraction"] < 1  # the rule and the correction bite


def test_the_fused_single_pass_shares_one_correction_with_its_metrics(calls):
    from nemo_is_plugin.apps.bench.problem import make_problem
    from nemo_is_plugin.distributed.entry_points.fused_linear_loss import fused_linear_pg_loss

    p = make_problem(2, 9, 8, 16, seed=1, dtype=F64)
    hidden = p.hidden.detach().requires_grad_(True)
    args = (p.data, p.global_valid_seqs, p.global_valid_toks)
    loss, _ = fused_linear_pg_loss(ClippedPGLoss(CONFIG), hidden, p.weight, p.target, *args, chunk_size=4)
    loss.backward()
    # one IS correction and one rule evaluation for the call; the objective and the KL once per chunk (its gradient)
    # and once for the loss's value and metrics
    chunks = -(-p.target.numel() // 4)
    assert calls == {"surrogate": chunks + 1, "is_weights": 1, "rule": 1, "kl": chunks + 1}


def test_verl_metrics_read_the_loss_correction(calls):
    """The verl adapter owning the correction: its rollout_corr/ statistics come from the loss's IS correction and
    rule outcomes (no second correction, no second rule evaluation)."""
    verl = pytest.importorskip("nemo_is_plugin.adapters.verl")
    inputs, _ = _inputs(3)
    cfg = {**CONFIG, "reference_policy_kl_penalty": 0.0}
    loss_fn = verl.VerlPolicyLoss(cfg)
    actor = {"clip_ratio": 0.2, "clip_ratio_c": 3.0, "global_batch_info": {}}
    args = (inputs.prev_logprobs, inputs.curr_logprobs, inputs.advantages, inputs.token_mask.bool())
    _, metrics = loss_fn(*args, "token-mean", actor, rollout_log_probs=inputs.generation_logprobs)
    assert calls == {"surrogate": 1, "is_weights": 1, "rule": 1}
    assert "rollout_corr/rollout_is_mean" in metrics and "rollout_corr/rollout_rs_seq_mean_k3_seq_mean" in metrics


def test_registry_contract():
    assert objective_names()[0] == "ppo_clip" and sorted(objective_names()) == sorted(get_args(PolicyObjective))
    fields = ClippedPGLossConfig.model_fields
    for objective in (OBJECTIVES[name] for name in BUILTIN_OBJECTIVES):  # another package's: its own tests
        if objective.keys is not None:  # every section's keys are flat fields of the config, as declared
            for key in objective.keys.own_keys():
                assert fields[key].metadata == objective.keys.model_fields[key].metadata, key
        for key in objective.required:
            assert key in fields, (objective.name, key)

    class Twice(Objective):
        name = "ppo_clip"

    with pytest.raises(ValueError, match="registered twice"):
        register_objective(Twice)

    class Empty(KeySection):
        pass

    assert Empty.own_keys() == ()
