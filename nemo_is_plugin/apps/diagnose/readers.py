"""Read a rollout dump from JSONL (optionally gzipped) or Parquet into a validated :class:`RolloutDump`.

Every malformed input raises :class:`DumpError` naming the file, the line (JSONL, 1-based) or row (Parquet,
0-based) and the key; no exception from json / pyarrow / numpy / pydantic escapes unwrapped. A JSONL record's shape
and types are checked by the pydantic model :class:`~nemo_is_plugin.apps.diagnose.record.DumpRecord`; a Parquet file's
by its column types.
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from nemo_is_plugin.apps.diagnose.dump import (
    ALIASES,
    LOGPROB_KEYS,
    LOGPROB_TOLERANCE,
    SCALAR_FLOAT_KEYS,
    SCALAR_INT_KEYS,
    DumpError,
    RolloutDump,
    build_dump,
)
from nemo_is_plugin.apps.diagnose.record import parse_record

_LIST_KEYS = (*LOGPROB_KEYS, "mask")
_DEFAULT_NAMES = ("rollouts.jsonl", "rollouts.jsonl.gz", "rollouts.parquet")


def read_dump(path: str | Path, *, tolerance: float = LOGPROB_TOLERANCE) -> RolloutDump:
    """Read ``path``: a ``.jsonl`` / ``.jsonl.gz`` / ``.parquet`` file, or a run directory holding ``rollouts.*``.

    The format is chosen by content (Parquet files start with ``PAR1``), so the extension may be anything.
    """
    p = Path(path)
    if p.is_dir():
        found = [p / n for n in _DEFAULT_NAMES if (p / n).is_file()]
        if not found:
            raise DumpError(f"{p} is a directory without {', '.join(_DEFAULT_NAMES)}; pass the dump file itself")
        p = found[0]
    if not p.exists():
        raise DumpError(f"{p}: no such file")
    try:
        with open(p, "rb") as fh:
            head = fh.read(4)
    except OSError as exc:
        raise DumpError(f"{p}: cannot open ({exc.strerror or exc})") from exc
    if head == b"PAR1":
        return _read_parquet(p, tolerance)
    return _read_jsonl(p, tolerance, gz=head[:2] == b"\x1f\x8b")


# ------------------------------------------------------------------------------------------------------ JSONL
def _read_jsonl(p: Path, tolerance: float, *, gz: bool) -> RolloutDump:
    lines: list[int] = []  # 1-based line number of each record
    packed: dict[str, list[np.ndarray]] = {k: [] for k in _LIST_KEYS}
    lengths: dict[str, list[int]] = {k: [] for k in _LIST_KEYS}
    scalars: dict[str, list[Any]] = {k: [] for k in (*SCALAR_FLOAT_KEYS, *SCALAR_INT_KEYS, "config")}
    opener = gzip.open if gz else open
    try:
        with opener(p, "rt", encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                _parse_record(f"{p}:line {lineno}", line, packed, lengths, scalars)
                lines.append(lineno)
    except UnicodeDecodeError as exc:
        raise DumpError(f"{p}: not a UTF-8 text file nor Parquet ({exc.reason} at byte {exc.start})") from exc
    except (OSError, EOFError) as exc:  # gzip.BadGzipFile is an OSError
        raise DumpError(f"{p}: cannot read ({exc})") from exc
    except zlib.error as exc:  # a gzip header followed by corrupt deflate data
        raise DumpError(f"{p}: corrupt gzip data ({exc}); re-create or re-download the dump") from None

    has_mask = any(n >= 0 for n in lengths["mask"])
    if has_mask:  # records without a mask get all ones
        for i, n in enumerate(lengths["mask"]):
            if n < 0:
                packed["mask"][i] = np.ones(lengths["generation_logprobs"][i])
                lengths["mask"][i] = lengths["generation_logprobs"][i]
    columns: dict[str, Any] = {}
    lens: dict[str, np.ndarray] = {}
    for key in _LIST_KEYS if has_mask else LOGPROB_KEYS:
        columns[key] = np.concatenate(packed[key]) if packed[key] else np.zeros(0)
        lens[key] = np.asarray(lengths[key], dtype=np.int64)
    for key, vals in scalars.items():
        if any(v is not None for v in vals):
            columns[key] = _fill(key, vals)
    return build_dump(columns, lens, source=str(p), where=lambda i: f"{p}:line {lines[i]}", tolerance=tolerance)


def _parse_record(
    where: str, line: str, packed: dict[str, list], lengths: dict[str, list], scalars: dict[str, list]
) -> None:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DumpError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise DumpError(f"{where}: JSON nested too deeply") from None
    if not isinstance(rec, dict):
        raise DumpError(f"{where}: expected a JSON object per line, got {type(rec).__name__}")
    record = parse_record(where, rec)
    for key in _LIST_KEYS:
        if getattr(record, key) is None:  # no mask: all ones, filled in once the dump has one
            packed[key].append(None)
            lengths[key].append(-1)
            continue
        arr = record.array(key)
        packed[key].append(arr)
        lengths[key].append(len(arr))
    for key in scalars:
        scalars[key].append(record.scalar(key))


def _fill(key: str, vals: list[Any]) -> Any:
    if key == "config":
        return ["" if v is None else v for v in vals]
    if key in SCALAR_INT_KEYS:
        return np.asarray([-1 if v is None else v for v in vals], dtype=np.int64)
    return np.asarray([math.nan if v is None else v for v in vals], dtype=np.float64)


# ---------------------------------------------------------------------------------------------------- Parquet
def _read_parquet(p: Path, tolerance: float) -> RolloutDump:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(p)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise DumpError(f"{p}: cannot read Parquet ({exc})") from exc
    names = set(table.column_names)
    for alias, key in ALIASES.items():
        if alias in names:
            if key in names:
                raise DumpError(f"{p}: both columns '{key}' and its alias '{alias}' are present; keep one")
            table = table.rename_columns([key if n == alias else n for n in table.column_names])
            names = set(table.column_names)
    where: Callable[[int], str] = lambda i: f"{p}: row {i}"  # noqa: E731
    for key in LOGPROB_KEYS:
        if key not in names:
            raise DumpError(f"{p}: missing column '{key}'; columns: {sorted(names)}")

    columns: dict[str, Any] = {}
    lens: dict[str, np.ndarray] = {}
    for key in _LIST_KEYS:
        if key not in names:
            continue
        col = table.column(key).combine_chunks()
        if not (
            pa.types.is_list(col.type) or pa.types.is_large_list(col.type) or pa.types.is_fixed_size_list(col.type)
        ):
            raise DumpError(f"{p}: column '{key}' must be a list of numbers per row, got type {col.type}")
        vtype = col.type.value_type
        if not (
            pa.types.is_integer(vtype)
            or pa.types.is_floating(vtype)
            or pa.types.is_boolean(vtype)
            or pa.types.is_null(vtype)
        ):
            raise DumpError(f"{p}: column '{key}' must hold numbers, got list<{vtype}>")
        if pa.types.is_boolean(vtype) and key != "mask":
            raise DumpError(f"{p}: column '{key}' must hold numbers, got list<bool>")
        if col.null_count:
            first = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
            raise DumpError(f"{where(first)}: '{key}' is null; expected a list of numbers")
        values = col.flatten()
        if pa.types.is_null(vtype):
            values = pa.array(np.full(len(values), np.nan))
        # nulls inside a list become NaN: an error only on unmasked log-prob tokens (mask 0/1 check catches mask)
        flat = values.cast(pa.float64()).to_numpy(zero_copy_only=False)
        columns[key] = np.where(np.asarray(values.is_null().to_numpy(zero_copy_only=False)), np.nan, flat)
        lens[key] = np.asarray(pc.list_value_length(col).to_numpy(zero_copy_only=False), dtype=np.int64)

    for key in (*SCALAR_FLOAT_KEYS, *SCALAR_INT_KEYS, "config"):
        if key not in names:
            continue
        col = table.column(key).combine_chunks()
        numeric = pa.types.is_integer(col.type) or pa.types.is_floating(col.type)
        if key == "config":
            if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
                raise DumpError(f"{p}: column 'config' must be strings, got {col.type}")
            columns[key] = ["" if v is None else v for v in col.to_pylist()]
        elif not numeric:
            raise DumpError(f"{p}: column '{key}' must be numeric, got {col.type}")
        elif key in SCALAR_INT_KEYS and pa.types.is_integer(col.type):
            try:
                columns[key] = pc.fill_null(col, -1).cast(pa.int64()).to_numpy(zero_copy_only=False)
            except pa.ArrowInvalid as exc:
                raise DumpError(f"{p}: column '{key}' does not fit int64 ({exc})") from exc
        elif key in SCALAR_INT_KEYS:
            vals = col.cast(pa.float64()).to_numpy(zero_copy_only=False)
            vals = np.where(np.isnan(vals), -1, vals)
            bad = np.flatnonzero(~np.isfinite(vals) | (vals != np.round(vals)) | (np.abs(vals) >= 2.0**63))
            if len(bad):
                raise DumpError(f"{where(int(bad[0]))}: '{key}' must be an integer, got {float(vals[bad[0]])!r}")
            columns[key] = vals.astype(np.int64)
        else:
            columns[key] = col.cast(pa.float64()).to_numpy(zero_copy_only=False)
    return build_dump(columns, lens, source=str(p), where=where, tolerance=tolerance)
