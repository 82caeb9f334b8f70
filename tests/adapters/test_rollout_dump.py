"""Dumping rollouts from inside training: the NeMo-RL and verl hooks, modelled by their host calls (the batch each
host holds at that point), give a dump that ``diagnose`` reads, with the loss's own numbers; opt-in; one host copy."""

from __future__ import annotations

import collections
import types

import pytest
import torch
from torch.overrides import TorchFunctionMode

from nemo_is_plugin.adapters import nemo_rl, verl
from nemo_is_plugin.adapters.rollout_dump import _DUMPERS, DUMP_ENV, EVERY_ENV, RolloutDumper
from nemo_is_plugin.apps.diagnose import diagnose, read_dump
from nemo_is_plugin.loss import ClippedPGLoss


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv(DUMP_ENV, raising=False)
    monkeypatch.delenv(EVERY_ENV, raising=False)
    _DUMPERS.clear()
    yield
    _DUMPERS.clear()


def nemo_rl_train_data(seed: int = 0, b: int = 5, s: int = 12):
    """What grpo_train holds after ``train_data["prev_logprobs"] = fprop_logprobs``: [B, S] tensors, a 3-token
    prompt, right padding, and one padding sample (sample_mask 0). NeMo-RL's BatchedDataDict is a UserDict."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 9, 2, 7, 4])[:b]
    pos = torch.arange(s)[None]
    token_mask = ((pos >= 3) & (pos < 3 + lengths[:, None])).float()
    prev = -torch.rand(b, s, generator=g) - 0.05
    gen = prev - 0.05 * torch.randn(b, s, generator=g)
    gen = torch.where(token_mask.bool(), gen.clamp(max=-1e-3), torch.full_like(gen, float("nan")))  # junk on padding
    adv = torch.randn(b, 1, generator=g).expand(b, s).contiguous()
    data = collections.UserDict(
        prev_logprobs=prev,
        generation_logprobs=gen,
        token_mask=token_mask,
        advantages=adv,
        sample_mask=torch.tensor([1.0, 1, 1, 0, 1]),
    )
    return data, torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])


def test_nemo_rl_hook_is_off_by_default(tmp_path):
    data, rewards = nemo_rl_train_data()
    assert nemo_rl.dump_rollouts(data, step=0, rewards=rewards) == 0
    assert list(tmp_path.iterdir()) == []


def test_nemo_rl_hook_writes_what_diagnose_reads_with_the_loss_numbers(tmp_path, monkeypatch):
    path = tmp_path / "dump" / "rollouts.jsonl"
    monkeypatch.setenv(DUMP_ENV, str(path))
    data, rewards = nemo_rl_train_data()
    assert nemo_rl.dump_rollouts(data, step=0, rewards=rewards) == 4  # the padding sample is left out
    assert nemo_rl.dump_rollouts(data, step=1, rewards=rewards) == 4  # appended
    dump = read_dump(path)
    assert dump.num_responses == 8 and dump.step.tolist() == [0] * 4 + [1] * 4
    assert dump.sample_id.tolist() == list(range(8)) and dump.reward.tolist()[:4] == [1.0, 0.0, 1.0, 0.0]
    assert dump.valid_lengths.tolist()[:4] == [5, 9, 2, 4]  # prompts and padding are not in the records
    keep = data["sample_mask"].bool()
    assert dump.advantage[:4].tolist() == pytest.approx(data["advantages"][keep, 0].tolist(), abs=1e-6)
    # diagnose on the dump sees the mismatch the loss logs on the same batch
    x = data["prev_logprobs"][:, 1:].clone()
    _, metrics = ClippedPGLoss({"reference_policy_kl_penalty": 0.0})(
        next_token_logprobs=x,
        data={**data, "generation_logprobs": torch.nan_to_num(data["generation_logprobs"])},
        global_valid_seqs=keep.sum(),
        global_valid_toks=(data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum(),
    )
    report = diagnose(path, steps=[0], levels=("token",), truncations=("none",), dtype="float64")
    assert report.analysis.mismatch["mismatch_kl_k3"] == pytest.approx(metrics["mismatch_kl_k3"], rel=1e-4)
    assert report.analysis.mismatch["mismatch_kl_k1"] == pytest.approx(metrics["mismatch_kl_k1"], rel=1e-4, abs=1e-7)


def test_every_k_th_step_and_gzip(tmp_path, monkeypatch):
    path = tmp_path / "r.jsonl.gz"
    monkeypatch.setenv(DUMP_ENV, str(path))
    monkeypatch.setenv(EVERY_ENV, "2")
    data, rewards = nemo_rl_train_data()
    written = [nemo_rl.dump_rollouts(data, step=k, rewards=rewards) for k in range(4)]
    assert written == [4, 0, 4, 0]
    assert read_dump(path).step.tolist() == [0] * 4 + [2] * 4  # two gzip members read as one stream


def test_an_explicit_path_needs_no_environment(tmp_path):
    data, rewards = nemo_rl_train_data()
    assert nemo_rl.dump_rollouts(data, step=3, path=tmp_path / "x.jsonl") == 4
    assert read_dump(tmp_path / "x.jsonl").reward is None  # no rewards given, none written


def verl_batch(seed: int = 1, b: int = 4, t: int = 8):
    """verl's DataProto after compute_advantage in RayPPOTrainer.fit: ``.batch`` holds [B, T] response tensors."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(t)[None] < torch.tensor([8, 3, 6, 1])[:b, None]).long()
    old = -torch.rand(b, t, generator=g) - 0.05
    rollout = (old + 0.02 * torch.randn(b, t, generator=g)).clamp(max=-1e-3)
    scores = torch.zeros(b, t)
    scores[torch.arange(b), mask.sum(1) - 1] = torch.tensor([1.0, 0.0, 0.5, 1.0])[:b]
    tensors = {
        "old_log_probs": old,
        "rollout_log_probs": rollout,
        "response_mask": mask,
        "advantages": torch.randn(b, t, generator=g),
        "token_level_scores": scores,
    }
    return types.SimpleNamespace(batch=tensors)


def test_verl_hook_writes_the_response_tensors(tmp_path, monkeypatch):
    monkeypatch.setenv(DUMP_ENV, str(tmp_path / "v.jsonl"))
    batch = verl_batch()
    assert verl.dump_rollouts(batch, step=7) == 4
    dump = read_dump(tmp_path / "v.jsonl")
    assert dump.valid_lengths.tolist() == [8, 3, 6, 1] and dump.reward.tolist() == [1.0, 0.0, 0.5, 1.0]
    m = batch.batch["response_mask"].bool()
    assert dump.prev_logprobs.tolist() == pytest.approx(batch.batch["old_log_probs"][m].tolist(), abs=1e-6)
    assert dump.generation_logprobs.tolist() == pytest.approx(batch.batch["rollout_log_probs"][m].tolist(), abs=1e-6)


def test_verl_hook_without_rollout_log_probs_names_the_key(tmp_path):
    batch = verl_batch()
    del batch.batch["rollout_log_probs"]
    with pytest.raises(KeyError, match="rollout_log_probs"):
        verl.dump_rollouts(batch, step=0, path=tmp_path / "v.jsonl")


class _HostCalls(TorchFunctionMode):
    """Records the tensor methods that copy to the host or synchronise."""

    SYNCS = {"item", "tolist", "__bool__", "__float__", "__int__", "cpu", "nonzero"}

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        kwargs = kwargs or {}
        if name in self.SYNCS or (name == "to" and "cpu" in map(str, [*args[1:], *kwargs.values()])):
            self.calls.append(name)
        return func(*args, **kwargs)


def test_one_host_copy_per_dump(tmp_path):
    data, rewards = nemo_rl_train_data()
    dumper = RolloutDumper(tmp_path / "d.jsonl")
    with _HostCalls() as mode:
        dumper.write(
            data["prev_logprobs"],
            data["generation_logprobs"],
            data["token_mask"],
            step=0,
            advantages=data["advantages"],
            rewards=rewards,
        )
    assert mode.calls == ["to"]


def test_bad_every_is_refused(tmp_path):
    with pytest.raises(ValueError, match="every=0"):
        RolloutDumper(tmp_path / "d.jsonl", every=0)
