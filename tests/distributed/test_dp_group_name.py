"""The data-parallel group has one name at every entry point, ``dp_group``: the LOGIT loss's former
``data_parallel_group=`` still reaches the same reduction (with a DeprecationWarning), and both at once are refused
(the call signature's ``**_`` would otherwise swallow one of them silently)."""

from __future__ import annotations

import inspect

import pytest
import torch

from nemo_is_plugin.adapters.slime import entry_points as slime_entry_points
from nemo_is_plugin.distributed.entry_points import fused_linear_loss, logit_loss
from nemo_is_plugin.distributed.entry_points.logit_loss import LogitClippedPGLoss
from nemo_is_plugin.loss import ClippedPGLoss

from ._loss_cases import LOSS_CONFIGS, global_counts, make_batch


def _call(monkeypatch, **group_kwargs):
    """The LOGIT loss on a small batch; returns (loss, logits' gradient, the group with_data_parallel received)."""
    seen = []
    real = logit_loss.with_data_parallel

    def spy(layout, group):
        seen.append(group)
        return real(layout, None)  # the sentinel group is recorded, not used for communication

    monkeypatch.setattr(logit_loss, "with_data_parallel", spy)
    logits, data, _ = make_batch(11, dtype=torch.float64)
    x = logits.detach().clone().requires_grad_(True)
    loss, _ = LogitClippedPGLoss(ClippedPGLoss(LOSS_CONFIGS["nemo_rl_default"]), chunk_size=7)(
        x, data, *global_counts(data), **group_kwargs
    )
    loss.backward()
    return loss.detach(), x.grad, seen


def test_every_entry_point_names_the_group_dp_group():
    entry_points = (
        LogitClippedPGLoss.__call__,
        fused_linear_loss.fused_linear_pg_loss,
        slime_entry_points.slime_term_inputs,
    )
    for fn in entry_points:
        assert "dp_group" in inspect.signature(fn).parameters, fn


def test_the_deprecated_name_reaches_the_same_reduction_and_warns(monkeypatch):
    group = object()
    want_loss, want_grad, seen = _call(monkeypatch, dp_group=group)
    assert seen == [group]
    with pytest.warns(DeprecationWarning, match="dp_group"):
        loss, grad, seen = _call(monkeypatch, data_parallel_group=group)
    assert seen == [group]
    assert torch.equal(loss, want_loss) and torch.equal(grad, want_grad)


def test_both_names_at_once_are_refused(monkeypatch):
    with pytest.raises(TypeError, match="dp_group"):
        _call(monkeypatch, dp_group=object(), data_parallel_group=object())
