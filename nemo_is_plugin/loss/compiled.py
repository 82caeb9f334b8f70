"""The loss epilogue compiled: the loss and its metrics, forward and backward, as a few fused kernels and one host read.

On a GPU the eager loss (:class:`~nemo_is_plugin.loss.clipped_pg.ClippedPGLoss`) is hundreds of small kernels on
``[N]`` token vectors, each a launch the CPU pays for (docs/gpu_runs.md), plus two host reads (the inputs' value checks,
the metrics). :class:`CompiledLoss` runs the same code, the eager functions themselves, through ``torch.compile``
(inductor) as one graph per configuration: the per-token terms, the loss, every metric stacked in one float64 vector
and the inputs' value-check reductions, forward and (AOTAutograd) backward. Nothing is copied: the eager path is the
reference, and it stays the path of what the graph does not cover (below).

- **Shapes**: ``dynamic=True``: one compile per configuration and input structure (which optional inputs are present,
  their dtypes), none as the batch or sequence lengths change (``tests/loss/test_compiled.py`` asserts it with
  ``torch._dynamo``'s compile counter, ``tests/loss/test_compiled_configs.py`` for several configs in one process).
  Sizes 0 and 1 are specialised by torch, so a batch of 1 sequence, or of 1 token per sequence, is one more compile.
  dynamo also guards on how the tensors are laid out: a call whose inputs are views of larger tensors after calls
  with fresh tensors (or the reverse), or strided slices after contiguous tensors, compiles one more graph (measured:
  2-3 graphs for mixed kinds, then none). NeMo-RL's call slices every input ``[:, 1:]`` itself, the same kind each
  call; a ``compute`` caller that mixes kinds pays one graph per kind (up to dynamo's limit of 8, then eager).
- **Host reads**: one per call. The metrics' vector and the inputs' check reductions come out of the graph together
  and are read with one ``tolist()``; then the inputs' checks raise as eager would (the same messages; the bad entry
  located on the error path only), and a non-finite loss is diagnosed by rerunning the eager loss, which raises.
- **Covered**: single-process layouts (padded and packed :class:`~nemo_is_plugin.loss.layout.TokenLayout`, no
  context-parallel group, no DP batch group), NeMo-RL's call with ``next_token_logprobs``, ``compute`` on aligned
  inputs (score centering's head included). Not covered, run eagerly with a one-time warning naming the reason (never
  silently): a context-parallel or batch-grouped layout (their metric reductions are collectives), ``logits=`` calls,
  and ``compute`` with a caller's precomputed IS correction or extra metric sums.
- **The fused single pass** (``fused_linear_pg_loss(CompiledLoss(...))``): :meth:`CompiledLoss.token_gradient` (the
  batch constants, one graph) and :meth:`CompiledLoss.compiled_function` (each chunk's step, the torch backend's chunk
  passes; one :class:`CompiledFunction` per function and loss, with its own graph cache) give the entry point its
  graphs; the inputs' checks travel unread (:class:`PreparedInputs`) to the loss's one read at the end.

Selection: explicit, ``CompiledLoss(build_loss_fn(section))``; nothing selects it automatically (no GPU has run it
yet: docs/performance.md). A config the graph cannot hold is said once (a warning naming the reason) and runs eagerly.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from nemo_is_plugin.common.once import warn_once
from nemo_is_plugin.loss.aligned_inputs import LossInputs, align_nemo_rl_inputs_unread
from nemo_is_plugin.loss.clipped_pg import ClippedPGLoss
from nemo_is_plugin.loss.correction import ISCorrection
from nemo_is_plugin.loss.denominator import Denominator
from nemo_is_plugin.loss.input_values import PendingInputChecks
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.metrics import MetricValues
from nemo_is_plugin.loss.output_checks import warn_input_anomalies
from nemo_is_plugin.loss.separable import TokenLossGradient, batch_constants

Epilogue = Callable[[LossInputs, TokenLayout, "PendingInputChecks | None"], tuple[torch.Tensor, torch.Tensor]]


def epilogue(loss: ClippedPGLoss) -> Epilogue:
    """The graph ``torch.compile`` sees: ``(inputs, layout, check tensors) -> (loss, values)``, ``values`` the metrics'
    float64 vector (:meth:`~nemo_is_plugin.loss.metrics.MetricBook.stacked`) followed by the inputs' check reductions
    (:meth:`~nemo_is_plugin.loss.input_values.PendingInputChecks.scalars`, computed inside the graph)."""

    def run(
        inputs: LossInputs, layout: TokenLayout, pending: PendingInputChecks | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        terms = loss.terms(inputs, layout)
        parts = loss.reduce(terms)
        _, _, values = loss.metric_book(terms, parts).stacked(None)
        assert values is not None  # the loss always reports metrics
        checks = [] if pending is None else pending.scalars()  # the inputs' check reductions, in the same graph
        return parts.loss, torch.cat([values, *(c.detach().double().reshape(1) for c in checks)])

    return run


def own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` behind a code object of its own: dynamo keeps its compiled graphs per code object (at most
    ``torch._dynamo.config.cache_size_limit`` of them, 8), so the losses of several configs in one process would
    otherwise share, and overflow, one cache; then a config would recompile on every call, or run eagerly."""

    def run(*args: Any) -> Any:
        return fn(*args)

    run.__code__ = run.__code__.replace()
    return run


def _constant(value: Any) -> Callable[[Any], Any]:
    return lambda _self: value


def config_snapshot(config: Any) -> Any:
    """``config`` with the package's properties on it read once: an instance of a subclass of its class (every
    ``isinstance`` and field read as before) whose properties return those values. Dynamo then reads constants instead
    of tracing a property that builds a pydantic model (``rejection_rules``), which it cannot. The compiled loss sees
    the config as it was when the loss was compiled."""
    cls = type(config)
    values = {}
    for name in dir(cls):
        prop = getattr(cls, name, None)
        if isinstance(prop, property) and prop.fget is not None and prop.fget.__module__.startswith("nemo_is_plugin."):
            values[name] = getattr(config, name)
    namespace: dict[str, Any] = {n: property(_constant(v)) for n, v in values.items()}
    namespace.update(__module__=__name__, __qualname__=f"{cls.__qualname__}Snapshot")
    snapshot_cls: Any = type(f"{cls.__name__}Snapshot", (cls,), namespace)
    return snapshot_cls.model_construct(**{name: getattr(config, name) for name in cls.model_fields})


def compile_blocker(layout: TokenLayout) -> str | None:
    """Why the compiled epilogue cannot run on ``layout``; None when it can."""
    if type(layout) is not TokenLayout:
        return f"a {type(layout).__name__} (its metric reductions are collectives)"
    if layout._batch_group is not None:
        return "a layout with a DP batch group (its batch statistics are all-reduced)"
    return None


_EAGER_CALL = inspect.signature(ClippedPGLoss.__call__)  # the one signature both calls take


class CompiledLoss:
    """``loss`` with its epilogue compiled: called like :class:`ClippedPGLoss` (NeMo-RL's signature), same loss,
    gradient and metrics, one host read per call. ``compile_options``: passed to ``torch.compile`` (``dynamic=True``
    and ``fullgraph=True`` by default: a graph break is an error, not a silent split)."""

    def __init__(self, loss: ClippedPGLoss, **compile_options: Any):
        self.loss, self.config = loss, loss.config
        self.options = {"dynamic": True, "fullgraph": True, **compile_options}
        self.traced = copy.copy(loss)  # the loss the graphs trace: its config's properties read once
        self.traced.config = config_snapshot(loss.config)
        self.compiled = CompiledFunction(epilogue(self.traced), self.options)
        self.code = self.compiled.code  # the epilogue's code object: its cache entries are this loss's graphs
        # metric names and denominators per input structure, from a shape-only trace (no values, no host read)
        self._names: dict[tuple, tuple[list[str], dict[str, Denominator]]] = {}
        self._functions: dict[Callable[..., Any], CompiledFunction] = {}

    def __getattr__(self, name: str) -> Any:  # prepare, compute, metric_denominators, ...: the eager loss's
        return getattr(self.loss, name)

    def __call__(self, *args: Any, **kw: Any) -> tuple[torch.Tensor, MetricValues]:
        """:meth:`ClippedPGLoss.__call__`'s arguments (NeMo-RL's, with ``layout`` and ``logits``), bound by its own
        signature, and passed on to it unchanged where this call runs the eager loss."""

        def eager(reason: str) -> tuple[torch.Tensor, MetricValues]:
            _say_eager(reason)
            return self.loss(*args, **kw)

        call = _EAGER_CALL.bind(self.loss, *args, **kw)
        call.apply_defaults()
        a = call.arguments
        layout: TokenLayout | None = a["layout"]
        if a["logits"] is not None:
            return eager("logits= calls are not compiled (pass next_token_logprobs)")
        if layout is not None and (why := compile_blocker(layout)) is not None:
            return eager(f"not compiled on {why}")
        inputs, layout, pending = align_nemo_rl_inputs_unread(
            self.config, a["next_token_logprobs"], a["data"], a["global_valid_seqs"], a["global_valid_toks"], layout
        )
        return self.compute_unread(inputs, layout, pending)

    def compute(
        self,
        inputs: LossInputs,
        layout: TokenLayout,
        *,
        is_correction: ISCorrection | None = None,
        extra_metric_sums: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, MetricValues]:
        """:meth:`ClippedPGLoss.compute` compiled: the loss and metrics of aligned inputs (no value checks, as the eager
        ``compute`` makes none), one host read. A caller's precomputed ``is_correction`` or ``extra_metric_sums`` are
        not graph inputs: that call runs the eager loss (said once)."""
        if is_correction is not None or extra_metric_sums is not None:
            _say_eager("compute with a precomputed is_correction or extra_metric_sums is not compiled")
            return self.loss.compute(inputs, layout, is_correction=is_correction, extra_metric_sums=extra_metric_sums)
        if not self.compiles(layout):
            return self.loss.compute(inputs, layout)
        return self.compute_unread(inputs, layout)

    def compute_unread(
        self,
        inputs: LossInputs,
        layout: TokenLayout,
        pending: PendingInputChecks | None = None,
    ) -> tuple[torch.Tensor, MetricValues]:
        """The compiled loss of aligned inputs whose value checks ``pending`` are not read yet (their reductions run
        in the graph): one host read of the metrics and the checks together; a bad input raises first, as in
        eager."""
        inputs = self.with_count_tensors(inputs)
        names, denominators = self._metric_names(inputs, layout)
        if self.compiled.compiled is None:  # dynamo could not compile this config: said once, eager since
            return self._eager_unread(inputs, layout, pending)
        loss, values = self.compiled(inputs, layout, pending)
        host = values.tolist()  # the call's one host read
        if pending is not None:
            pending.raise_if_bad(host[len(names) :])
        metrics = MetricValues(dict(zip(names, host)), denominators)
        if not math.isfinite(metrics.get("loss", 0.0)) or metrics.get("probs_ratio_max") == math.inf:
            self.loss.compute(inputs, layout)  # error path only: the eager loss diagnoses the overflow, and raises
        warn_input_anomalies(metrics)
        return loss, metrics

    def _eager_unread(self, inputs, layout, pending) -> tuple[torch.Tensor, MetricValues]:
        if pending is not None:
            pending.run()
        return self.loss.compute(inputs, layout)

    # ------------------------------------------------------------------ the parts the fused single pass compiles
    def compiles(self, layout: TokenLayout) -> bool:
        """Whether this loss's graphs run on ``layout`` (a one-time warning naming the reason when not)."""
        why = compile_blocker(layout)
        if why is not None:
            _say_eager(f"not compiled on {why}")
        return why is None and self.compiled.compiled is not None

    @staticmethod
    def with_count_tensors(inputs: LossInputs) -> LossInputs:
        """``inputs`` with Python-number global counts as 0-d float64 tensors (a number would be a compile-time
        constant: a recompile per value); the caller's inputs are left as they are."""
        seqs, toks = inputs.global_valid_seqs, inputs.global_valid_toks
        if isinstance(seqs, torch.Tensor) and isinstance(toks, torch.Tensor):
            return inputs
        device = inputs.curr_logprobs.device

        def as_count(c: torch.Tensor | float) -> torch.Tensor:
            return c if isinstance(c, torch.Tensor) else torch.as_tensor(c, dtype=torch.float64, device=device)

        return dataclasses.replace(inputs, global_valid_seqs=as_count(seqs), global_valid_toks=as_count(toks))

    def compiled_function(self, fn: Callable[..., Any]) -> CompiledFunction:
        """``fn`` compiled with this loss's options, once per loss (its own graph cache)."""
        if fn not in self._functions:
            self._functions[fn] = CompiledFunction(fn, self.options)
        return self._functions[fn]

    def token_gradient(self, inputs: LossInputs, layout: TokenLayout) -> TokenLossGradient:
        """:meth:`TokenLossGradient.build` with the batch constants computed by one compiled graph (their config is
        the snapshot the graphs read, so a chunk step compiled on them reads constants too)."""
        return TokenLossGradient.build(self.traced, inputs, layout, self.compiled_function(batch_constants))

    def _metric_names(self, inputs: LossInputs, layout: TokenLayout) -> tuple[list[str], dict[str, Denominator]]:
        key = tuple(None if v is None else (v.dtype, v.dim()) for v in _tensors(inputs)) + (layout.is_padded,)
        if key not in self._names:
            meta = LossInputs(**{k: _on_meta(v) for k, v in vars(inputs).items()})
            meta_layout = TokenLayout(
                _on_meta(layout.seq_index),
                _on_meta(layout.position),
                layout.num_seqs,
                padded=layout.is_padded,
                in_order=True,
            )
            terms = self.loss.terms(meta, meta_layout)
            book = self.loss.metric_book(terms, self.loss.reduce(terms))
            names, _, _ = book.stacked(None)
            self._names[key] = (names, book.denominators)
        return self._names[key]


class CompiledFunction:
    """``torch.compile`` of ``fn`` (behind a code object of its own); a config dynamo cannot compile is said once (a
    warning with the reason) and runs ``fn`` eagerly from then on."""

    def __init__(self, fn: Callable[..., Any], options: Mapping[str, Any]):
        self.fn = fn
        run = own_code(fn)
        self.code = run.__code__  # dynamo's compiled graphs of ``fn`` are this code object's cache entries
        self.compiled: Callable[..., Any] | None = torch.compile(run, **options)

    def __call__(self, *args: Any) -> Any:
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.BackendCompilerFailed) as err:
                self.compiled = None
                name = getattr(self.fn, "__qualname__", repr(self.fn))
                warn_once(f"compiled {name} {id(self)}", f"compiled {name}: cannot compile ({err}); eager from now on")
        return self.fn(*args)


@dataclass
class PreparedInputs:
    """A NeMo-RL call's arguments aligned (:meth:`of`): for a :class:`CompiledLoss` with the inputs' value checks
    ``pending`` (read with the metrics, in the call's one host read), for an eager loss already checked (``pending``
    None)."""

    inputs: LossInputs
    layout: TokenLayout
    pending: PendingInputChecks | None = None

    @classmethod
    def of(
        cls,
        loss_fn: ClippedPGLoss | CompiledLoss,
        next_token_logprobs: torch.Tensor,
        data: Mapping[str, torch.Tensor],
        global_valid_seqs: torch.Tensor | float,
        global_valid_toks: torch.Tensor | float,
        layout: TokenLayout | None = None,
    ) -> PreparedInputs:
        args = (next_token_logprobs, data, global_valid_seqs, global_valid_toks, layout)
        if isinstance(loss_fn, CompiledLoss):
            return cls(*align_nemo_rl_inputs_unread(loss_fn.config, *args))
        return cls(*loss_fn.prepare(*args))

    def read_checks(self) -> None:
        """Read the pending checks now (one host read; eager paths) and raise for a bad input; no-op without."""
        if self.pending is not None:
            self.pending.run()
            self.pending = None


def _say_eager(reason: str) -> None:
    """Once per reason: why a call runs the eager loss (never silently)."""
    warn_once(f"compiled epilogue: {reason}", f"compiled epilogue: {reason}; this call runs the eager loss")


def _tensors(inputs: Any) -> list[torch.Tensor | None]:
    """The tensors of ``inputs``' fields in order, None for any other value; a dataclass field (score centering's
    head) contributes its own fields' (the metric names depend on which of them are present)."""
    out: list[torch.Tensor | None] = []
    for v in vars(inputs).values():
        out.extend(_tensors(v) if dataclasses.is_dataclass(v) else [v if isinstance(v, torch.Tensor) else None])
    return out


def _on_meta(v: Any) -> Any:
    """``v`` with every tensor, also those of a dataclass (score centering's head), as a meta tensor."""
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return dataclasses.replace(v, **{f.name: _on_meta(getattr(v, f.name)) for f in dataclasses.fields(v)})
    return torch.empty_like(v, device="meta") if isinstance(v, torch.Tensor) else v
