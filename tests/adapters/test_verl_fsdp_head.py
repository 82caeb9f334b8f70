"""verl's FSDP fused forward on the plugin's head (``nemo_is_plugin/adapters/verl/fsdp_head.py``), one process, on a
tiny Hugging Face Qwen2 built through verl 0.9.1's own ``apply_monkey_patch`` (what its FSDP engine calls):

- ``impl_backend=nemo_is`` gives verl's torch backend's output (``CausalLMOutputForPPO``: the same fields, shapes and
  dtypes; log-probs, entropy and every parameter's gradient to fp32 1e-6 relative) with the padded batch (labels
  rolled by verl's forward) and the packed one (remove-padding: the engine's ``shift_labels``), a temperature, and
  the plugin's head called once per forward (counted); in float64 (where verl's torch op cannot run: it asserts fp32)
  against a float64 re-derivation from the model's own hidden states (1e-12, gradients 1e-10);
- a model built with verl's ``torch`` backend in the same process keeps verl's op, bit for bit;
- a verl the plugin cannot stand in for is refused with one line naming the fix: an op with another signature, a
  forward that binds the op elsewhere than at call time, an ``apply_monkey_patch`` that installs no fused forward for
  the model (verl's own ``kimi_vl`` branch, or a verl that stops calling ``patch_forward_with_backends``).

The end-to-end proof, verl's real FSDP2 training step at DP 2: functional_tests/test_verl_step_fsdp.py.
"""

from __future__ import annotations

import copy
import dis
import importlib

import pytest
import torch

pytest.importorskip("verl.models.transformers.monkey_patch", reason="verl is the verl extra")

from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from nemo_is_plugin.adapters.import_hooks import HostPatchError  # noqa: E402
from nemo_is_plugin.adapters.verl import fsdp_head  # noqa: E402
from nemo_is_plugin.adapters.verl import head as verl_head  # noqa: E402

V, TEMPERATURE, LENGTHS = 97, 0.7, (9, 5, 7)
ORIGINAL = "_nemo_is_original_" + fsdp_head.OP


@pytest.fixture
def verl_patch(monkeypatch):
    """verl's monkey-patch module with the entry point's hooks, and everything verl's patch changes globally (the
    model class's forward, the flash-attention hook, verl's op) restored after the test."""
    from transformers.integrations import flash_attention

    op_module = importlib.import_module(fsdp_head.OP_MODULE)
    monkeypatch.setattr(op_module, fsdp_head.OP, getattr(op_module, ORIGINAL, getattr(op_module, fsdp_head.OP)))
    monkeypatch.delattr(op_module, ORIGINAL, raising=False)
    monkeypatch.setattr(Qwen2ForCausalLM, "forward", Qwen2ForCausalLM.forward)
    monkeypatch.setattr(flash_attention, "_flash_attention_forward", flash_attention._flash_attention_forward)
    module = importlib.import_module(fsdp_head.PATCH_MODULE)
    verl_head.install_hooks()  # as the verl.plugins entry point does
    assert getattr(module, fsdp_head.PATCH).nemo_is_hook and getattr(module, fsdp_head.APPLY).nemo_is_hook
    return module


def _model(dtype=torch.float32, seed=0) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).to(dtype)


def _inputs(remove_padding: bool, seed=1) -> dict:
    """What verl's FSDP engine passes the fused forward (``FSDPEngineWithLMHead.prepare_model_inputs``): packed
    ``[1, T]`` ids, per-sequence positions and the globally rolled ``shift_labels`` with remove-padding; else the
    right-padded ``[B, S]`` batch and its attention mask (verl's forward rolls the labels itself)."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, V, (n,), generator=g) for n in LENGTHS]
    extra = {"temperature": TEMPERATURE, "return_dict": True}
    if remove_padding:
        ids = torch.cat(seqs)[None]
        positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
        return {"input_ids": ids, "position_ids": positions, "shift_labels": ids.roll(-1, dims=1), **extra}
    ids = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0), **extra}


def _build(module, model, backend: str, remove_padding: bool):
    getattr(module, fsdp_head.APPLY)(
        model=model, use_remove_padding=remove_padding, use_fused_kernels=True, fused_kernels_backend=backend
    )
    return model


def _run(model, inputs, seed=2):
    """The forward's output, and every parameter's gradient of a random combination of log-probs and entropy."""
    out = model(**inputs)
    g = torch.Generator().manual_seed(seed)
    c_lp = torch.randn(out.log_probs.shape, generator=g, dtype=torch.float64)
    c_h = torch.randn(out.entropy.shape, generator=g, dtype=torch.float64)
    ((out.log_probs * c_lp.to(out.log_probs.dtype)).sum() + (out.entropy * c_h.to(out.entropy.dtype)).sum()).backward()
    return out, {n: p.grad for n, p in model.named_parameters()}


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture
def head_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    original = fsdp_head.fused_linear_logprobs

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(fsdp_head, "fused_linear_logprobs", counting)
    return calls


@pytest.mark.parametrize("remove_padding", [False, True], ids=["padded", "remove_padding"])
def test_nemo_is_backend_gives_verl_torch_backend_output(verl_patch, head_calls, remove_padding):
    base = _model()
    verl_model = _build(verl_patch, copy.deepcopy(base), "torch", remove_padding)
    plugin_model = _build(verl_patch, copy.deepcopy(base), "nemo_is", remove_padding)
    assert getattr(verl_model, fsdp_head.BACKEND_ATTR) == "torch" and not fsdp_head.plugin_backend_on(verl_model)
    assert fsdp_head.plugin_backend_on(plugin_model)
    inputs = _inputs(remove_padding)
    want, want_grads = _run(verl_model, inputs)
    assert head_calls == []  # verl's backend did not touch the plugin's head
    got, got_grads = _run(plugin_model, inputs)
    assert len(head_calls) == 1
    assert type(got) is type(want) and list(got.keys()) == list(want.keys())
    shape = (1, sum(LENGTHS)) if remove_padding else (len(LENGTHS), max(LENGTHS))
    for name in ("log_probs", "entropy"):
        g, w = getattr(got, name), getattr(want, name)
        assert g.shape == w.shape == shape and g.dtype == w.dtype == torch.float32, name
        assert _rel(g, w) < 1e-6, (name, _rel(g, w))
    assert want_grads.keys() == got_grads.keys()
    for name, w in want_grads.items():
        assert _rel(got_grads[name], w) < 1e-6, (name, _rel(got_grads[name], w))


def test_nemo_is_backend_in_float64_against_a_reference(verl_patch, head_calls):
    model = _build(verl_patch, _model(torch.float64), "nemo_is", remove_padding=True)
    reference = copy.deepcopy(model)
    inputs = _inputs(remove_padding=True)
    got, got_grads = _run(model, inputs)
    assert len(head_calls) == 1 and got.log_probs.dtype == got.entropy.dtype == torch.float64

    class Reference(torch.nn.Module):  # the same decoder; the head re-derived with a full float64 log_softmax
        def forward(self, **kwargs):
            hidden = reference.model(input_ids=kwargs["input_ids"], position_ids=kwargs["position_ids"])[0]
            logp = torch.log_softmax(reference.lm_head(hidden) / TEMPERATURE, dim=-1)
            lp = logp.gather(-1, kwargs["shift_labels"][..., None]).squeeze(-1)
            return type(got)(log_probs=lp, entropy=-(logp.exp() * logp).sum(-1))

    want, _ = _run(Reference(), inputs)
    want_grads = {n: p.grad for n, p in reference.named_parameters()}
    assert _rel(got.log_probs, want.log_probs) < 1e-12 and _rel(got.entropy, want.entropy) < 1e-12
    for name, w in want_grads.items():
        assert _rel(got_grads[name], w) < 1e-10, name


def test_verl_backends_keep_verl_op(verl_patch):
    op_module = importlib.import_module(fsdp_head.OP_MODULE)
    verl_op = getattr(op_module, fsdp_head.OP)
    plugin_op = fsdp_head.install_op()
    assert fsdp_head.install_op() is plugin_op and getattr(op_module, fsdp_head.OP) is plugin_op  # idempotent
    assert getattr(op_module, ORIGINAL) is verl_op
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 5, 8, generator=g), torch.randn(V, 8, generator=g)
    labels = torch.randint(0, V, (2, 5), generator=g)
    for a, b in zip(verl_op().forward(hidden, weight, labels, 0.9), plugin_op().forward(hidden, weight, labels, 0.9)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="Unsupported FusedLinearForPPO backend"):  # verl's own refusal, kept
        plugin_op(impl_backend="triton")
    with pytest.raises(ValueError, match="Unsupported FusedLinearForPPO backend: nemo_is"):
        verl_op(impl_backend="nemo_is")  # a forward still holding verl's class fails; it cannot run verl's head


def test_a_verl_the_plugin_cannot_stand_in_for_is_refused(verl_patch, monkeypatch):
    op_module = importlib.import_module(fsdp_head.OP_MODULE)

    class Changed(torch.nn.Module):
        def __init__(self, chunk_size=512, impl_backend="torch", vocab_chunk=None):
            super().__init__()

        def forward(self, hidden_states, vocab_weights, input_ids, temperature=1.0):
            raise AssertionError("not called")

    with monkeypatch.context() as m:
        m.setattr(op_module, fsdp_head.OP, Changed)
        with pytest.raises(HostPatchError, match="FusedLinearForPPO takes") as refused:
            _build(verl_patch, _model(), "nemo_is", remove_padding=False)
        assert "\n" not in str(refused.value) and "impl_backend to torch" in str(refused.value)

    namespace: dict = {}
    exec("def forward(self, **kw):\n    return FusedLinearForPPO(impl_backend='torch').forward(**kw)\n", namespace)
    with pytest.raises(HostPatchError, match="does not build verl.utils.experimental.torch_functional"):
        fsdp_head.check_forward(namespace["forward"])

    # verl's apply_monkey_patch installs no fused forward (its kimi_vl branch returns first; or a verl that no
    # longer calls patch_forward_with_backends): the model would run without the plugin's head
    monkeypatch.setattr(verl_patch, fsdp_head.PATCH, lambda *args, **kwargs: None)
    with pytest.raises(HostPatchError, match="installed no fused forward on the plugin's head for model_type 'qwen2'"):
        _build(verl_patch, _model(), "nemo_is", remove_padding=False)


def test_every_forward_verl_installs_builds_the_op_at_call_time(verl_patch, capsys):
    """The torch-backend forwards of every model type ``patch_forward_with_backends`` knows pass the check, and
    verl's ``apply_monkey_patch`` calls that function by its global name (the binding the hook replaces)."""
    fsdp_head.check_targets()  # what head_check verl runs: verl's op and every forward_with_torch_backend
    apply = getattr(verl_patch, fsdp_head.APPLY).__wrapped__.__code__
    assert fsdp_head.PATCH in {i.argval for i in dis.get_instructions(apply) if i.opname == "LOAD_GLOBAL"}
    patch = getattr(verl_patch, fsdp_head.PATCH)
    assert patch(torch.nn.Linear(1, 1), use_fused_kernels=False, fused_kernels_backend="nemo_is") is None
    assert "Skipping monkey patch for Linear" in capsys.readouterr().out  # verl's own function, switch off
