"""One results dict from several ``nemo-is bench`` runs of the same setting on different model shapes.

Why: on a lent GPU every minute counts and a run killed at its time limit writes nothing, so the GPU check runs one
model per process (``scripts/gpu_check.sh``) and the report is rendered from the parts (``--from-json`` given
several times). Parts must agree on everything but the shapes: the same device, dtype, tokens, paths and repeats,
else the ratios of the merged table would compare different measurements.
"""

from __future__ import annotations

# config keys that may differ between the parts (they describe what each part covered)
_PER_PART_KEYS = ("shapes",)


def merge_results(parts: list[dict]) -> dict:
    """The parts' rows in order, their shapes concatenated; ``skipped`` united; the first Triton fallback and the
    first non-empty memory sweep kept. Raises ValueError when the parts' settings or machines differ."""
    if not parts:
        raise ValueError("nothing to merge: no results given")
    first = parts[0]
    if len(parts) == 1:
        return first
    setting = {k: v for k, v in first["config"].items() if k not in _PER_PART_KEYS}
    for i, part in enumerate(parts[1:], start=1):
        other = {k: v for k, v in part["config"].items() if k not in _PER_PART_KEYS}
        if other != setting:
            diff = sorted(k for k in setting.keys() | other.keys() if setting.get(k) != other.get(k))
            raise ValueError(f"results {i} was measured with another setting ({', '.join(diff)}): not merged")
        if part["machine"].get("device_name") != first["machine"].get("device_name"):
            raise ValueError(f"results {i} was measured on another device: not merged")
    names = [s["name"] for p in parts for s in p["config"]["shapes"]]
    if len(set(names)) != len(names):
        raise ValueError(f"a model shape is in more than one of the results: {names}")
    skipped: dict[str, str] = {}
    for part in parts:
        skipped.update(part["skipped"])
    return dict(
        first,
        config=dict(first["config"], shapes=[s for p in parts for s in p["config"]["shapes"]]),
        rows=[r for p in parts for r in p["rows"]],
        memory_sweep=next((p["memory_sweep"] for p in parts if p.get("memory_sweep")), first.get("memory_sweep")),
        memory_direct=next((p["memory_direct"] for p in parts if p.get("memory_direct")), first.get("memory_direct")),
        skipped=skipped,
        triton_fallback=next((p["triton_fallback"] for p in parts if p.get("triton_fallback")), None),
    )


__all__ = ["merge_results"]
