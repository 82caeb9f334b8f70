"""Single-process checks of the plumbing: None groups mean no communication, explicit groups are the ones used
(a recording fake, as Megatron's tests do), DP metric combination, the PP broadcast without a pipeline."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

from nemo_is_plugin.distributed.head.vocab_parallel import vocab_parallel_logprobs
from nemo_is_plugin.distributed.parallel.collectives import all_gather, all_reduce_max, all_reduce_sum
from nemo_is_plugin.distributed.parallel.context_parallel import cp_layout
from nemo_is_plugin.distributed.parallel.cp_sharding import local_tokens, num_chunks, shard_padded
from nemo_is_plugin.distributed.parallel.data_parallel import all_reduce_metrics, combine_metrics, global_valid_counts
from nemo_is_plugin.distributed.parallel.groups import ParallelGroups, group_rank, group_size
from nemo_is_plugin.distributed.parallel.pipeline import broadcast_metrics_from_last_stage
from nemo_is_plugin.loss.layout import TokenLayout


def test_none_groups_are_a_single_process():
    g = ParallelGroups()
    assert (g.tp_size, g.tp_rank, g.cp_size, g.cp_rank, g.dp_size) == (1, 0, 1, 0, 1)
    assert group_size(None) == 1 and group_rank(None) == 0
    x = torch.randn(3, requires_grad=True)
    assert all_reduce_sum(x, None) is x and all_gather(x, None) is x
    assert not all_reduce_max(x, None).requires_grad


def test_from_parallel_state_without_initialisation_is_all_none(monkeypatch):
    class Uninitialised:
        @staticmethod
        def model_parallel_is_initialized():
            return False

    monkeypatch.delitem(sys.modules, "megatron.core.parallel_state", raising=False)
    assert ParallelGroups.from_parallel_state() == ParallelGroups()  # megatron never imported: nothing initialised
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", Uninitialised)
    assert ParallelGroups.from_parallel_state() == ParallelGroups()


def test_from_parallel_state_without_megatron_core_names_the_extra(monkeypatch):
    """megatron-core is the `megatron` extra: asking for its groups where it is not installed is a one-line error
    naming the extra (an ImportError), not a silent single process (the clean-install test checks a real venv)."""
    from nemo_is_plugin.common.extras import MissingExtraError

    monkeypatch.delitem(sys.modules, "megatron.core.parallel_state", raising=False)
    monkeypatch.setitem(sys.modules, "megatron", None)  # `import megatron` raises: not installed
    with pytest.raises(MissingExtraError) as exc:
        ParallelGroups.from_parallel_state()
    assert str(exc.value) == (
        "groups='parallel_state' (megatron-core's parallel_state groups) needs the 'megatron' extra (megatron not "
        "installed): pip install 'nemo-is-plugin[megatron]'"
    )


def test_cp_layout_without_cp_is_the_plain_layout():
    padded = cp_layout(None, num_seqs=2, seq_len=6)
    assert type(padded) is TokenLayout and padded.is_padded and padded.shape == (2, 6)
    packed = cp_layout(None, cu_seqlens_padded=[0, 4, 10])
    assert type(packed) is TokenLayout and packed.position.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="num_seqs"):
        cp_layout(None)


def test_sharding_rejects_lengths_that_do_not_split_into_chunks():
    assert num_chunks(2, "load_balanced") == 4 and num_chunks(2, "contiguous") == 2
    with pytest.raises(ValueError, match="multiple of 4"):
        local_tokens([6], 0, 2, "load_balanced")
    with pytest.raises(ValueError, match="unknown context-parallel order"):
        shard_padded(torch.zeros(1, 8), 0, 2, "zigzag")


class _RecordingGroup:
    """Stands for a 2-rank group whose other rank contributes zeros (SUM) or nothing larger (MAX)."""


@pytest.fixture
def recording(monkeypatch):
    calls = []

    def all_reduce(tensor, op=None, group=None):
        calls.append((group, op))

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2 if isinstance(group, _RecordingGroup) else 1)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    return calls


def test_vocab_parallel_uses_exactly_the_given_group(recording):
    group = _RecordingGroup()
    logits, target = torch.randn(5, 4), torch.tensor([0, 1, 2, 3, 0])
    lp = vocab_parallel_logprobs(logits, target, group, chunk_size=2)
    # rank 0 owns ids [0, 4): with the other shard empty the answer is the single-process one
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).gather(-1, target[:, None]).squeeze(-1))
    assert [g for g, _ in recording] == [group, group]  # one MAX, one stacked SUM per call, not per chunk
    assert [op for _, op in recording] == [dist.ReduceOp.MAX, dist.ReduceOp.SUM]


def test_combine_metrics_sums_and_takes_extremes():
    out = combine_metrics([{"loss": 1.0, "w_min": 0.5, "w_max": 2.0}, {"loss": 2.5, "w_min": 0.2, "w_max": 1.5}])
    assert out == {"loss": 3.5, "w_min": 0.2, "w_max": 2.0}
    assert all_reduce_metrics(out, None) == out


def test_global_valid_counts_follow_nemo_rl():
    token_mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0]])
    sample_mask = torch.tensor([1.0, 0.0])
    seqs, toks = global_valid_counts(token_mask, sample_mask, None)
    assert seqs.item() == 1.0 and toks.item() == 2.0  # token_mask[:, 1:] of the kept sample


def test_pipeline_broadcast_without_pipeline_returns_the_metrics():
    assert broadcast_metrics_from_last_stage({"loss": 1.0}, ParallelGroups()) == {"loss": 1.0}
    with pytest.raises(ValueError, match="last stage"):
        broadcast_metrics_from_last_stage(None, ParallelGroups())
