"""The rollout dump: per-response generation and training log-probs, validated and packed into numpy arrays.

Format (one record per response; JSONL line or Parquet row):

    generation_logprobs  list[float]  log-probs of the sampled tokens under the rollout engine (required)
    prev_logprobs        list[float]  the same tokens under the training engine, same length (required;
                                      ``training_logprobs`` is accepted as an alias, giving both is an error)
    mask                 list[0|1]    1 = the token counts (optional, default all ones)
    advantage, reward    float        optional
    step, sample_id      int          optional
    config               str          optional label (e.g. which IS setting produced the run)

Unknown keys are ignored (dumps often carry token ids or text). Values on masked tokens are not read; they may be
anything numeric, NaN included, and are stored as 0. On unmasked tokens log-probs must be finite and
<= ``LOGPROB_TOLERANCE``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

LOGPROB_KEYS = ("generation_logprobs", "prev_logprobs")
ALIASES = {"training_logprobs": "prev_logprobs"}
SCALAR_FLOAT_KEYS = ("advantage", "reward")
SCALAR_INT_KEYS = ("step", "sample_id")
STRING_KEYS = ("config",)
# A JSON dump holds float32/bfloat16 engine values printed as decimals; a log-prob above this is a bug upstream
# (verl issue #2656), not rounding.
LOGPROB_TOLERANCE = 1e-3


class DumpError(ValueError):
    """A rollout dump that cannot be read; the message names the file, the record and the key."""


@dataclass(frozen=True)
class RolloutDump:
    """B responses, N tokens in all, packed back to back.

    Attributes:
        generation_logprobs: float64[N] rollout-engine log-probs (0 on masked tokens).
        prev_logprobs: float64[N] training-engine log-probs (0 on masked tokens).
        mask: bool[N] True where the token counts.
        cu_seqlens: int64[B+1] response i holds tokens cu_seqlens[i]:cu_seqlens[i+1].
        advantage, reward: float64[B] or None (NaN where a record lacks it).
        step, sample_id: int64[B] or None (-1 where a record lacks it).
        config: list of B str or None ("" where a record lacks it).
        source: where it was read from, for messages.
    """

    generation_logprobs: np.ndarray
    prev_logprobs: np.ndarray
    mask: np.ndarray
    cu_seqlens: np.ndarray
    advantage: np.ndarray | None = None
    reward: np.ndarray | None = None
    step: np.ndarray | None = None
    sample_id: np.ndarray | None = None
    config: list[str] | None = None
    source: str = "<memory>"

    @property
    def num_responses(self) -> int:
        return len(self.cu_seqlens) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def lengths(self) -> np.ndarray:
        """int64[B] tokens per response, masked ones included."""
        return np.diff(self.cu_seqlens)

    @property
    def valid_lengths(self) -> np.ndarray:
        """int64[B] unmasked tokens per response: the response length used for binning."""
        return (
            np.add.reduceat(self.mask.astype(np.int64), self.cu_seqlens[:-1])
            if self.num_tokens
            else np.zeros(self.num_responses, np.int64)
        )

    @property
    def seq_index(self) -> np.ndarray:
        """int64[N] which response each token belongs to."""
        return np.repeat(np.arange(self.num_responses), self.lengths)

    def select(self, keep: np.ndarray) -> RolloutDump:
        """The sub-dump of the responses where ``keep`` (bool[B]) is True."""
        keep = np.asarray(keep, dtype=bool)
        tok = np.repeat(keep, self.lengths)
        lengths = self.lengths[keep]
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        pick = lambda a: None if a is None else a[keep]  # noqa: E731
        return replace(
            self,
            generation_logprobs=self.generation_logprobs[tok],
            prev_logprobs=self.prev_logprobs[tok],
            mask=self.mask[tok],
            cu_seqlens=cu,
            advantage=pick(self.advantage),
            reward=pick(self.reward),
            step=pick(self.step),
            sample_id=pick(self.sample_id),
            config=None if self.config is None else [c for c, k in zip(self.config, keep) if k],
        )


def build_dump(
    columns: dict[str, Any],
    lengths: dict[str, np.ndarray],
    *,
    source: str,
    where: Callable[[int], str],
    tolerance: float = LOGPROB_TOLERANCE,
) -> RolloutDump:
    """Validate packed columns and build the dump; shared by the JSONL and Parquet readers.

    Args:
        columns: ``generation_logprobs``, ``prev_logprobs`` float64[N_key] and optional ``mask`` [N_key] packed
            values; optional per-response ``advantage``/``reward`` float64[B], ``step``/``sample_id`` int64[B],
            ``config`` list[str].
        lengths: int64[B] per packed key: how many values each response holds.
        where: record index -> "file:line 3" / "file: row 2", for messages.
    """
    gen_len = lengths["generation_logprobs"]
    if len(gen_len) == 0:
        raise DumpError(f"{source}: no responses found (an empty dump)")
    for key in ("prev_logprobs", "mask"):
        if key in lengths:
            diff = np.flatnonzero(lengths[key] != gen_len)
            if len(diff):
                i = int(diff[0])
                raise DumpError(
                    f"{where(i)}: '{key}' has {int(lengths[key][i])} values but 'generation_logprobs' has "
                    f"{int(gen_len[i])}; they must align token by token"
                )
    empty = np.flatnonzero(gen_len == 0)
    if len(empty):
        raise DumpError(f"{where(int(empty[0]))}: empty response (0 tokens); a response needs at least one token")

    cu = np.concatenate([[0], np.cumsum(gen_len)]).astype(np.int64)
    seq = np.repeat(np.arange(len(gen_len)), gen_len)
    if "mask" in columns:
        raw = np.asarray(columns["mask"], dtype=np.float64)
        bad = np.flatnonzero((raw != 0) & (raw != 1))
        if len(bad):
            t = int(bad[0])
            raise DumpError(
                f"{where(int(seq[t]))}: 'mask' must hold 0/1 values, token {t - cu[seq[t]]} is {float(raw[t])!r}"
            )
        mask = raw == 1
    else:
        mask = np.ones(int(cu[-1]), dtype=bool)

    out: dict[str, np.ndarray] = {}
    for key in LOGPROB_KEYS:
        vals = np.asarray(columns[key], dtype=np.float64)
        finite = np.isfinite(vals)
        bad = np.flatnonzero(mask & ~finite)
        if len(bad):
            t = int(bad[0])
            raise DumpError(
                f"{where(int(seq[t]))}: '{key}' token {t - cu[seq[t]]} is {float(vals[t])!r} (NaN, inf or null) on an "
                "unmasked token; log-probs must be finite where mask = 1"
            )
        vals = np.where(mask, vals, 0.0)  # masked tokens are never read: keep garbage out of every sum
        bad = np.flatnonzero(vals > tolerance)
        if len(bad):
            t = int(bad[0])
            raise DumpError(
                f"{where(int(seq[t]))}: '{key}' token {t - cu[seq[t]]} is {float(vals[t])!r} > {tolerance:g}; "
                "log-probs must be <= 0 (a positive value means the log-prob computation upstream is wrong)"
            )
        out[key] = vals

    extras: dict[str, Any] = {}
    for key in SCALAR_FLOAT_KEYS:
        if columns.get(key) is not None:
            vals = np.asarray(columns[key], dtype=np.float64)
            bad = np.flatnonzero(np.isinf(vals))
            if len(bad):
                raise DumpError(f"{where(int(bad[0]))}: '{key}' is {float(vals[bad[0]])!r}; it must be finite")
            extras[key] = vals
    for key in SCALAR_INT_KEYS:
        if columns.get(key) is not None:
            extras[key] = np.asarray(columns[key], dtype=np.int64)
    if columns.get("config") is not None:
        extras["config"] = [str(c) for c in columns["config"]]
    return RolloutDump(out["generation_logprobs"], out["prev_logprobs"], mask, cu, source=source, **extras)


def to_records(dump: RolloutDump) -> list[dict[str, Any]]:
    """The dump as one dict per response, in the file format (inverse of reading; masked tokens hold 0)."""
    records = []
    for i in range(dump.num_responses):
        a, b = int(dump.cu_seqlens[i]), int(dump.cu_seqlens[i + 1])
        rec: dict[str, Any] = {
            "generation_logprobs": dump.generation_logprobs[a:b].tolist(),
            "prev_logprobs": dump.prev_logprobs[a:b].tolist(),
            "mask": dump.mask[a:b].astype(int).tolist(),
        }
        for key in (*SCALAR_FLOAT_KEYS, *SCALAR_INT_KEYS):
            arr = getattr(dump, key)
            if arr is not None:
                rec[key] = arr[i].item()
        if dump.config is not None:
            rec["config"] = dump.config[i]
        records.append(rec)
    return records


def write_dump(records: Sequence[dict[str, Any]], path: str) -> str:
    """Write records as JSONL, or as Parquet when ``path`` ends in ``.parquet`` / ``.pq``. Returns the path."""
    import json
    from pathlib import Path

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.suffix in (".parquet", ".pq"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(list(records)), p)
    else:
        with open(p, "w", encoding="utf-8") as fh:
            for rec in records:
                fh.write(json.dumps(rec) + "\n")
    return str(p)
