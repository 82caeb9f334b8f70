"""``nemo-is bench --host-heads``: the hosts' own fused LM heads against the plugin's, in the same run.

Each head computes next-token log-probs (verl's: and entropy) from hidden states and the LM-head weight, forward and
backward to dX and dW with a fixed random upstream gradient, on one TP rank's ``V/tp`` rows (no collectives):

- ``plugin``: :func:`~nemo_is_plugin.distributed.head.fused_linear.fused_linear_logprobs` (``[N, H]`` -> ``[N]``);
- ``plugin_nemo_rl``: the plugin's drop-in for NeMo-RL's function (:mod:`~nemo_is_plugin.adapters.nemo_rl.head`);
- ``nemo_rl``: NeMo-RL's ``from_parallel_hidden_states_to_logprobs`` (its fused path, chunk 256, its default):
  ``[S, B, H]`` -> ``[B, S-1]``;
- ``plugin_verl``: the plugin's drop-in for verl's kernel (:mod:`~nemo_is_plugin.adapters.verl.head`), log-probs and
  entropy;
- ``verl``: verl's ``linear_cross_entropy`` (its Triton kernel, CUDA only): ``[N, H]`` -> ``[N]``, ``[N]``.

The hosts' code is imported where it is installed, or from a checkout (``nemo_rl_path`` / ``verl_path``: the
directory holding the ``nemo_rl`` / ``verl`` package, put first on ``sys.path``); a host that does not import is
reported as not measured, with the reason, and a head that raises as failed. NeMo-RL's function needs a process group
for its collectives: a one-process group is created when none exists (gloo on CPU, NCCL on CUDA).

Per model shape: the bare forward GEMM ``X W^T`` (the unit of every ratio), then every head's forward+backward time
(rounds interleaving all jobs; median on CUDA, best on CPU), its peak memory above the inputs (one tracked call),
and its errors against an fp32 (CPU: fp64) computation on the same inputs over ``ref_tokens`` tokens: max relative
error of the log-probs, entropy, dX and dW.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nemo_is_plugin.apps.bench.device import BenchDevice
from nemo_is_plugin.apps.bench.shapes import GPU_TARGET_TOKENS, MODEL_SHAPES, QUICK_SHAPES, ModelShape

HEADS = ("plugin", "plugin_nemo_rl", "nemo_rl", "plugin_verl", "verl")
HOST_OF = {"nemo_rl": "nemo_rl", "verl": "verl"}
NEMO_RL_CHUNK = 256  # NeMo-RL's fused_linear_logprobs_chunk_size default (docs/guides/grpo.md)
Job = Callable[[], tuple]


class HostUnavailable(RuntimeError):
    """A host's head cannot be imported here; the message says why."""


@dataclass
class HostHeadsConfig:
    shapes: tuple[ModelShape, ...] = MODEL_SHAPES
    tokens: int = 64
    batch: int = 2
    tp: int = 1
    repeats: int = 3
    warmup: int = 0
    ref_tokens: int = 16
    heads: tuple[str, ...] = HEADS
    device: str = "cpu"
    dtype: str | None = None
    nemo_rl_path: str | None = None
    verl_path: str | None = None
    temperature: float = 1.0
    quick_run: bool = False

    def __post_init__(self) -> None:
        if unknown := [h for h in self.heads if h not in HEADS]:
            raise ValueError(f"unknown head(s) {unknown}; choose from {list(HEADS)}")
        if self.tokens % self.batch or self.ref_tokens % self.batch or self.ref_tokens > self.tokens:
            raise ValueError(f"tokens ({self.tokens}) and ref_tokens ({self.ref_tokens}) must be multiples of batch")

    @classmethod
    def for_device(cls, device: str = "cpu", quick: bool = False, **overrides: Any) -> HostHeadsConfig:
        """CUDA: the targets' setting (bf16, 16,384 tokens in 8 sequences, median of 5 rounds after 2 warm-ups);
        CPU: 64 tokens; ``quick``: tiny shapes."""
        base: dict[str, Any] = {}
        if device.startswith("cuda"):
            base = dict(tokens=GPU_TARGET_TOKENS, batch=8, repeats=5, warmup=2, ref_tokens=512)
        if quick:
            base.update(shapes=QUICK_SHAPES, tokens=32, batch=2, ref_tokens=8, quick_run=True)
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(device=device, **base)


# ------------------------------------------------------------------------------------------------ the hosts' code
def _import_from(package: str, module: str, path: str | None):
    if path is not None:
        root = str(Path(path).resolve())
        if not (Path(root) / package).is_dir():
            raise HostUnavailable(f"{root} holds no {package}/ package directory")
        if root not in sys.path:
            sys.path.insert(0, root)
    try:
        return importlib.import_module(module)
    except Exception as exc:  # an ImportError, or a host whose import fails for any reason: reported, not fatal
        where = f"from {path}" if path else "(not installed here)"
        raise HostUnavailable(f"{module} does not import {where}: {type(exc).__name__}: {exc}") from None


def _git_commit(path: Path) -> str | None:
    """The commit of a checkout (a directory with its own ``.git``); None for an installed package."""
    if not (path / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _describe(package: str, module: Any) -> dict:
    top = importlib.import_module(package)
    root = Path(module.__file__).resolve().parents[len(module.__name__.split(".")) - 1]
    version = getattr(top, "__version__", None)
    return {"version": None if version is None else str(version), "source": str(root), "commit": _git_commit(root)}


def load_hosts(cfg: HostHeadsConfig) -> tuple[dict[str, Callable], dict[str, dict], dict[str, str]]:
    """(the hosts' head functions, their descriptions, why a host is not measured)."""
    fns: dict[str, Callable] = {}
    info: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    wanted = {HOST_OF[h] for h in cfg.heads if h in HOST_OF}
    if "nemo_rl" in wanted:
        try:
            module = _import_from("nemo_rl", "nemo_rl.distributed.model_utils", cfg.nemo_rl_path)
            fns["nemo_rl"] = getattr(module, "_nemo_is_original_from_parallel_hidden_states_to_logprobs", None) or (
                module.from_parallel_hidden_states_to_logprobs
            )
            info["nemo_rl"] = _describe("nemo_rl", module)
        except (HostUnavailable, AttributeError) as exc:
            skipped["nemo_rl"] = f"{exc}; give --nemo-rl-path <NeMo-RL checkout>"
    if "verl" in wanted:
        try:
            module = _import_from("verl", "verl.utils.kernel.linear_cross_entropy", cfg.verl_path)
            fns["verl"] = module.linear_cross_entropy
            info["verl"] = _describe("verl", module)
        except (HostUnavailable, AttributeError) as exc:
            skipped["verl"] = f"{exc}; install verl or give --verl-path <verl checkout>"
    return fns, info, skipped


def process_group(dev: BenchDevice):
    """A one-process group for NeMo-RL's collectives (all of size one here)."""
    if not dist.is_initialized():
        backend = "nccl" if dev.is_cuda else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


# ------------------------------------------------------------------------------------------------ problem and jobs
@dataclass
class HeadInputs:
    """``hidden [S, B, H]`` (sequence first) and its flat view ``[S B, H]``, ``weight [V/tp, H]``, ``labels [B, S]``,
    the flat targets (labels rolled by one, in the hidden states' order) and the upstream gradients."""

    hidden: torch.Tensor
    weight: torch.Tensor
    labels: torch.Tensor
    flat_target: torch.Tensor
    grad_seq: torch.Tensor  # [B, S-1], NeMo-RL's output
    grad_lp: torch.Tensor  # [S B]
    grad_ent: torch.Tensor  # [S B]


def make_inputs(shape: ModelShape, tokens: int, batch: int, tp: int, dev: BenchDevice, seed: int = 0) -> HeadInputs:
    g = torch.Generator().manual_seed(seed)
    seq, vocab = tokens // batch, shape.vocab // tp
    hidden = torch.randn(seq, batch, shape.hidden, generator=g).to(dev.device, dev.dtype)
    weight = (torch.randn(vocab, shape.hidden, generator=g) * (2.0 / shape.hidden**0.5)).to(dev.device, dev.dtype)
    labels = torch.randint(0, vocab, (batch, seq), generator=g).to(dev.device)
    grad_lp, grad_ent = (torch.randn(seq * batch, generator=g).to(dev.device) for _ in range(2))
    flat_target = labels.roll(-1, dims=-1).t().reshape(-1)
    return nemo_rl_upstream(HeadInputs(hidden, weight, labels, flat_target, grad_lp[:0], grad_lp, grad_ent))


def head_job(name: str, inp: HeadInputs, hosts: dict[str, Callable], cfg: HostHeadsConfig, group) -> Job:
    """Forward + backward of head ``name``: returns (log-probs, entropy or None, dX, dW)."""
    from nemo_is_plugin.adapters.nemo_rl.head import from_parallel_hidden_states_to_logprobs
    from nemo_is_plugin.adapters.verl.head import linear_cross_entropy
    from nemo_is_plugin.distributed.head.fused_linear import fused_linear_logprobs

    h = inp.hidden.detach().requires_grad_(True)
    w = inp.weight.detach().requires_grad_(True)
    flat = h.view(-1, h.shape[-1])
    vocab, temp = w.shape[0], cfg.temperature

    def run(outputs: tuple, grads: tuple) -> tuple:
        dx, dw = torch.autograd.grad(outputs, (h, w), grads)
        return (outputs[0].detach(), outputs[1].detach() if len(outputs) > 1 else None, dx.view(-1, dx.shape[-1]), dw)

    if name == "plugin":
        return lambda: run((fused_linear_logprobs(flat, w, inp.flat_target, temperature=temp),), (inp.grad_lp,))
    if name in ("plugin_nemo_rl", "nemo_rl"):
        fn = from_parallel_hidden_states_to_logprobs if name == "plugin_nemo_rl" else hosts["nemo_rl"]
        return lambda: run((fn(h, w, None, inp.labels, 0, vocab, group, chunk_size=NEMO_RL_CHUNK),), (inp.grad_seq,))
    fn = linear_cross_entropy if name == "plugin_verl" else hosts["verl"]
    return lambda: run(fn(flat, w, inp.flat_target, float(temp), "none", None), (inp.grad_lp, inp.grad_ent))


def reference(inp: HeadInputs, temperature: float, acc: torch.dtype) -> tuple:
    """(log-probs [S B], entropy [S B], dX of the log-prob head, dW of it, dX and dW of the log-prob + entropy head)
    in ``acc``, flat in the hidden states' order; NeMo-RL's upstream gradient is the flat one at its positions."""
    h = inp.hidden.detach().to(acc).reshape(-1, inp.hidden.shape[-1]).requires_grad_(True)
    w = inp.weight.detach().to(acc).requires_grad_(True)
    logp = torch.log_softmax(h @ w.t() / temperature, dim=-1)
    lp = logp.gather(-1, inp.flat_target[:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    lp_grads = torch.autograd.grad(lp, (h, w), inp.grad_lp.to(acc), retain_graph=True)
    both = torch.autograd.grad((lp, ent), (h, w), (inp.grad_lp.to(acc), inp.grad_ent.to(acc)))
    return lp.detach(), ent.detach(), lp_grads, both


def nemo_rl_upstream(inp: HeadInputs) -> HeadInputs:
    """``inp`` with the flat upstream gradient 0 at each sequence's last position (which NeMo-RL's head drops) and
    NeMo-RL's ``[B, S-1]`` one taken from it: every head's dX and dW are then of one loss."""
    seq, batch = inp.hidden.shape[:2]
    grad = inp.grad_lp.view(seq, batch).t().clone()
    grad[:, -1] = 0
    flat = grad.t().reshape(-1)
    return replace(inp, grad_seq=grad[:, :-1].contiguous(), grad_lp=flat)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-300))


def head_errors(name: str, result: tuple, inp: HeadInputs, ref: tuple) -> dict[str, float]:
    lp, ent, dx, dw = result
    ref_lp, ref_ent, (lp_dx, lp_dw), (both_dx, both_dw) = ref
    if name in ("plugin_nemo_rl", "nemo_rl"):
        seq, batch = inp.hidden.shape[:2]
        lp = torch.cat([lp, lp.new_zeros(batch, 1)], dim=1).t().reshape(-1)
        ref_lp = ref_lp.view(seq, batch).t().clone()
        ref_lp[:, -1] = 0
        ref_lp = ref_lp.t().reshape(-1)
    errors = {"lp_err": _rel(lp, ref_lp)}
    if ent is not None:
        errors["ent_err"] = _rel(ent, ref_ent)
    want_dx, want_dw = (lp_dx, lp_dw) if ent is None else (both_dx, both_dw)
    errors.update(dx_err=_rel(dx, want_dx), dw_err=_rel(dw, want_dw))
    return errors


__all__ = [
    "HEADS",
    "HeadInputs",
    "HostHeadsConfig",
    "HostUnavailable",
    "head_errors",
    "head_job",
    "load_hosts",
    "make_inputs",
    "nemo_rl_upstream",
    "process_group",
    "reference",
]
