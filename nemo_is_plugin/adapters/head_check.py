"""Check, in a host's own interpreter and environment, that its fused log-prob path runs on the plugin's head and that
the swap changes nothing beyond float tolerance:

    <worker python> -m nemo_is_plugin.adapters.head_check nemo-rl     # with the worker's PYTHONPATH and switch
    <driver python> -m nemo_is_plugin.adapters.head_check nemo-rl-loss [grpo.yaml]
    <worker python> -m nemo_is_plugin.adapters.head_check verl

NeMo-RL's loss (``nemo-rl-loss``): whether the start-up hook registered the ``loss_fn.name`` switch in this
interpreter, and which class NeMo-RL's installed ``ClippedPGLossFn`` builds for the ``loss_fn`` of ``grpo.yaml``
(default: ``name: nemo_is.clipped_pg`` alone) -- the plugin's ``NeMoRLLossFn`` when the section names the plugin,
NeMo-RL's own otherwise.

NeMo-RL: whether ``NEMO_IS_NEMO_RL_HEAD`` is on, whether the start-up hook registered itself in this interpreter
(before anything imported NeMo-RL), whether the installed ``nemo_rl.distributed.model_utils`` holds the plugin's
function after its import, and the plugin's head against NeMo-RL's own function (kept by the patch; imported without
the patch when the switch is off) on a random fp32 problem: log-probs, dX and dW. verl: whether ``import verl`` loaded
the plugin's hooks, whether the installed verl's kernel and fused-forward modules (Megatron's, and the FSDP models'
``FusedLinearForPPO`` and its forwards) are what the plugin stands in for, and the plugin's ``linear_cross_entropy``
against verl's Triton kernel (on CUDA) or verl's torch implementation of the same op (on CPU). Exit status 0 when
everything holds, 1 otherwise; each line says what was found.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

TOLERANCE = 1e-5  # fp32, max error relative to the largest entry


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _group():
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


def _compare(names: tuple[str, ...], got: tuple, want: tuple, tol: float = TOLERANCE) -> list[tuple[str, bool]]:
    return [
        (f"{n}: max relative difference {_rel(g, w):.1e} (< {tol:g})", _rel(g, w) < tol)
        for n, g, w in zip(names, got, want)
    ]


def _grads(fn: Callable, hidden, weight, *args, upstream: tuple) -> tuple:
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    out = fn(h, w, *args)
    out = out if isinstance(out, tuple) else (out,)
    dx, dw = torch.autograd.grad(out, (h, w), upstream[: len(out)])
    return (*(o.detach() for o in out), dx, dw)


def check_nemo_rl() -> list[tuple[str, bool]]:
    from nemo_is_plugin.adapters.nemo_rl import head

    lines = [(f"{head.SWITCH_ENV}={head.status()['switch'] or '(unset)'}", head.switch_on())]
    hooked = head.TARGET_MODULE in getattr(sys, "_nemo_is_after_import_callbacks", {})
    already = head.TARGET_MODULE in sys.modules
    lines.append((f"start-up hook registered in this interpreter: {hooked}", hooked or already))
    try:
        module = importlib.import_module(head.TARGET_MODULE)
    except Exception as exc:
        return lines + [(f"import {head.TARGET_MODULE} failed: {type(exc).__name__}: {exc}", False)]
    state = head.status(module)
    lines.append((f"{head.TARGET_MODULE}.{head.TARGET} is {state['function']}", state["plugin_head"]))
    original = getattr(module, head.ORIGINAL_ATTR, None) or getattr(module, head.TARGET)
    dev, g = _device(), torch.Generator().manual_seed(0)
    s, b, h, v = 24, 2, 64, 257
    hidden = torch.randn(s, b, h, generator=g).to(dev)
    weight = (torch.randn(v, h, generator=g) * 0.3).to(dev)
    labels = torch.randint(0, v, (b, s), generator=g).to(dev)
    upstream = (torch.randn(b, s - 1, generator=g).to(dev),)
    args = (None, labels, 0, v, _group())
    want = _grads(lambda x, w, *a: original(x, w, *a, chunk_size=8), hidden, weight, *args, upstream=upstream)
    got = _grads(head.from_parallel_hidden_states_to_logprobs, hidden, weight, *args, upstream=upstream)
    return lines + _compare(("log-probs", "dX", "dW"), got, want)


def check_nemo_rl_loss(section: dict | None = None) -> list[tuple[str, bool]]:
    """Which loss NeMo-RL's ``ClippedPGLossFn`` builds in this interpreter for a ``loss_fn`` naming the plugin
    (``section``, default ``{"name": "nemo_is.clipped_pg"}``): what ``grpo.setup`` would get."""
    from nemo_is_plugin.adapters.nemo_rl.startup import loss_switch

    state = loss_switch.status()
    already = state["imported"] and state["patched"]
    lines = [
        (f"loss_fn.name switch registered in this interpreter: {state['registered']}", state["registered"] or already)
    ]
    try:
        module = importlib.import_module(loss_switch.TARGET_MODULE)
    except Exception as exc:
        return lines + [(f"import {loss_switch.TARGET_MODULE} failed: {type(exc).__name__}: {exc}", False)]
    section = {"name": "nemo_is.clipped_pg"} if section is None else section
    try:
        built = getattr(module, loss_switch.TARGET_CLASS)(module.ClippedPGLossConfig(**section))
        what = f"{type(built).__module__}.{type(built).__qualname__}"
    except Exception as exc:
        return lines + [(f"NeMo-RL's ClippedPGLossFn({section}) failed: {type(exc).__name__}: {exc}", False)]
    named = loss_switch.plugin_name(section) is not None
    return lines + [(f"NeMo-RL's ClippedPGLossFn builds {what}", named == (what.startswith("nemo_is_plugin.")))]


def _loss_section(path: str) -> dict:
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    return dict(config.get("loss_fn") or {}) if isinstance(config, dict) else {}


def check_verl() -> list[tuple[str, bool]]:
    import verl  # noqa: F401  (loads the verl.plugins entry points, the plugin's among them)

    from nemo_is_plugin.adapters.verl import fsdp_head
    from nemo_is_plugin.adapters.verl import head as verl_head

    registered = sorted(m for m in getattr(sys, "_nemo_is_after_import_callbacks", {}) if m.startswith("verl."))
    lines = [(f"hooks registered by the verl.plugins entry point: {registered}", verl_head.CONFIG_MODULE in registered)]
    try:
        modules = [importlib.import_module(name) for name in verl_head.FUSED_MODULES]
        verl_head.check_targets(modules, importlib.import_module(verl_head.KERNEL_MODULE))
        lines.append(("verl's fused-forward modules call linear_cross_entropy as the plugin expects", True))
    except Exception as exc:
        lines.append((f"verl's fused-forward modules: {type(exc).__name__}: {exc}", False))
    try:
        fsdp_head.check_targets()
        lines.append(("verl's FSDP fused forwards build FusedLinearForPPO as the plugin expects", True))
    except Exception as exc:
        lines.append((f"verl's FSDP fused forwards: {type(exc).__name__}: {exc}", False))
    dev, g = _device(), torch.Generator().manual_seed(0)
    n, h, v, temperature = 96, 128, 1024, 0.7
    hidden, weight = torch.randn(n, h, generator=g).to(dev), (torch.randn(v, h, generator=g) * 0.3).to(dev)
    labels = torch.randint(0, v, (n,), generator=g).to(dev)
    upstream = (torch.randn(n, generator=g).to(dev), torch.randn(n, generator=g).to(dev))
    theirs: Callable
    if dev.type == "cuda":  # verl's kernel computes in TF32: compared at its accuracy
        from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy as kernel

        theirs, what, tol = (lambda x, w, t: kernel(x, w, t, temperature, "none", None)), "verl's Triton kernel", 1e-2
    else:
        from verl.utils.experimental.torch_functional import FusedLinearForPPOFunction as torch_op

        theirs, what, tol = (lambda x, w, t: torch_op.apply(x, w, t, temperature, 32)), "verl's torch op", TOLERANCE
    want = _grads(theirs, hidden, weight, labels, upstream=upstream)
    mine = _grads(
        lambda x, w, t: verl_head.linear_cross_entropy(x, w, t, temperature), hidden, weight, labels, upstream=upstream
    )
    return (
        lines
        + [(f"the plugin's head against {what} on {dev.type}:", True)]
        + _compare(("log-probs", "entropy", "dX", "dW"), mine, want, tol)
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["nemo-rl-loss"] and len(argv) <= 2:
        lines = check_nemo_rl_loss(_loss_section(argv[1]) if len(argv) == 2 else None)
    elif argv in (["nemo-rl"], ["verl"]):
        lines = check_nemo_rl() if argv == ["nemo-rl"] else check_verl()
    else:
        print("usage: python -m nemo_is_plugin.adapters.head_check nemo-rl|nemo-rl-loss [grpo.yaml]|verl")
        return 2
    for text, ok in lines:
        print(f"[{'ok' if ok else 'FAIL'}] {text}")
    return 0 if all(ok for _, ok in lines) else 1


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["check_nemo_rl", "check_nemo_rl_loss", "check_verl", "main"]
