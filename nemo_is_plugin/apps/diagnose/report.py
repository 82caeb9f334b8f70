"""The Python API: ``diagnose(dump) -> DiagnoseReport`` (analysis + recommendation; print, plot, JSON)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nemo_is_plugin.apps.diagnose.analysis import Analysis, analyze
from nemo_is_plugin.apps.diagnose.dump import LOGPROB_TOLERANCE, DumpError, RolloutDump
from nemo_is_plugin.apps.diagnose.readers import read_dump
from nemo_is_plugin.apps.diagnose.recommend import DEFAULT_CRITERIA, Criteria, Recommendation, recommend
from nemo_is_plugin.apps.diagnose.settings import DEFAULT_TRUNCATIONS, IS_LEVELS, settings_grid

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass
class DiagnoseReport:
    analysis: Analysis
    recommendation: Recommendation
    criteria: Criteria

    def print(self, console: Any = None, *, detail: bool = False) -> None:
        """Rich tables on ``console`` (a ``rich.console.Console``; stdout by default)."""
        from nemo_is_plugin.apps.diagnose.tables import render

        render(self.analysis, self.recommendation, console, detail=detail, criteria=self.criteria)

    def plot(self, out_dir: str | Path, prefix: str = "diagnose") -> list[Path]:
        """Write the PNG plots into ``out_dir``; returns their paths."""
        from nemo_is_plugin.apps.diagnose.plots import write_plots

        return write_plots(self.analysis, out_dir, prefix)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (NaN/inf written as null / strings)."""
        a, rec = self.analysis, self.recommendation
        return _clean(
            {
                "source": a.source,
                "dtype": a.dtype,
                "num_responses": a.num_responses,
                "num_tokens": a.num_tokens,
                "bins": [b.label for b in a.bins],
                "mismatch": a.mismatch,
                "mismatch_by_bin": dict(zip((b.label for b in a.bins), a.mismatch_by_bin)),
                "settings": {
                    r.setting.name: {
                        "loss_fn": r.setting.loss_fn_keys(),
                        "overall": asdict(r.overall),
                        "by_bin": {b.label: asdict(st) for b, st in zip(a.bins, r.by_bin)},
                        "failures": rec.failures.get(r.setting.name, []),
                    }
                    for r in a.settings
                },
                "skipped": dict(a.skipped),
                "num_valid_tokens": int(a.valid_lengths.sum()),
                "recommendation": {
                    "name": rec.name,
                    "ok": rec.ok,
                    "loss_fn": rec.loss_fn,
                    "reasons": rec.reasons,
                    "warnings": rec.warnings,
                },
                "criteria": asdict(self.criteria),
            }
        )


def diagnose(
    source: str | Path | RolloutDump,
    *,
    levels: Sequence[str] = IS_LEVELS,
    truncations: Sequence[str] = DEFAULT_TRUNCATIONS,
    bounds: Mapping[str, tuple[float | None, float]] | None = None,
    veto: float | None = None,
    dtype: str = "float32",
    max_bins: int = 6,
    edges: Sequence[int] | None = None,
    steps: Sequence[int] | None = None,
    config: str | None = None,
    criteria: Criteria | None = None,
    tolerance: float = LOGPROB_TOLERANCE,
) -> DiagnoseReport:
    """Read (if needed), filter, analyse and recommend.

    Args:
        source: a dump path (JSONL / Parquet / run directory) or a :class:`RolloutDump`.
        levels, truncations, bounds, veto: the settings grid (``settings.settings_grid``).
        dtype: "float32" (what the loss computes in; reproduces its overflow) or "float64".
        max_bins, edges: response-length bins.
        steps: keep only responses of these ``step`` values. config: keep only responses with this ``config`` label.
        criteria: thresholds of the recommendation.
        tolerance: largest log-prob accepted when reading.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    dump = source if isinstance(source, RolloutDump) else read_dump(source, tolerance=tolerance)
    dump = _filter(dump, steps, config)
    settings, skipped = settings_grid(levels, truncations, bounds=bounds, veto=veto)
    if not settings:
        raise ValueError("no valid setting to diagnose: " + "; ".join(f"{n}: {r}" for n, r in skipped))
    crit = criteria or DEFAULT_CRITERIA
    analysis = analyze(dump, settings, dtype=_DTYPES[dtype], max_bins=max_bins, edges=edges, skipped=skipped)
    return DiagnoseReport(analysis, recommend(analysis, crit), crit)


def _filter(dump: RolloutDump, steps: Sequence[int] | None, config: str | None) -> RolloutDump:
    keep = np.ones(dump.num_responses, dtype=bool)
    if steps is not None:
        if dump.step is None:
            raise DumpError(f"{dump.source}: no 'step' in the dump; cannot select steps {list(steps)}")
        keep &= np.isin(dump.step, np.asarray(list(steps), dtype=np.int64))
    if config is not None:
        if dump.config is None:
            raise DumpError(f"{dump.source}: no 'config' labels in the dump; cannot select config {config!r}")
        keep &= np.asarray([c == config for c in dump.config])
    if not keep.any():
        have_steps = sorted(set(dump.step.tolist())) if dump.step is not None else []
        have_cfg = sorted(set(dump.config)) if dump.config is not None else []
        raise DumpError(
            f"{dump.source}: no response matches steps={steps} config={config!r} "
            f"(steps present: {have_steps[:20]}, configs present: {have_cfg[:20]})"
        )
    return dump if keep.all() else dump.select(keep)


def _clean(obj: Any) -> Any:
    """Make floats JSON-safe: NaN -> None, +-inf -> "inf"/"-inf"; numpy scalars -> Python."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float):
        if math.isnan(obj):
            return None
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
    return obj
