"""Compare the host's loss with the plugin's: loss, gradient and every metric the host reports, at stated tolerances.

Two comparisons make a report (:func:`run_compat`):

1. **parity**: the plugin built from the part of the config the host knows against the host itself. Every output must
   agree, or differ in a way the plugin's documentation names as deliberate (the host's :meth:`Host.deliberate` says
   which, and where it is documented). A setting the plugin runs differently from the host by design (the host's
   :attr:`Host.deliberate_settings`) is a row of its own, ``documented``. This is what the exit status reports.
2. **changes** (only when the config sets plugin keys): the plugin with every key against the host. Outputs that
   differ are not failures: they are *changed by* the plugin keys that change them when set alone (a key that is not
   valid alone is tried only with the others).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from nemo_is_plugin.apps.compat.batches import CompatBatch

AGREES, DIFFERS, DELIBERATE, CHANGED, PLUGIN_ONLY = "agrees", "differs", "documented", "changed", "plugin only"
_RANK = {AGREES: 0, PLUGIN_ONLY: 0, DELIBERATE: 1, CHANGED: 2, DIFFERS: 3}


@dataclass(frozen=True)
class Run:
    """One loss call: the loss, d loss / d current log-probs (float64) and the metrics as floats."""

    loss: float
    grad: torch.Tensor
    metrics: dict[str, float]


@dataclass(frozen=True)
class Refusal:
    """The loss refused the config or the batch (its exception, as text)."""

    message: str


Outcome = Run | Refusal


def run_call(call: Callable[[], tuple[Any, Any, torch.Tensor]]) -> Outcome:
    """``call() -> (loss, metrics, logprobs leaf)`` as a :class:`Run` (backward included), or a :class:`Refusal` when
    it raises: a host that rejects a config or a batch is an outcome to compare, not a crash."""
    try:
        loss, metrics, leaf = call()
        loss.backward()
    except Exception as exc:  # noqa: BLE001 - any refusal of either loss is reported with its message
        return Refusal(f"{type(exc).__name__}: {exc}".strip())
    grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
    values = {str(k): float(v) for k, v in dict(metrics).items()}
    return Run(float(loss.detach()), grad.detach().double(), values)


class Host(Protocol):
    """A host trainer as ``nemo-is compat`` sees it (:class:`~nemo_is_plugin.apps.compat.nemo_rl_host.NeMoRLHost`,
    :class:`~nemo_is_plugin.apps.compat.verl_host.VerlHost`)."""

    name: str
    host_keys: dict[str, Any]
    plugin_keys: dict[str, Any]
    # setting -> the documented reason the plugin runs it differently from the host (and how it is then compared)
    deliberate_settings: dict[str, str]

    def run_host(self, batch: CompatBatch) -> Outcome: ...

    def run_plugin(self, batch: CompatBatch, plugin_keys: dict[str, Any]) -> Outcome: ...

    def deliberate(self, kind: str, name: str, batch: CompatBatch) -> str | None:
        """The documented reason why output ``name`` may differ on ``batch`` (``kind``: ``nan_gradient`` or
        ``missing_metric``), or None."""
        ...


@dataclass(frozen=True)
class Tolerances:
    """|plugin - host| <= atol + rtol * |host|; the gradient's rtol scales with max |host gradient|."""

    loss_rtol: float = 1e-5
    loss_atol: float = 1e-7
    grad_rtol: float = 1e-5
    grad_atol: float = 1e-8
    metric_rtol: float = 1e-5
    metric_atol: float = 1e-6

    def describe(self) -> str:
        return (
            f"loss rtol {self.loss_rtol:g} atol {self.loss_atol:g}; gradient |diff| <= {self.grad_atol:g} + "
            f"{self.grad_rtol:g} * max|host gradient|; metrics rtol {self.metric_rtol:g} atol {self.metric_atol:g}"
        )


@dataclass
class Finding:
    """One output over every batch: its worst status, the largest differences and the batch they came from, with the
    host's and the plugin's values there (the gradient's: the norms of its finite entries)."""

    output: str
    status: str
    abs_diff: float = 0.0
    rel_diff: float = 0.0
    batch: str = ""
    notes: list[str] = field(default_factory=list)
    host_value: float | None = None
    plugin_value: float | None = None

    def merge(self, other: Finding) -> None:
        if _RANK[other.status] > _RANK[self.status]:
            self.status = other.status
        if not other.abs_diff <= self.abs_diff:  # nan compares false: a nan difference is kept
            self.abs_diff, self.rel_diff, self.batch = other.abs_diff, other.rel_diff, other.batch
            self.host_value, self.plugin_value = other.host_value, other.plugin_value
        self.notes += [n for n in other.notes if n not in self.notes]


def _scalar(output: str, host: float, plugin: float, rtol: float, atol: float, batch: str) -> Finding:
    if (math.isnan(host) and math.isnan(plugin)) or (math.isinf(host) and host == plugin):
        return Finding(output, AGREES, batch=batch, host_value=host, plugin_value=plugin)
    if not (math.isfinite(host) and math.isfinite(plugin)):
        notes = [f"plugin {plugin} vs host {host}"]
        return Finding(output, DIFFERS, math.inf, math.inf, batch, notes, host_value=host, plugin_value=plugin)
    diff = abs(plugin - host)
    rel = diff / abs(host) if host != 0 else (0.0 if diff == 0 else math.inf)
    ok = diff <= atol + rtol * abs(host)  # False for any nan
    status, diff = (AGREES if ok else DIFFERS), (diff if not math.isnan(diff) else math.inf)
    return Finding(output, status, diff, rel, batch, host_value=host, plugin_value=plugin)


def _gradient(host: torch.Tensor, plugin: torch.Tensor, tol: Tolerances, note: str | None, batch: str) -> Finding:
    if host.shape != plugin.shape:
        return Finding("gradient", DIFFERS, math.inf, math.inf, batch, [f"shape {tuple(plugin.shape)} vs host's"])
    both = torch.isfinite(host) & torch.isfinite(plugin)
    same_nonfinite = bool(((host == plugin) | (host.isnan() & plugin.isnan()))[~both].all())
    scale = float(host[both].abs().max()) if bool(both.any()) else 0.0
    diff = float((host - plugin)[both].abs().max()) if bool(both.any()) else 0.0
    found = Finding("gradient", AGREES, diff, diff / scale if scale else 0.0, batch)
    found.host_value, found.plugin_value = float(host[both].norm()), float(plugin[both].norm())
    if diff > tol.grad_atol + tol.grad_rtol * scale:
        found.status = DIFFERS
    elif not same_nonfinite:
        found.status, found.abs_diff = (DELIBERATE, diff) if note else (DIFFERS, math.inf)
        found.notes.append(note or "non-finite gradient entries differ")
    return found


def compare_outcomes(host: Host, batch: CompatBatch, theirs: Outcome, ours: Outcome, tol: Tolerances) -> list[Finding]:
    """Per-output findings of one batch (host = ``theirs``, plugin = ``ours``)."""
    if isinstance(theirs, Refusal) or isinstance(ours, Refusal):
        if isinstance(theirs, Refusal) and isinstance(ours, Refusal):
            return [Finding("refusal", AGREES, batch=batch.name, notes=[f"both refuse: {theirs.message[:200]}"])]
        who, what = ("host", theirs) if isinstance(theirs, Refusal) else ("plugin", ours)
        assert isinstance(what, Refusal)
        return [
            Finding("refusal", DIFFERS, math.inf, math.inf, batch.name, [f"only the {who} refuses: {what.message}"])
        ]
    out = [
        _scalar("loss", theirs.loss, ours.loss, tol.loss_rtol, tol.loss_atol, batch.name),
        _gradient(theirs.grad, ours.grad, tol, host.deliberate("nan_gradient", "gradient", batch), batch.name),
    ]
    for name, value in sorted(theirs.metrics.items()):
        output = f"metric {name}"
        if name in ours.metrics:
            out.append(_scalar(output, value, ours.metrics[name], tol.metric_rtol, tol.metric_atol, batch.name))
            continue
        note = host.deliberate("missing_metric", name, batch)
        status = DELIBERATE if note else DIFFERS
        out.append(Finding(output, status, math.inf, math.inf, batch.name, [note or "not reported by the plugin"]))
    out += [
        Finding(f"metric {n}", PLUGIN_ONLY, batch=batch.name) for n in sorted(set(ours.metrics) - set(theirs.metrics))
    ]
    return out


def compare_all(
    host: Host, batches: Sequence[CompatBatch], plugin_keys: dict[str, Any], tol: Tolerances
) -> dict[str, Finding]:
    """Findings merged over ``batches``, in first-seen order."""
    merged: dict[str, Finding] = {}
    for batch in batches:
        for found in compare_outcomes(host, batch, host.run_host(batch), host.run_plugin(batch, plugin_keys), tol):
            if found.output in merged:
                merged[found.output].merge(found)
            else:
                merged[found.output] = found
    return merged


@dataclass
class CompatReport:
    host: str
    config: str
    host_keys: dict[str, Any]
    plugin_keys: dict[str, Any]
    batches: list[str]
    tolerances: Tolerances
    parity: list[Finding]
    changes: list[Finding]
    unchanged: list[str] = field(default_factory=list)
    strict: bool = False

    @property
    def failures(self) -> list[Finding]:
        bad = {DIFFERS, DELIBERATE} if self.strict else {DIFFERS}
        return [f for f in self.parity if f.status in bad]

    @property
    def agrees(self) -> bool:
        return not self.failures


def _changed_by(host: Host, batches: Sequence[CompatBatch], tol: Tolerances, changed: list[str]) -> dict[str, list]:
    """For each changed output, the plugin keys that change it: those that change it when set alone, and those whose
    removal from the full set undoes the change (a set of keys the plugin refuses is skipped)."""
    keys = dict(host.plugin_keys)
    if len(keys) < 2:
        return {name: list(keys) for name in changed}
    by: dict[str, list[str]] = {name: [] for name in changed}
    for key in keys:
        alone = compare_all(host, batches, {key: keys[key]}, tol)
        without = compare_all(host, batches, {k: v for k, v in keys.items() if k != key}, tol)
        for name in changed:
            if _valid(alone) and name in alone and alone[name].status == DIFFERS:
                by[name].append(key)
            elif _valid(without) and name in without and without[name].status == AGREES:
                by[name].append(key)
    return by


def _valid(findings: dict[str, Finding]) -> bool:
    """Whether neither loss refused: a key set the plugin refuses says nothing about what a key changes."""
    return not any(f.output == "refusal" for f in findings.values())


def run_compat(
    host: Host, batches: Sequence[CompatBatch], config: str, tol: Tolerances | None = None, strict: bool = False
) -> CompatReport:
    """Parity on the host's part of the config, then (with plugin keys) what the plugin keys change."""
    tol = Tolerances() if tol is None else tol
    settings = [Finding(f"setting {k}", DELIBERATE, notes=[v]) for k, v in host.deliberate_settings.items()]
    parity = settings + list(compare_all(host, batches, {}, tol).values())
    changes: list[Finding] = []
    if host.plugin_keys:
        full = compare_all(host, batches, dict(host.plugin_keys), tol)
        changed = [f for f in full.values() if f.status == DIFFERS]
        by = _changed_by(host, batches, tol, [f.output for f in changed])
        for found in changed:
            keys = by[found.output] or list(host.plugin_keys)
            joint = "" if by[found.output] or len(keys) < 2 else " (together)"
            found.status = CHANGED
            found.notes = [f"changed by {', '.join(keys)}{joint}"] + [n for n in found.notes if "refuses" in n]
            changes.append(found)
        unchanged = [f.output for f in full.values() if f.status == AGREES]
    return CompatReport(
        host.name,
        config,
        dict(host.host_keys),
        dict(host.plugin_keys),
        [b.name for b in batches],
        tol,
        parity,
        changes,
        unchanged if host.plugin_keys else [],
        strict,
    )


__all__ = [
    "AGREES",
    "CHANGED",
    "DELIBERATE",
    "DIFFERS",
    "PLUGIN_ONLY",
    "CompatReport",
    "Finding",
    "Host",
    "Outcome",
    "Refusal",
    "Run",
    "Tolerances",
    "compare_all",
    "compare_outcomes",
    "run_call",
    "run_compat",
]
