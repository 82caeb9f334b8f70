"""NeMo-RL's fused log-prob function on the plugin's head, one process (TP = 1; TP = 2, CP and sequence parallelism:
tests/distributed/test_host_heads_tp.py):

- the replacement returns what NeMo-RL's function returns (``tests/adapters/nemo_rl_head_host.py``, a model of it):
  log-probs, dX and dW, fp64 to 1e-12 and fp32 to 1e-5, with the target roll, ``inference_only`` (no graph) and a
  target outside the vocabulary (0, with NeMo-RL's gradient of -lse); packed sequences equal a per-sequence float64
  reference;
- the patch: it replaces the function NeMo-RL's fused forward looks up by name (and nothing else), keeps the original,
  is idempotent, and refuses a NeMo-RL whose function is missing, has another signature or is no longer called by
  name; the switch installs it on import of NeMo-RL's module (or at once when it is imported), a refused patch fails
  that import, and without the switch nothing is installed.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
from helpers.fake_nemo_rl_head import MODEL, drop_nemo_rl_modules, write_fake_nemo_rl

from adapters import nemo_rl_head_host as host
from nemo_is_plugin.adapters.nemo_rl import head
from nemo_is_plugin.adapters.nemo_rl.head import HostPatchError, from_parallel_hidden_states_to_logprobs

S, B, H, V = 9, 3, 16, 37


def _problem(dtype=torch.float64, seed=0, logit_std=3.0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(S, B, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * (logit_std / H**0.5)
    labels = torch.randint(0, V, (B, S), generator=g)
    coef = torch.randn(B, S - 1, generator=g, dtype=torch.float64)
    return hidden.to(dtype), weight.to(dtype), labels, coef.to(dtype)


def _run(fn, hidden, weight, labels, coef, **kw):
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp = fn(h, w, None, labels, 0, V, None, **kw)
    (lp * coef).sum().backward()
    return lp.detach(), h.grad, w.grad


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("chunk", [2, 256])
def test_replacement_equals_nemo_rl_log_probs_and_gradients(dtype, tol, chunk):
    hidden, weight, labels, coef = _problem(dtype)
    want = _run(host.from_parallel_hidden_states_to_logprobs, hidden, weight, labels, coef, chunk_size=chunk)
    got = _run(from_parallel_hidden_states_to_logprobs, hidden, weight, labels, coef, chunk_size=chunk)
    assert got[0].shape == (B, S - 1) and got[0].dtype == want[0].dtype
    assert (got[0] < 0).all()
    for g, w in zip(got, want):
        assert _rel(g, w) < tol


def test_inference_only_builds_no_graph_and_gives_the_same_values():
    hidden, weight, labels, _ = _problem()
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    got = from_parallel_hidden_states_to_logprobs(h, w, None, labels, 0, V, None, inference_only=True)
    want = host.from_parallel_hidden_states_to_logprobs(hidden, weight, None, labels, 0, V, None, chunk_size=4)
    assert not got.requires_grad and got.grad_fn is None
    assert _rel(got, want) < 1e-12


def test_a_target_no_rank_owns_gives_nemo_rl_s_value_and_gradient():
    """NeMo-RL returns 0 there but back-propagates the gradient of -lse (its onehot is 0, its softmax is not)."""
    hidden, weight, labels, coef = _problem()
    labels[0, 3] = V + 5  # position 2 scores it
    want = _run(host.from_parallel_hidden_states_to_logprobs, hidden, weight, labels, coef, chunk_size=4)
    got = _run(from_parallel_hidden_states_to_logprobs, hidden, weight, labels, coef)
    assert got[0][0, 2] == 0.0 and want[0][0, 2] == 0.0
    assert got[1][2, 0].abs().max() > 0.0
    for g, w in zip(got, want):
        assert _rel(g, w) < 1e-12


def test_a_vocab_range_that_does_not_match_the_weight_shard_is_refused():
    hidden, weight, labels, _ = _problem()
    with pytest.raises(ValueError, match="padded vocabulary"):
        from_parallel_hidden_states_to_logprobs(hidden, weight, None, labels, 0, V - 1, None)


def test_packed_sequences_are_rolled_per_sequence_and_unpacked():
    g = torch.Generator().manual_seed(3)
    cu, max_len = [0, 4, 4, 10, 16], 7  # an empty sequence, and one longer than max_len
    hidden = torch.randn(16, 1, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (1, 16), generator=g)
    got = from_parallel_hidden_states_to_logprobs(
        hidden, weight, None, labels, 0, V, None, cu_seqlens_padded=torch.tensor(cu), unpacked_seqlen=max_len
    )
    logp = torch.log_softmax(hidden[:, 0] @ weight.t(), dim=-1)
    want = torch.zeros(len(cu) - 1, max_len - 1, dtype=torch.float64)
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        n = min(b - a - 1, max_len - 1)
        if n > 0:
            want[i, :n] = logp[a : a + n].gather(-1, labels[0, a + 1 : a + 1 + n, None]).squeeze(-1)
    assert got.shape == want.shape and _rel(got, want) < 1e-12
    packed = from_parallel_hidden_states_to_logprobs(hidden, weight, None, labels, 0, V, None, cu_seqlens_padded=cu)
    assert packed.shape == (1, 16)  # without unpacked_seqlen: packed, each sequence's last position kept
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        n = min(b - a - 1, max_len - 1)
        assert _rel(packed[0, a : a + n], want[i, :n]) < 1e-12 if n > 0 else True
    assert _rel(packed[0, 3], logp[3, labels[0, 0]]) < 1e-12  # the first sequence's last position: its first label


# ------------------------------------------------------------------------------------------------ the patch


@pytest.fixture
def fake_nemo_rl(tmp_path, monkeypatch):
    """A stand-in NeMo-RL on sys.path (``model_utils`` text given by the test), the import-hook registry restored."""
    registry = dict(getattr(sys, "_nemo_is_after_import_callbacks", {}))
    meta_path = list(sys.meta_path)
    monkeypatch.delenv(head.SWITCH_ENV, raising=False)

    def make(model_utils: str | None = None):
        drop_nemo_rl_modules()
        root = write_fake_nemo_rl(tmp_path / f"site{len(list(tmp_path.iterdir()))}", model_utils)
        monkeypatch.syspath_prepend(str(root))
        importlib.invalidate_caches()

    yield make
    drop_nemo_rl_modules()
    sys.meta_path[:] = meta_path
    sys._nemo_is_after_import_callbacks = registry


def _call_fused_forward(module, inference_only=False):
    hidden, weight, labels, _ = _problem()
    return module._gpt_forward_with_linear_ce_fusion(hidden, weight, labels, None, inference_only, chunk_size=4)


def test_the_patch_replaces_what_the_fused_forward_calls_and_keeps_the_original(fake_nemo_rl, monkeypatch):
    fake_nemo_rl()
    module = importlib.import_module(head.TARGET_MODULE)
    original = module.from_parallel_hidden_states_to_logprobs
    before = _call_fused_forward(module)
    calls = []
    real = head.next_token_logprobs
    monkeypatch.setattr(head, "next_token_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    head.patch_nemo_rl(module)
    head.patch_nemo_rl(module)  # idempotent
    assert head.status(module)["plugin_head"] and getattr(module, head.ORIGINAL_ATTR) is original
    after = _call_fused_forward(module)
    assert calls == [1]  # NeMo-RL's fused forward ran the plugin's head, once
    assert _rel(after, before) < 1e-12
    assert module.ChunkedDistributedHiddenStatesToLogprobs is not None  # nothing else of NeMo-RL's module changed


CHANGED = {
    "signature": (
        "    chunk_size=None,\n):",
        "    chunk_size=None,\n    use_te=False,\n):",
        "has changed: its parameters are",
    ),
    "missing": (
        "def from_parallel_hidden_states_to_logprobs(",
        "def from_parallel_hidden_states_to_logprobs_v2(",
        "does not exist in this NeMo-RL",
    ),
    "not_called_by_name": (
        "    return from_parallel_hidden_states_to_logprobs(\n        hidden_states,",
        "    return _HEAD(\n        hidden_states,",
        "no longer calls from_parallel_hidden_states_to_logprobs by name",
    ),
    "called_by_attribute": (  # the name stays in co_names, but no global is loaded: the patch would not reach it
        "    return from_parallel_hidden_states_to_logprobs(\n        hidden_states,",
        "    return _OTHER.from_parallel_hidden_states_to_logprobs(\n        hidden_states,",
        "no longer calls from_parallel_hidden_states_to_logprobs by name",
    ),
}


@pytest.mark.parametrize("change", sorted(CHANGED))
def test_a_changed_nemo_rl_is_refused_and_its_import_fails_under_the_switch(fake_nemo_rl, monkeypatch, change):
    old, new, message = CHANGED[change]
    text = MODEL.read_text()
    assert old in text
    text = text.replace(old, new) + "\n_HEAD = from_parallel_hidden_states_to_logprobs\n" * (change != "missing")
    text += "\nimport types\n_OTHER = types.SimpleNamespace(from_parallel_hidden_states_to_logprobs=_HEAD)\n" * (
        change == "called_by_attribute"
    )
    fake_nemo_rl(text)
    module = importlib.import_module(head.TARGET_MODULE)
    with pytest.raises(HostPatchError, match=message):
        head.patch_nemo_rl(module)
    fake_nemo_rl(text)
    monkeypatch.setenv(head.SWITCH_ENV, "1")
    assert head.install()
    with pytest.raises(HostPatchError, match=message):
        importlib.import_module(head.TARGET_MODULE)
    assert head.TARGET_MODULE not in sys.modules  # no half-patched NeMo-RL module is left behind


def test_the_switch_patches_nemo_rl_on_import_and_at_once_when_already_imported(fake_nemo_rl, monkeypatch):
    fake_nemo_rl()
    monkeypatch.setenv(head.SWITCH_ENV, "1")
    assert head.install()
    assert head.TARGET_MODULE not in sys.modules
    module = importlib.import_module(head.TARGET_MODULE)  # the import hook patches it before the import returns
    assert head.status(module)["plugin_head"]
    fake_nemo_rl()
    module = importlib.import_module(head.TARGET_MODULE)
    assert head.status(module)["plugin_head"]  # a re-import (a fresh module) is patched too


def test_without_the_switch_nothing_is_installed_and_a_bad_value_is_an_error(fake_nemo_rl, monkeypatch):
    fake_nemo_rl()
    assert not head.install()
    module = importlib.import_module(head.TARGET_MODULE)
    assert not head.status(module)["plugin_head"] and head.status(module)["function"].endswith(head.TARGET)
    monkeypatch.setenv(head.SWITCH_ENV, "0")
    assert not head.install()
    monkeypatch.setenv(head.SWITCH_ENV, "yes")
    with pytest.raises(ValueError, match="NEMO_IS_NEMO_RL_HEAD must be 1"):
        head.install()
