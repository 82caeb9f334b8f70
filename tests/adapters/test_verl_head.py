"""verl's fused forward on the plugin's head, one process (TP = 2 through verl's own ``fused_output_processor``:
tests/distributed/test_host_heads_tp.py):

- ``linear_cross_entropy`` equals what verl's computes: verl's Triton kernel needs CUDA (it runs in the
  ``gpu`` tier), so on CPU against verl's shipped torch implementation of the same op
  (``verl.utils.experimental.torch_functional.FusedLinearForPPOFunction``: fp32, 1e-5) and a float64 re-derivation
  (1e-12): log-probs, entropy, dX and dW with a temperature; ``reduction`` sum / mean as verl's;
- the patch replaces the function in both of verl's fused-forward modules (the Megatron output-processor hook / patched
  forward and the 1F1B overlap path), keeps the originals, and refuses a verl whose kernel signature changed or whose
  module no longer calls it by name (a global load: verl's real modules edited to call
  ``kernel_module.linear_cross_entropy(...)`` by attribute are refused);
- the switch, ``fused_kernel_options.impl_backend=nemo_is``: verl's real ``HFModelConfig`` (built from a tiny local
  Hugging Face config) carries the entry point's check (``nemo_is`` without ``use_fused_kernels`` is refused); the
  engine hook installs the head when an engine's config asks for it and verl kept its fused kernels on, not otherwise,
  and refuses to mix engines in one process. verl's Megatron engine module does not import here (it needs ``peft``), so
  the engine hook runs on a stand-in ``MegatronEngine`` whose ``_maybe_enable_fused_kernels`` does what verl 0.9.1's
  does, and the installed verl's source is checked to define and call that method.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import logging
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

pytest.importorskip("verl.models.mcore.model_forward_fused", reason="verl is the verl extra")

from nemo_is_plugin.adapters.nemo_rl.head import HostPatchError  # noqa: E402
from nemo_is_plugin.adapters.verl import head as verl_head  # noqa: E402
from nemo_is_plugin.adapters.verl.head import linear_cross_entropy  # noqa: E402

N, H, V, T = 13, 16, 41, 0.7


def _problem(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden, weight = (
        torch.randn(N, H, generator=g, dtype=torch.float64),
        torch.randn(V, H, generator=g, dtype=torch.float64),
    )
    c_lp, c_h = torch.randn(N, generator=g, dtype=torch.float64), torch.randn(N, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (N,), generator=g)
    return hidden.to(dtype), weight.to(dtype), labels, c_lp.to(dtype), c_h.to(dtype)


def _run(fn, hidden, weight, labels, c_lp, c_h):
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, ent = fn(h, w, labels)
    ((lp * c_lp).sum() + (ent * c_h).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def _reference(h, w, labels):
    logp = torch.log_softmax(h @ w.t() / T, dim=-1)
    return logp.gather(-1, labels[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def test_equals_verl_torch_implementation_in_fp32_and_a_float64_reference():
    from verl.utils.experimental.torch_functional import FusedLinearForPPOFunction

    fp32 = _problem(torch.float32)
    want = _run(lambda h, w, t: FusedLinearForPPOFunction.apply(h, w, t, T, 4), *fp32)
    got = _run(lambda h, w, t: linear_cross_entropy(h, w, t, T, "none", None), *fp32)
    assert got[0].shape == (N,) and got[1].shape == (N,) and got[0].dtype == torch.float32
    for g, w in zip(got, want):
        assert _rel(g, w) < 1e-5
    fp64 = _problem(torch.float64)
    want = _run(_reference, *fp64)
    got = _run(lambda h, w, t: linear_cross_entropy(h, w, t, T), *fp64)
    for g, w in zip(got, want):
        assert _rel(g, w) < 1e-12


def test_hidden_states_of_any_leading_shape_and_reductions_as_verl():
    hidden, weight, labels, _, _ = _problem(torch.float64)
    lp, ent = linear_cross_entropy(hidden.reshape(N, 1, H), weight, labels.reshape(1, N), T)
    want_lp, want_ent = _reference(hidden, weight, labels)
    assert _rel(lp, want_lp) < 1e-12 and _rel(ent, want_ent) < 1e-12
    total, _ = linear_cross_entropy(hidden, weight, labels, T, "sum")
    mean, _ = linear_cross_entropy(hidden, weight, labels, T, "mean")
    assert total.shape == () and float(total) == pytest.approx(float(want_lp.sum()), rel=1e-12)
    assert float(mean) == pytest.approx(float(want_lp.mean()), rel=1e-12)
    with pytest.raises(ValueError, match="reduction must be"):
        linear_cross_entropy(hidden, weight, labels, T, "max")


def test_verl_own_kernel_needs_cuda_which_is_why_the_cpu_reference_is_its_torch_twin():
    from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy as verl_kernel

    hidden, weight, labels, _, _ = _problem(torch.float32)
    with pytest.raises((AssertionError, RuntimeError)):  # its NVTX range (CPU torch) or its is_cuda assertion
        verl_kernel(hidden, weight, labels, T, "none", None)


@pytest.fixture
def fused_modules(monkeypatch):
    """verl's fused-forward modules with their ``linear_cross_entropy`` restored after the test."""
    modules = [importlib.import_module(name) for name in verl_head.FUSED_MODULES]
    for module in modules:
        monkeypatch.setattr(module, "linear_cross_entropy", module.linear_cross_entropy)
        monkeypatch.delattr(module, "_nemo_is_original_linear_cross_entropy", raising=False)
    return modules


def test_install_replaces_the_function_in_both_fused_forward_modules(fused_modules):
    originals = [m.linear_cross_entropy for m in fused_modules]
    assert not verl_head.head_installed()
    verl_head.install_head()
    verl_head.install_head()  # idempotent
    assert verl_head.head_installed()
    for module, original in zip(fused_modules, originals):
        assert module.linear_cross_entropy is linear_cross_entropy
        assert module._nemo_is_original_linear_cross_entropy is original


def test_a_changed_verl_is_refused(fused_modules, monkeypatch):
    kernel = importlib.import_module(verl_head.KERNEL_MODULE)

    class Changed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight, labels, temperature=1.0, reduction="none", group=None, chunk=8):
            raise AssertionError("not called")

    monkeypatch.setattr(kernel, "LinearCrossEntropy", Changed)
    with pytest.raises(HostPatchError, match="LinearCrossEntropy.forward takes"):
        verl_head.install_head()
    monkeypatch.undo()
    stale = ModuleType("verl.models.mcore.stale")
    stale.linear_cross_entropy = kernel.linear_cross_entropy
    exec("def fused_output_processor(**kw):\n    return _kernel(**kw)\n", vars(stale))
    with pytest.raises(HostPatchError, match="no longer calls linear_cross_entropy by name"):
        verl_head.check_targets([stale], kernel)


def _hf_model_config(tmp_path, **options):
    from verl.workers.config.model import HFModelConfig

    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "architectures": ["GPT2LMHeadModel"],
                "n_embd": 16,
                "n_layer": 1,
                "n_head": 2,
                "vocab_size": 64,
                "eos_token_id": 0,
                "bos_token_id": 0,
            }
        )
    )
    return HFModelConfig(path=str(tmp_path), load_tokenizer=False, **options)


def test_verl_model_config_carries_the_switch_check(tmp_path, monkeypatch):
    import verl  # noqa: F401  (loads the entry point, which registers the hooks)

    monkeypatch.setitem(verl_head._STATE, "requested", False)
    config = _hf_model_config(tmp_path, use_fused_kernels=True, fused_kernel_options={"impl_backend": "nemo_is"})
    assert verl_head.requested(config) and verl_head._STATE["requested"]
    assert not verl_head.requested(_hf_model_config(tmp_path, use_fused_kernels=True))
    with pytest.raises(ValueError, match="also set actor_rollout_ref.model.use_fused_kernels=True"):
        _hf_model_config(tmp_path, fused_kernel_options={"impl_backend": "nemo_is"})
    monkeypatch.setitem(verl_head._STATE, "engine_unsupported", "no engine method")
    with pytest.raises(HostPatchError, match="no engine method"):
        _hf_model_config(tmp_path, use_fused_kernels=True, fused_kernel_options={"impl_backend": "nemo_is"})


def test_the_installed_verl_engine_defines_and_calls_the_hooked_method():
    path = Path(importlib.util.find_spec("verl").origin).parent / "workers/engine/megatron/transformer_impl.py"
    tree = ast.parse(path.read_text())
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == verl_head.ENGINE_CLASS)
    methods = {f.name: f for f in engine.body if isinstance(f, ast.FunctionDef)}
    assert verl_head.ENGINE_METHOD in methods
    calls = {
        n.func.attr
        for n in ast.walk(methods["initialize"])
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
    }
    assert verl_head.ENGINE_METHOD in calls


class _StandInEngine:
    """verl 0.9.1's ``MegatronEngine._maybe_enable_fused_kernels``: off unless the engine config asks; turned off for
    no remove-padding, value models and MTP; else the fused forward patched into every model chunk."""

    def __init__(self, model_options: dict, engine_fused=True, remove_padding=True):
        self.model_config = SimpleNamespace(
            use_fused_kernels=model_options.pop("use_fused_kernels", True),
            fused_kernel_options=model_options,
            mtp=SimpleNamespace(enable=False),
        )
        self.engine_config = SimpleNamespace(use_fused_kernels=engine_fused, use_remove_padding=remove_padding)
        self.is_value_model, self.module = False, []

    def _maybe_enable_fused_kernels(self):
        if not self.engine_config.use_fused_kernels:
            return
        if not self.engine_config.use_remove_padding or self.is_value_model or self.model_config.mtp.enable:
            self.engine_config.use_fused_kernels = False


@pytest.fixture
def engine_module(fused_modules, monkeypatch):
    module = ModuleType(verl_head.ENGINE_MODULE)
    module.MegatronEngine = type("MegatronEngine", (_StandInEngine,), {})
    verl_head._on_engine_module(module)
    verl_head._on_engine_module(module)  # wrapped once only
    return module


def test_the_engine_hook_installs_the_head_only_where_the_config_asks(engine_module, caplog):
    engine = engine_module.MegatronEngine
    engine({"impl_backend": "triton"})._maybe_enable_fused_kernels()
    assert not verl_head.head_installed()
    with caplog.at_level(logging.WARNING, logger=verl_head.__name__):
        engine({"impl_backend": "nemo_is"}, remove_padding=False)._maybe_enable_fused_kernels()
    assert not verl_head.head_installed() and "turned its fused kernels off" in caplog.text
    with pytest.raises(ValueError, match="use_fused_kernels=True"):
        engine({"impl_backend": "nemo_is", "use_fused_kernels": False})._maybe_enable_fused_kernels()
    engine({"impl_backend": "nemo_is"})._maybe_enable_fused_kernels()
    assert verl_head.head_installed()
    with pytest.raises(HostPatchError, match="another engine"):
        engine({"impl_backend": "triton"})._maybe_enable_fused_kernels()


def test_an_engine_without_the_hooked_method_is_reported_where_the_config_asks(monkeypatch):
    monkeypatch.setitem(verl_head._STATE, "engine_unsupported", None)
    monkeypatch.setitem(verl_head._STATE, "requested", False)
    module = ModuleType(verl_head.ENGINE_MODULE)
    module.MegatronEngine = type("MegatronEngine", (), {})
    verl_head._on_engine_module(module)  # nobody asked yet: recorded, not raised
    assert "does not exist in this verl" in verl_head._STATE["engine_unsupported"]
    monkeypatch.setitem(verl_head._STATE, "requested", True)
    with pytest.raises(HostPatchError, match="does not exist in this verl"):
        verl_head._on_engine_module(module)
    assert sys.modules.get(verl_head.ENGINE_MODULE) is not module


@pytest.mark.parametrize("name", verl_head.FUSED_MODULES)
def test_a_verl_calling_its_kernel_by_attribute_is_refused(name, monkeypatch):
    """verl's real fused module, edited to keep the import but call ``kernel_module.linear_cross_entropy(...)``: the
    name stays in the functions' ``co_names`` (attribute access), but no global is loaded, so rebinding the global
    would leave verl's kernel running; the check refuses it. The unedited source passes."""
    module = importlib.import_module(name)
    source = Path(module.__file__).read_text()
    assert "= linear_cross_entropy(" in source  # the call shape the edit rewrites (verl 0.9.1)
    kernel = importlib.import_module(verl_head.KERNEL_MODULE)
    edited = source.replace(
        f"from {verl_head.KERNEL_MODULE} import linear_cross_entropy",
        f"import {verl_head.KERNEL_MODULE} as kernel_module\n"
        f"from {verl_head.KERNEL_MODULE} import linear_cross_entropy",
    ).replace("= linear_cross_entropy(", "= kernel_module.linear_cross_entropy(")
    assert edited.count("kernel_module.linear_cross_entropy(") == source.count("= linear_cross_entropy(")
    for text, refused in ((source, False), (edited, True)):
        synthetic = ModuleType(name + "_synthetic")
        synthetic.__file__ = module.__file__
        monkeypatch.setitem(sys.modules, synthetic.__name__, synthetic)  # dataclasses look their module up
        exec(compile(text, module.__file__, "exec"), vars(synthetic))
        codes = [v.__code__ for v in vars(synthetic).values() if inspect.isfunction(v)]
        for code in codes:  # nested functions too
            codes += [c for c in code.co_consts if inspect.iscode(c)]
        assert any("linear_cross_entropy" in c.co_names for c in codes)  # what the old co_names check accepted
        if refused:
            with pytest.raises(HostPatchError, match="no longer calls linear_cross_entropy by name"):
                verl_head.check_targets([synthetic], kernel)
        else:
            verl_head.check_targets([synthetic], kernel)
