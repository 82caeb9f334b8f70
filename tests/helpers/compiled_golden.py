"""The golden suites through the compiled epilogue (nemo_is_plugin/loss/compiled.py): tests/test_compiled_golden_*.py.

Each golden suite's own check runs unchanged with the loss it builds replaced by that loss's :class:`CompiledLoss`
(:func:`compiled_suite`: the suite module's ``build_loss_fn``, or the verl adapter's ``run_loss``, swapped with
pytest's ``monkeypatch``), so the compiled loss answers to the suite's stated tolerances, not to a copy of them.

Backends: ``"aot_eager"`` (dynamo + AOTAutograd + functionalization, the aten graph run as is: the sweep, seconds per
config) and ``"inductor"`` (generated C++ kernels: the sample, 30-240 s per config on the project's 2-core machine).
One CompiledLoss per (backend, config) per session: golden cases of one config share its compile, so they also check
that a config's shapes (batch and sequence lengths differ between cases) reuse it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from nemo_is_plugin import build_loss_fn
from nemo_is_plugin.adapters.verl import policy_loss
from nemo_is_plugin.loss.compiled import CompiledLoss
from tools.launch_count import compiled_graphs_counted

SWEEP_BACKEND = "aot_eager"
_LOSSES: dict[tuple[str, str], CompiledLoss] = {}


def compiled_loss(loss: Any, backend: str) -> CompiledLoss:
    """The session's CompiledLoss of ``loss``'s config on ``backend`` (built, and so compiled, once)."""
    key = (backend, repr(loss.config))
    if key not in _LOSSES:
        _LOSSES[key] = CompiledLoss(loss) if backend == "inductor" else CompiledLoss(loss, backend=backend)
    return _LOSSES[key]


@contextmanager
def compiled_suite(monkeypatch: pytest.MonkeyPatch, suite: Any, backend: str) -> Iterator[list[CompiledLoss]]:
    """Within the block the golden suite module ``suite`` builds compiled losses: its ``build_loss_fn`` returns the
    config's CompiledLoss (called like the eager loss; ``compute`` compiled too). Yields the losses used; on exit
    each must still be compiled (not fallen back to the eager loss after a graph break)."""
    used: list[CompiledLoss] = []

    def build(config: Any) -> CompiledLoss:
        used.append(compiled_loss(build_loss_fn(config), backend))
        return used[-1]

    with monkeypatch.context() as patch:
        patch.setattr(suite, "build_loss_fn", build)
        yield used
    assert used and all(loss.compiled.compiled is not None for loss in used)


@contextmanager
def compiled_verl_adapter(monkeypatch: pytest.MonkeyPatch, backend: str) -> Iterator[list[CompiledLoss]]:
    """Within the block the verl adapter (``VerlPolicyLoss``) runs its loss compiled: the loss, its gradient and every
    plugin metric (renormalised and renamed by the adapter as usual) come from the config's CompiledLoss. The
    adapter's own statistics read with the metrics (verl's ``rollout_corr/`` and score-centering head masses: not the
    loss epilogue, ``adapters/verl/policy_call.py``) stay the eager run's."""
    used: list[CompiledLoss] = []
    eager_run = policy_loss.run_loss

    def run(loss_fn: Any, inputs: Any, layout: Any, own: dict[str, torch.Tensor], reads_mu: bool) -> Any:
        with torch.no_grad():  # only the statistics the epilogue does not compute are taken from it
            eager = eager_run(loss_fn, _detached(inputs), layout, own, reads_mu)
        used.append(compiled_loss(loss_fn, backend))
        loss, metrics = used[-1].compute(inputs, layout)
        return dataclasses.replace(eager, loss=loss, metrics=metrics)

    with monkeypatch.context() as patch:
        patch.setattr(policy_loss, "run_loss", run)
        yield used
    assert used and all(loss.compiled.compiled is not None for loss in used)


def graphs_of(loss: CompiledLoss) -> int:
    """The graphs dynamo holds for ``loss``'s epilogue (its code object's cache entries): one per input structure
    (dtypes, which optional inputs are given), none added as batch or sequence lengths change."""
    return len(_debug_get_cache_entry_list(loss.code))


@contextmanager
def graph_outside_modes(loss: CompiledLoss) -> Iterator[None]:
    """Within the block ``loss``'s compiled graphs run with the dispatch and torch-function modes switched off (dynamo
    refuses to trace under a counting dispatch mode such as helpers.device_guard's, and a function mode fails its
    guards: a recompile): what is counted is what runs around the graphs (tools/launch_count.py's
    ``compiled_graphs_counted``, which also tallies the graphs' kernels)."""
    assert loss.compiled.compiled is not None
    with compiled_graphs_counted():
        yield


def _detached(inputs: Any) -> Any:
    """``inputs`` with every tensor, also those of a dataclass field (the head), detached."""
    if isinstance(inputs, torch.Tensor):
        return inputs.detach()
    if dataclasses.is_dataclass(inputs) and not isinstance(inputs, type):
        fields = {f.name: _detached(getattr(inputs, f.name)) for f in dataclasses.fields(inputs)}
        return dataclasses.replace(inputs, **fields)
    return inputs


def sample_params(cases: list[dict], default_ids: set[str], mark: Any) -> list[Any]:
    """``cases`` as pytest params: those in ``default_ids`` plain, the others with ``mark`` (the opt-in sweep)."""
    found = {c["id"] for c in cases} & default_ids
    assert found == default_ids, f"sample ids not in the suite: {sorted(default_ids - found)}"
    return [pytest.param(c, id=c["id"], marks=() if c["id"] in default_ids else mark) for c in cases]


def assert_same_metrics(got: Mapping[str, float], want: Mapping[str, float], rtol: float, atol: float) -> None:
    """The same metric names in the same order, each value within ``atol + rtol * |want|`` (NaN equals NaN)."""
    assert list(got) == list(want)
    bad = {
        k: (got[k], w)
        for k, w in want.items()
        if not (got[k] == w or (got[k] != got[k] and w != w) or abs(got[k] - w) <= atol + rtol * abs(w))
    }
    assert not bad, bad
