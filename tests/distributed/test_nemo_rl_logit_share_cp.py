"""NeMo-RL's LOGIT call under context parallelism (2 gloo ranks, spawned once), float64 logits, both CP orders: the
plugin's extrema reported for NeMo-RL's step (``<stem>/{min,max}_mb_mean``: the call's extremum times its share of the
step's valid sequences) are the single-process values on every CP rank. The share is a metric sum of the call's
device tensors, reduced over CP with the loss's metrics and read in their one host read (no ``float`` of
``global_valid_seqs``): each rank contributes its CP part of the valid-sequence count, so the reduced share is the
call's share once, not CP times it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nemo_is_plugin.adapters.nemo_rl import NeMoRLLossFn
from nemo_is_plugin.adapters.nemo_rl.step_metrics import is_summed_extremum, micro_batch_mean_name
from nemo_is_plugin.distributed.parallel.cp_sharding import CP_ORDERS, shard_padded

from ._loss_cases import LOSS_CONFIGS, make_batch

WORLD = 2
CONFIGS = ("ctpo_cumulative_is", "seq_mis_veto")


def check_share(rank: int, world: int) -> None:
    logits, data, _ = make_batch(31, num_seqs=4, seq_len=12, dtype=torch.float64)
    seqs, toks = torch.tensor(7.0, dtype=torch.float64), torch.tensor(40.0, dtype=torch.float64)
    for name in CONFIGS:
        fn = NeMoRLLossFn(LOSS_CONFIGS[name], input_type="logit", host_divides_by_cp=False)
        _, want = fn(logits=logits, data=data, global_valid_seqs=seqs, global_valid_toks=toks)
        assert fn._logit_loss is not None
        _, raw = fn._logit_loss(logits, data, 7.0, 40.0)
        share = float(data["sample_mask"].sum()) / 7.0
        extrema = [k for k in raw if is_summed_extremum(k)]
        assert extrema and 0 < share < 1
        for k in extrema:
            assert want[micro_batch_mean_name(k)] == raw[k] * share, k
        for order in CP_ORDERS:
            sharded = NeMoRLLossFn(LOSS_CONFIGS[name], input_type="logit", host_divides_by_cp=False, cp_order=order)
            _, got = sharded(
                logits=shard_padded(logits, rank, world, order),
                data=data,
                global_valid_seqs=seqs,
                global_valid_toks=toks,
                context_parallel_group=dist.group.WORLD,
            )
            for k in extrema:
                mb = micro_batch_mean_name(k)
                assert got[mb] == pytest.approx(want[mb], rel=1e-12, abs=1e-15), (name, order, mb)


CHECKS = [("share", check_share)]


@pytest.mark.parametrize("name", [name for name, _ in CHECKS])
def test_nemo_rl_logit_extrema_under_cp(gloo_results, name):
    assert name in gloo_results, f"check {name} did not run"
    assert gloo_results[name] is None, gloo_results[name]
