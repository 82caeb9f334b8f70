"""The host heads under the CPU device guard (helpers/device_guard.py): NeMo-RL's drop-in (padded and packed, with
``inference_only``), verl's drop-in and the sequence head's label maps create no tensor without the inputs' device,
equal the unguarded run bit for bit, and read nothing back from the device but packed offsets given as a tensor (one
read per call: the packed maps are built from host ints)."""

from __future__ import annotations

import pytest
import torch
from helpers.device_guard import assert_identical, count_host_syncs, run_guarded_and_plain

from nemo_is_plugin.adapters.nemo_rl.head import from_parallel_hidden_states_to_logprobs
from nemo_is_plugin.adapters.verl.head import linear_cross_entropy
from nemo_is_plugin.distributed.head.sequence_head import SequenceLayout, local_next_labels, unpack_next_token_logprobs

H, V = 8, 23


def _inputs(seq: int, batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(seq, batch, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    return hidden, weight, torch.randint(0, V, (batch, seq), generator=g)


def _nemo_rl_call(hidden, weight, labels, **kw):
    def run():
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        with count_host_syncs() as syncs:
            lp = from_parallel_hidden_states_to_logprobs(h, w, None, labels, 0, V, None, **kw)
        if lp.requires_grad:
            lp.square().sum().backward()
        return (lp.detach(), h.grad, w.grad), len(syncs)

    return run


def test_nemo_rl_drop_in_padded_is_device_clean():
    (got, syncs), (want, _) = run_guarded_and_plain(_nemo_rl_call(*_inputs(7, 3)))
    assert_identical(got, want)
    assert syncs == 0


@pytest.mark.parametrize("as_list", [True, False], ids=["cu_list", "cu_tensor"])
def test_nemo_rl_drop_in_packed_is_device_clean(as_list):
    cu = [0, 3, 3, 10]
    call = _nemo_rl_call(*_inputs(10, 1), cu_seqlens_padded=cu if as_list else torch.tensor(cu), unpacked_seqlen=8)
    (got, syncs), (want, _) = run_guarded_and_plain(call)
    assert_identical(got, want)
    assert syncs == (0 if as_list else 1)  # one read of a tensor of offsets, shared by the maps and the unpacking


def test_nemo_rl_drop_in_inference_only_is_device_clean():
    (got, syncs), (want, _) = run_guarded_and_plain(_nemo_rl_call(*_inputs(7, 3), inference_only=True))
    assert_identical(got, want)
    assert got[1] is None and syncs == 0


def test_verl_drop_in_is_device_clean():
    hidden, weight, labels = _inputs(9, 1)

    def run():
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        with count_host_syncs() as syncs:
            lp, ent = linear_cross_entropy(h, w, labels, 0.7)
        (lp.sum() + ent.square().sum()).backward()
        return (lp.detach(), ent.detach(), h.grad, w.grad), len(syncs)

    (got, syncs), (want, _) = run_guarded_and_plain(run)
    assert_identical(got, want)
    assert syncs == 0


def test_label_maps_are_device_clean():
    labels = torch.arange(12).reshape(1, 12)

    def run():
        layout = SequenceLayout.build([0, 4, 12])
        rolled = local_next_labels(labels, layout, 12)
        unpacked = unpack_next_token_logprobs(rolled[0].double(), [0, 4, 12], 6)
        return rolled, unpacked

    got, want = run_guarded_and_plain(run)
    assert_identical(got, want)
    assert got[0].tolist() == [[1, 2, 3, 0, 5, 6, 7, 8, 9, 10, 11, 4]]  # rolled within each sequence
    assert got[1].tolist() == [[1.0, 2.0, 3.0, 0.0, 0.0], [5.0, 6.0, 7.0, 8.0, 9.0]]
