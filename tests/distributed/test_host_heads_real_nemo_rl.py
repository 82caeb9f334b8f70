"""The plugin's head against NeMo-RL's real code, where NeMo-RL imports: an installed ``nemo_rl``, or a checkout named
by ``NEMO_RL_PATH`` (the directory holding ``nemo_rl/``; its ``nemo_rl.distributed.model_utils`` imports with torch
alone). Skipped otherwise (CI has neither; tests/adapters/nemo_rl_head_host.py models NeMo-RL's head there).

- the patch accepts the real module: the function, its signature and its by-name call from
  ``_gpt_forward_with_linear_ce_fusion`` are what the plugin was written for;
- on 2 gloo ranks, NeMo-RL's own ``from_parallel_hidden_states_to_logprobs`` and the plugin's drop-in, TP = 1 and
  TP = 2 with sequence parallelism, fp32: log-probs, each rank's dX rows and dW shard agree to 1e-5.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch
import torch.distributed as dist

from nemo_is_plugin.adapters.nemo_rl import head as nemo_rl_head
from nemo_is_plugin.apps.bench.problem import vocab_shard

WORLD = 2
GROUPS: dict[str, object] = {}
S, B, H, V = 8, 3, 32, 38


def _nemo_rl_model_utils():
    path = os.environ.get("NEMO_RL_PATH")
    if path and path not in sys.path:
        sys.path.insert(0, path)
    try:
        return importlib.import_module(nemo_rl_head.TARGET_MODULE)
    except ImportError:
        return None


def setup_workers(rank: int, world_size: int) -> None:
    GROUPS["pair"] = dist.new_group(list(range(world_size)))
    GROUPS["self"] = [dist.new_group([r]) for r in range(world_size)][rank]


def _rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _compare(tp: int):
    def check(rank: int, world: int) -> None:
        module = _nemo_rl_model_utils()
        assert module is not None
        theirs = getattr(module, nemo_rl_head.ORIGINAL_ATTR, None) or module.from_parallel_hidden_states_to_logprobs
        group = GROUPS["pair"] if tp == 2 else GROUPS["self"]
        g = torch.Generator().manual_seed(0)
        hidden, weight = torch.randn(S, B, H, generator=g), torch.randn(V, H, generator=g) * 0.3
        labels, coef = torch.randint(0, V, (B, S), generator=g), torch.randn(B, S - 1, generator=g)
        tp_rank = rank if tp == 2 else 0
        rows = slice(tp_rank * S // tp, (tp_rank + 1) * S // tp)
        per = V // tp
        out = []
        for fn, kw in ((theirs, {"chunk_size": 3}), (nemo_rl_head.from_parallel_hidden_states_to_logprobs, {})):
            h = hidden[rows].clone().requires_grad_(True)
            w = vocab_shard(weight, tp_rank, tp).clone().requires_grad_(True)
            lp = fn(h, w, None, labels, tp_rank * per, (tp_rank + 1) * per, group, **kw)
            (lp * coef).sum().backward()
            out.append((lp.detach(), h.grad, w.grad))
        for got, want in zip(out[1], out[0]):
            assert _rel(got, want) < 1e-5

    return check


CHECKS = [("real_nemo_rl_tp1", _compare(1)), ("real_nemo_rl_tp2_sp", _compare(2))]


def test_the_patch_accepts_the_real_nemo_rl():
    module = _nemo_rl_model_utils()
    if module is None:
        pytest.skip("NeMo-RL is not importable here (install it, or set NEMO_RL_PATH to a checkout)")
    nemo_rl_head.check_target(module)  # raises HostPatchError on any mismatch


@pytest.mark.parametrize("name", [name for name, _ in CHECKS])
def test_the_plugin_head_equals_nemo_rl_real_head(request, name):
    if _nemo_rl_model_utils() is None:
        pytest.skip("NeMo-RL is not importable here (install it, or set NEMO_RL_PATH to a checkout)")
    results = request.getfixturevalue("gloo_results")
    assert results[name] is None, results[name]
