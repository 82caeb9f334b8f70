"""Kernel-launching ops and host syncs per loss call, counted on CPU: the numbers docs/gpu_runs.md quotes.

    python tools/launch_count.py [--json] [--compiled] [--device cuda]

Run it by path with ``PYTHONPATH`` pointing at the checkout to measure (``PYTHONPATH=/path/to/other/checkout python
tools/launch_count.py``): the package measured is whichever ``nemo_is_plugin`` that imports, while the counters are this
file's and tests/helpers/device_guard.py's. On a GPU each non-view aten op is (about) one kernel launch, and the loss's
[N]-vector epilogue costs CPU launch time, not GPU work, so the count is the number to keep down; a CPU counts them
exactly and the same every run. Per config, on one small problem (4 sequences x 64 positions, H = 32, V = 256,
``make_problem`` seed 0, log-probs from the model):

- ``epilogue``: ``ClippedPGLoss.__call__`` on the ``[B, T]`` log-probs (forward), and ``+bwd`` with its backward;
- ``chunk_dLdc``: one chunk's dL/dc in the fused single pass (``TokenLossGradient`` on 1/8 of the tokens);
- ``fused_8_chunks``: ``fused_linear_pg_loss`` forward + backward over 8 chunks (the torch chunk math on CPU);
- ``syncs``: the host synchronisations of the epilogue call (+bwd) and of the fused call, by
  ``count_host_syncs`` (tests/helpers/device_guard.py; the tests assert the same counts).

Ops are counted by a ``TorchDispatchMode``: every aten op whose overload is not a view (``OpOverload.is_view``).
The shapes do not change the counts (no per-sequence or per-chunk loop other than the 8 chunks).

``--compiled`` adds the compiled loss (``nemo_is_plugin/loss/compiled.py``, ``CompiledLoss``) on the same problem:

- ``compiled``, ``compiled+bwd``: the loss call (its compiled epilogue), forward, and with its backward;
- ``compiled_fused_8_chunks``: ``fused_linear_pg_loss(CompiledLoss(...))`` forward + backward over 8 chunks: the
  batch constants, each chunk's ``[n]`` step (``chunk_step``: log-probs from the merged partials and dL/dc) and the
  loss with its metrics are compiled graphs; the GEMMs and the chunk's two ``[n, V]`` passes run as in eager (on a
  CPU the torch backend's passes, 7 and 8 aten ops a chunk; on CUDA one Triton kernel each);
- ``compiled_chunk_step``: one chunk's step alone (the compiled counterpart of ``chunk_dLdc``);
- ``graph_kernels_*``: the part of each count that is kernel calls of compiled graphs.

A compiled count, on a CPU, is the non-view aten ops run outside the compiled graphs (counted by the same dispatch
mode, switched off while a graph runs: a dispatch mode cannot run inside ``torch.compile``) **plus**, for each call of
an inductor graph (forward or backward, ``CompiledFxGraph``), the kernel calls in its generated wrapper code: each call
of a generated C++ kernel (``cpp_fused_*``), of an ``extern_kernels`` op or of an aten op the wrapper falls back to,
counted once per line of the straight-line ``call()`` (no loops there). On a CUDA device the wrapper launches one
Triton kernel per generated-kernel call, so the CPU count stands for the number of launches on a GPU up to inductor's
CUDA fusion choices, which may differ from its CPU choices (the CUDA count below is the measured one).

- On a CUDA device (``--device cuda``) both paths are counted by ``torch.profiler``: the device kernels and memory
  operations each call launches (profiler events on the CUDA device), no dispatch mode involved.
- ``syncs_compiled*``: host synchronisations of the compiled calls, by ``count_host_syncs``.

The first compiled call per config compiles (minutes on 2 CPU cores, seconds once inductor's FX graph cache holds it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the sync counter: tests/helpers

from helpers.device_guard import count_host_syncs  # type: ignore[import-not-found]  # noqa: E402

from nemo_is_plugin import build_loss_fn  # noqa: E402
from nemo_is_plugin.apps.bench.jobs import BENCH_LOSS_CONFIG  # noqa: E402
from nemo_is_plugin.apps.bench.loss_gradient_timing import CONFIGS as TIMED_CONFIGS  # noqa: E402
from nemo_is_plugin.apps.bench.problem import make_problem  # noqa: E402
from nemo_is_plugin.distributed.entry_points.fused_linear_loss import chunk_step, fused_linear_pg_loss  # noqa: E402
from nemo_is_plugin.kernels.softmax_partials import SoftmaxPartials  # noqa: E402
from nemo_is_plugin.loss.compiled import CompiledFunction, CompiledLoss, PreparedInputs  # noqa: E402
from nemo_is_plugin.loss.separable import PrefixCarry, TokenLossGradient  # noqa: E402

CHUNKS = 8
CONFIGS: dict[str, dict[str, Any]] = {
    "bench": BENCH_LOSS_CONFIG,  # the head benchmark's loss (apps/bench/jobs.py)
    "ctpo_cumulative": TIMED_CONFIGS["cumulative_ctpo_clip"],  # the loss-gradient timing's CTPO config
    "dppo_tv": dict(
        policy_objective="dppo_tv", dppo_delta_low=0.2, dppo_delta_high=0.28, use_importance_sampling_correction=True
    ),
}


class LaunchCounter(TorchDispatchMode):
    """Counts the non-view aten ops run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))


def count_config(config: dict[str, Any]) -> dict[str, int]:
    p = make_problem(4, 65, 32, 256, base_logprobs="model")
    loss_fn = build_loss_fn(config)
    x0 = p.data["prev_logprobs"][:, 1:].to(torch.float32).clone()
    out: dict[str, int] = {}

    for label, backward in (("epilogue", False), ("epilogue+bwd", True)):
        x = x0.clone().requires_grad_(True)
        with count_host_syncs() as syncs, LaunchCounter() as ops:
            loss, _ = loss_fn(
                next_token_logprobs=x,
                data=p.data,
                global_valid_seqs=p.global_valid_seqs,
                global_valid_toks=p.global_valid_toks,
            )
            if backward:
                loss.backward()
        out[label], out[f"syncs_{label}"] = ops.count, len(syncs)

    inputs, layout = loss_fn.prepare(x0, p.data, p.global_valid_seqs, p.global_valid_toks)
    gradient = TokenLossGradient.build(loss_fn, inputs, layout)
    c = x0.reshape(-1)
    first = slice(0, c.numel() // CHUNKS)
    with LaunchCounter() as ops:
        gradient(first, c[first])
    out["chunk_dLdc"] = ops.count

    fused = fused_call(loss_fn, p)
    with count_host_syncs() as syncs, LaunchCounter() as ops:
        fused()
    out[f"fused_{CHUNKS}_chunks"], out["syncs_fused"] = ops.count, len(syncs)
    return out


# one kernel call per line of inductor's generated ``call()``: a generated C++ / Triton kernel, an extern op, an aten op
_KERNEL_CALL = re.compile(
    r"^(?:\w+(?:, \w+)* = )?(?:cpp_fused_\w+|triton_\w+\.run|extern_kernels\.\w+|aten\.[\w.]+|torch\.ops\.[\w.]+)\("
)


def kernel_calls(source: str) -> int:
    """Kernel calls in one generated wrapper module's ``call()`` (straight-line code: each line runs once per call)."""
    body = source[source.index("def call(") :] if "def call(" in source else ""
    body = body.split("\n\n\n")[0]
    return sum(1 for line in body.splitlines() if _KERNEL_CALL.match(line.strip()))


class GraphKernels:
    """The kernel calls of the compiled graphs run inside :func:`compiled_graphs_counted`."""

    def __init__(self) -> None:
        self.kernels = 0


@contextlib.contextmanager
def compiled_graphs_counted() -> Iterator[GraphKernels]:
    """While inside: each call of an inductor graph (``CompiledFxGraph``: a forward or a backward) adds the kernel
    calls of its generated code (:func:`kernel_calls` of its ``source_code``) to the yielded tally and runs with every
    dispatch mode switched off, and so does each call of a :class:`CompiledFunction` (dynamo cannot trace under a
    dispatch mode). A :class:`LaunchCounter` around the call then counts what runs outside the graphs."""
    from torch._inductor.output_code import CompiledFxGraph
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _disable_current_modes

    tally = GraphKernels()
    graph_call, function_call = CompiledFxGraph.__call__, CompiledFunction.__call__

    def counted_graph(self: Any, inputs: Any) -> Any:
        tally.kernels += kernel_calls(self.source_code)
        with _disable_current_modes():
            return graph_call(self, inputs)

    def modeless_function(self: Any, *args: Any) -> Any:
        # the torch-function modes too: dynamo guards on their stack (a counter's would be a recompile)
        function_modes = _get_current_function_mode_stack()
        for _ in function_modes:
            torch._C._pop_torch_function_stack()
        try:
            with _disable_current_modes():
                return function_call(self, *args)
        finally:
            for mode in function_modes:
                torch._C._push_on_torch_function_stack(mode)

    CompiledFxGraph.__call__, CompiledFunction.__call__ = counted_graph, modeless_function  # type: ignore[method-assign]
    try:
        yield tally
    finally:
        CompiledFxGraph.__call__, CompiledFunction.__call__ = graph_call, function_call  # type: ignore[method-assign]


def count_with_graphs(call: Callable[[], None]) -> tuple[int, int, int]:
    """``(ops outside the graphs + the graphs' kernel calls, host syncs, the graphs' kernel calls)`` of ``call``
    (compiled beforehand: a call that compiles counts the compiler's own ops)."""
    with compiled_graphs_counted() as graphs, count_host_syncs() as syncs, LaunchCounter() as ops:
        call()
    return ops.count + graphs.kernels, len(syncs), graphs.kernels


def cuda_launches(call: Callable[[], None]) -> int:
    """Device kernels and memory operations that ``call`` launches, by ``torch.profiler`` (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def loss_call(loss_fn: Any, p: Any, x0: torch.Tensor, backward: bool) -> Callable[[], None]:
    def call() -> None:
        x = x0.clone().requires_grad_(True)
        loss, _ = loss_fn(
            next_token_logprobs=x,
            data=p.data,
            global_valid_seqs=p.global_valid_seqs,
            global_valid_toks=p.global_valid_toks,
        )
        if backward:
            loss.backward()

    return call


def fused_call(loss_fn: Any, p: Any) -> Callable[[], None]:
    """``fused_linear_pg_loss`` forward + backward over :data:`CHUNKS` chunks (the single pass for these configs), on
    leaves made here (outside what a counter around the call sees)."""
    h, w = p.hidden.clone().requires_grad_(True), p.weight.clone().requires_grad_(True)

    def call() -> None:
        h.grad = w.grad = None
        loss, _ = fused_linear_pg_loss(
            loss_fn,
            h,
            w,
            p.target,
            p.data,
            p.global_valid_seqs,
            p.global_valid_toks,
            chunk_size=p.target.numel() // CHUNKS,
        )
        loss.backward()

    return call


def chunk_step_call(loss_fn: CompiledLoss, p: Any, x0: torch.Tensor) -> Callable[[], None]:
    """One chunk's ``[n]`` step of the single pass (``chunk_step``: log-probs from the merged partials and dL/dc)
    through the compiled loss, on the first of :data:`CHUNKS` chunks."""
    prepared = PreparedInputs.of(loss_fn, x0, p.data, p.global_valid_seqs, p.global_valid_toks)
    inputs = loss_fn.with_count_tensors(prepared.inputs)
    token_grad = loss_fn.token_gradient(inputs, prepared.layout)
    step = loss_fn.compiled_function(chunk_step)
    c = x0.reshape(-1)
    first = slice(0, c.numel() // CHUNKS)
    merged = SoftmaxPartials(torch.zeros_like(c[first]), torch.ones_like(c[first]), c[first].clone(), None)
    out = torch.empty_like(c[first])

    def call() -> None:
        token_grad.prefix = None if token_grad.prefix is None else PrefixCarry(loss_fn.config, prepared.layout)
        t, a, prefix = token_grad.chunk_inputs(first)
        step(t, a, prefix, merged, None, None, out, None)

    return call


def count_compiled(config: dict[str, Any], device: str = "cpu") -> dict[str, int]:
    """The eager and the compiled loss of ``config`` on the same problem (the epilogue, one chunk's step, the fused
    single pass): CPU counts as the module docstring says, CUDA counts by the profiler."""
    p = make_problem(4, 65, 32, 256, base_logprobs="model", device=torch.device(device))
    eager = build_loss_fn(config)
    compiled = CompiledLoss(build_loss_fn(config))
    x0 = p.data["prev_logprobs"][:, 1:].to(torch.float32).clone()
    out: dict[str, int] = {}
    calls = {
        "compiled": lambda fn: loss_call(fn, p, x0, False),
        "compiled+bwd": lambda fn: loss_call(fn, p, x0, True),
        f"compiled_fused_{CHUNKS}_chunks": lambda fn: fused_call(fn, p),
    }
    if device == "cuda":
        for label, make in calls.items():
            for name, fn in (("eager", eager), ("compiled", compiled)):
                call = make(fn)
                call()  # compiles, warms up
                out[f"cuda_{name}_{label}"] = cuda_launches(call)
        return out
    for label, make in calls.items():
        call = make(compiled)
        call()  # compiles (minutes on a loaded CPU, seconds from inductor's cache)
        out[label], out[f"syncs_{label}"], out[f"graph_kernels_{label}"] = count_with_graphs(call)
    step = chunk_step_call(compiled, p, x0)
    step()
    out["compiled_chunk_step"], _, _ = count_with_graphs(step)
    return out


def main(argv: list[str] | None = None) -> dict[str, dict[str, int]]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    parser.add_argument("--compiled", action="store_true", help="count the compiled epilogue too (compiles per config)")
    parser.add_argument("--device", default="cpu", help="cuda: count launches with the profiler (needs a GPU)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    if args.device == "cuda":
        result = {name: count_compiled(config, "cuda") for name, config in CONFIGS.items()}
    else:
        result = {name: count_config(config) for name, config in CONFIGS.items()}
        if args.compiled:
            for name, config in CONFIGS.items():
                result[name].update(count_compiled(config))
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        import nemo_is_plugin

        print(f"non-view aten ops and host syncs per call ({args.device}), {nemo_is_plugin.__file__}")
        columns = list(next(iter(result.values())))
        print(f"{'config':<16}" + "".join(f"{c:>22}" for c in columns))
        for name, counts in result.items():
            print(f"{name:<16}" + "".join(f"{counts[c]:>22}" for c in columns))
    return result


if __name__ == "__main__":
    main()
