"""``NEMO_IS_NEMO_RL_HEAD=1`` never stays on without effect: the plugin's NeMo-RL loss stops the run at its first call
when NeMo-RL's fused log-prob function in the process is NeMo-RL's own (the start-up hook did not run: another
sitecustomize first, its folder not on PYTHONPATH, ``python -I`` / ``-E``, an error swallowed by site.py). NeMo-RL's
module is modelled by a module object holding a function of the same name (its import is what the hook patches)."""

from __future__ import annotations

import sys
from types import ModuleType

import pytest
import torch
from distributed._loss_cases import LOSS_CONFIGS, global_counts, make_batch

from nemo_is_plugin.adapters.nemo_rl import NeMoRLLossFn
from nemo_is_plugin.adapters.nemo_rl import head as nemo_rl_head
from nemo_is_plugin.adapters.nemo_rl.startup import (
    SWITCH_ENV,
    TARGET,
    TARGET_MODULE,
    SwitchNotInEffectError,
    check_switch_in_effect,
)


def _nemo_rl_module(fn) -> ModuleType:
    module = ModuleType(TARGET_MODULE)
    setattr(module, TARGET, fn)
    return module


def _own_head(*args, **kwargs):  # NeMo-RL's function, unpatched
    raise AssertionError("not called")


def _loss_call():
    logits, data, _ = make_batch(21)
    lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, data["input_ids"][:, 1:, None]).squeeze(-1)
    return NeMoRLLossFn(LOSS_CONFIGS[sorted(LOSS_CONFIGS)[0]])(lp, data, *global_counts(data))


def test_the_names_match_the_head_module():
    assert (SWITCH_ENV, TARGET_MODULE, TARGET) == (
        nemo_rl_head.SWITCH_ENV,
        nemo_rl_head.TARGET_MODULE,
        nemo_rl_head.TARGET,
    )


def test_switch_on_with_nemo_rl_own_head_stops_the_first_loss_call(monkeypatch):
    monkeypatch.setenv(SWITCH_ENV, "1")
    monkeypatch.setitem(sys.modules, TARGET_MODULE, _nemo_rl_module(_own_head))
    monkeypatch.setattr(sys, "_nemo_is_after_import_callbacks", {}, raising=False)  # the hook never ran here
    with pytest.raises(SwitchNotInEffectError) as stopped:
        _loss_call()
    message = str(stopped.value)
    assert "\n" not in message
    assert "start-up hook did not run" in message and "head_check nemo-rl" in message and "PYTHONPATH" in message
    monkeypatch.setattr(sys, "_nemo_is_after_import_callbacks", {TARGET_MODULE: {}})
    with pytest.raises(SwitchNotInEffectError, match="registered but did not patch"):
        check_switch_in_effect()


def test_the_loss_runs_when_the_switch_is_in_effect_or_off(monkeypatch):
    monkeypatch.setitem(
        sys.modules, TARGET_MODULE, _nemo_rl_module(nemo_rl_head.from_parallel_hidden_states_to_logprobs)
    )
    monkeypatch.setenv(SWITCH_ENV, "1")
    loss, _ = _loss_call()  # the plugin's head is in place
    assert torch.isfinite(loss)
    monkeypatch.setitem(sys.modules, TARGET_MODULE, _nemo_rl_module(_own_head))
    for off in ("0", ""):
        monkeypatch.setenv(SWITCH_ENV, off)
        assert torch.isfinite(_loss_call()[0])  # switch off: NeMo-RL's own head is what the user asked for
    monkeypatch.setenv(SWITCH_ENV, "1")
    monkeypatch.delitem(sys.modules, TARGET_MODULE)
    assert torch.isfinite(_loss_call()[0])  # NeMo-RL's module not imported (yet): nothing to check
