"""The dump reader: JSONL / gzip / Parquet / directory round trips, and a clear DumpError for every malformed input."""

from __future__ import annotations

import gzip
import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_is_plugin.apps.diagnose import DumpError, read_dump, write_dump
from nemo_is_plugin.apps.diagnose.dump import to_records

_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def _rec(**kw):
    base = {"generation_logprobs": [-0.5, -1.0, -0.25], "prev_logprobs": [-0.4, -1.1, -0.25]}
    base.update(kw)
    return base


# ------------------------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_round_trip(tmp_path, records, suffix):
    path = write_dump(records, tmp_path / f"rollouts{suffix}")
    dump = read_dump(path)
    assert dump.num_responses == 12
    assert dump.num_tokens == sum(len(r["mask"]) for r in records)
    mask = np.concatenate([r["mask"] for r in records]).astype(bool)
    np.testing.assert_array_equal(dump.mask, mask)
    gen = np.concatenate([r["generation_logprobs"] for r in records])
    np.testing.assert_array_equal(dump.generation_logprobs, np.where(mask, gen, 0.0))
    np.testing.assert_array_equal(dump.step, [r["step"] for r in records])
    assert dump.config == [r["config"] for r in records]
    np.testing.assert_array_equal(dump.valid_lengths, [sum(r["mask"]) for r in records])
    # and back: the file format is the dump's record form
    again = read_dump(write_dump(to_records(dump), tmp_path / f"again{suffix}"))
    np.testing.assert_array_equal(again.prev_logprobs, dump.prev_logprobs)
    np.testing.assert_array_equal(again.cu_seqlens, dump.cu_seqlens)


def test_integral_floats_and_nulls_read_as_the_dump_stores_them(tmp_path):
    """A writer may print an integer step as 3.0; null scalars are absent values, not zeros."""
    lines = [json.dumps(_rec(step=3.0, sample_id=7, reward=None)), json.dumps(_rec(step=4, sample_id=8, reward=1))]
    dump = read_dump(_write_lines(tmp_path / "d.jsonl", lines))
    assert dump.step.tolist() == [3, 4] and dump.step.dtype == np.int64
    assert dump.sample_id.tolist() == [7, 8]
    assert math.isnan(dump.reward[0]) and dump.reward[1] == 1.0


def test_gzip_and_run_directory(tmp_path, records):
    with gzip.open(tmp_path / "rollouts.jsonl.gz", "wt") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    assert read_dump(tmp_path / "rollouts.jsonl.gz").num_responses == 12
    assert read_dump(tmp_path).num_responses == 12  # a run directory: finds rollouts.*


def test_format_is_sniffed_not_taken_from_the_extension(tmp_path, records):
    write_dump(records, tmp_path / "x.parquet")
    (tmp_path / "x.parquet").rename(tmp_path / "x.dat")
    assert read_dump(tmp_path / "x.dat").num_responses == 12


def test_optional_fields_and_defaults(tmp_path):
    path = _write_lines(
        tmp_path / "d.jsonl",
        [
            json.dumps(_rec(mask=[1, 0, 1], advantage=1.5, step=3)),
            "",  # blank lines are skipped
            json.dumps(_rec()),  # no mask: all ones; no advantage: NaN; no step: -1
            json.dumps(_rec(token_ids=[1, 2, 3], text="ignored")),  # unknown keys are ignored
        ],
    )
    dump = read_dump(path)
    np.testing.assert_array_equal(dump.mask, [1, 0, 1, 1, 1, 1, 1, 1, 1])
    assert dump.advantage[0] == 1.5 and math.isnan(dump.advantage[1])
    np.testing.assert_array_equal(dump.step, [3, -1, -1])
    assert dump.reward is None and dump.config is None


def test_training_logprobs_is_an_alias_of_prev_logprobs(tmp_path):
    rec = _rec()
    rec["training_logprobs"] = rec.pop("prev_logprobs")
    dump = read_dump(_write_lines(tmp_path / "d.jsonl", [json.dumps(rec)]))
    np.testing.assert_array_equal(dump.prev_logprobs, [-0.4, -1.1, -0.25])
    table = pa.table({"generation_logprobs": [[-0.5]], "training_logprobs": [[-0.4]]})
    pq.write_table(table, tmp_path / "d.parquet")
    assert read_dump(tmp_path / "d.parquet").prev_logprobs.tolist() == [-0.4]


def test_masked_tokens_may_hold_anything_numeric(tmp_path):
    rec = _rec(mask=[1, 0, 1])
    rec["generation_logprobs"][1] = None  # null
    rec["prev_logprobs"][1] = 7.0  # positive: never read
    dump = read_dump(_write_lines(tmp_path / "d.jsonl", [json.dumps(rec)]))
    assert dump.generation_logprobs.tolist() == [-0.5, 0.0, -0.25]
    assert dump.prev_logprobs.tolist() == [-0.4, 0.0, -0.25]


# ------------------------------------------------------------------------------------------------ malformed JSONL
MALFORMED = [
    ('{"generation_logprobs": [-0.5], "prev_logprobs": [-0.4]', "line 1: not valid JSON"),
    ("[1, 2, 3]", "line 1: expected a JSON object per line, got list"),
    ('{"prev_logprobs": [-0.4]}', "line 1: missing key 'generation_logprobs'"),
    ('{"generation_logprobs": [-0.4]}', "line 1: missing key 'prev_logprobs' (or its alias 'training_logprobs')"),
    ('{"generation_logprobs": "-0.4", "prev_logprobs": [-0.4]}', "'generation_logprobs' must be a list of numbers"),
    ('{"generation_logprobs": [-0.4, "x"], "prev_logprobs": [-0.4, -1]}', "'generation_logprobs' element 1 is 'x'"),
    ('{"generation_logprobs": [true], "prev_logprobs": [-0.4]}', "'generation_logprobs' element 0 is True"),
    ('{"generation_logprobs": [[-0.4]], "prev_logprobs": [-0.4]}', "'generation_logprobs' element 0 is [-0.4]"),
    (
        '{"generation_logprobs": [-0.4, -1], "prev_logprobs": [-0.4]}',
        "line 1: 'prev_logprobs' has 1 values but 'generation_logprobs' has 2",
    ),
    ('{"generation_logprobs": [-0.4], "prev_logprobs": [-0.4], "mask": [1, 1]}', "'mask' has 2 values"),
    ('{"generation_logprobs": [], "prev_logprobs": []}', "line 1: empty response (0 tokens)"),
    ('{"generation_logprobs": [-0.4], "prev_logprobs": [-0.4], "mask": [2]}', "'mask' must hold 0/1 values"),
    ('{"generation_logprobs": [-0.4], "prev_logprobs": [NaN]}', "'prev_logprobs' token 0 is nan"),
    ('{"generation_logprobs": [Infinity], "prev_logprobs": [-1]}', "'generation_logprobs' token 0 is inf"),
    ('{"generation_logprobs": [null], "prev_logprobs": [-1]}', "(NaN, inf or null) on an unmasked token"),
    ('{"generation_logprobs": [0.5], "prev_logprobs": [-1]}', "'generation_logprobs' token 0 is 0.5 > 0.001"),
    ('{"generation_logprobs": [-1], "prev_logprobs": [-1], "advantage": "high"}', "'advantage' must be a number"),
    ('{"generation_logprobs": [-1], "prev_logprobs": [-1], "advantage": Infinity}', "'advantage' is inf"),
    ('{"generation_logprobs": [-1], "prev_logprobs": [-1], "step": 1.5}', "'step' must be an integer"),
    ('{"generation_logprobs": [-1], "prev_logprobs": [-1], "config": 3}', "'config' must be a string"),
    (
        '{"generation_logprobs": [-1], "prev_logprobs": [-1], "training_logprobs": [-1]}',
        "both 'prev_logprobs' and its alias 'training_logprobs' are given",
    ),
    ('{"generation_logprobs": [1e999999], "prev_logprobs": [-1]}', "'generation_logprobs' token 0 is inf"),
    ('{"generation_logprobs": [1' + "0" * 400 + '], "prev_logprobs": [-1]}', "holds a number too large for float64"),
    ('{"generation_logprobs": [-1], "prev_logprobs": [-1], "reward": 1' + "0" * 400 + "}", "'reward' is too large"),
    ('{"generation_logprobs": [-1], "prev_logprobs": [-1], "mask": null}', "'mask' must be a list of numbers"),
    ('{"generation_logprobs": [-1], "prev_logprobs": [-1], "step": 1e30}', "'step' must be an integer (64-bit)"),
    ('{"generation_logprobs": [-1], "prev_logprobs": [-1], "step": true}', "'step' must be a number, got True"),
]


@pytest.mark.parametrize(("line", "message"), MALFORMED)
def test_malformed_jsonl_names_line_and_key(tmp_path, line, message):
    good = json.dumps(_rec())
    path = (
        _write_lines(tmp_path / "d.jsonl", [good, line])
        if "line 1" not in message
        else _write_lines(tmp_path / "d.jsonl", [line])
    )
    with pytest.raises(DumpError) as err:
        read_dump(path)
    assert message in str(err.value)
    assert str(path) in str(err.value)
    if "line 1" not in message:
        assert f"{path}:line 2" in str(err.value)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "no responses found"),
        (b"\n\n", "no responses found"),
        (b"\xff\xfe\x00garbage", "not a UTF-8 text file nor Parquet"),
        (b"\x1f\x8b\x08\x00broken", "cannot read"),
        (b"PAR1 not really parquet", "cannot read Parquet"),
    ],
)
def test_malformed_files(tmp_path, content, message):
    path = tmp_path / "d.bin"
    path.write_bytes(content)
    with pytest.raises(DumpError, match=message.replace("(", r"\(")):
        read_dump(path)


def test_missing_file_and_empty_directory(tmp_path):
    with pytest.raises(DumpError, match="no such file"):
        read_dump(tmp_path / "nope.jsonl")
    with pytest.raises(DumpError, match="is a directory without rollouts.jsonl"):
        read_dump(tmp_path)


# ------------------------------------------------------------------------------------------------ malformed Parquet
@pytest.mark.parametrize(
    ("table", "message"),
    [
        (pa.table({"generation_logprobs": [[-0.5]]}), "missing column 'prev_logprobs'"),
        (pa.table({"generation_logprobs": [-0.5], "prev_logprobs": [-0.5]}), "must be a list of numbers per row"),
        (pa.table({"generation_logprobs": [["a"]], "prev_logprobs": [[-0.5]]}), "must hold numbers, got list<string>"),
        (
            pa.table({"generation_logprobs": [[-0.5], None], "prev_logprobs": [[-0.5], [-1.0]]}),
            "row 1: 'generation_logprobs' is null",
        ),
        (
            pa.table({"generation_logprobs": [[-0.5, -1.0]], "prev_logprobs": [[-0.5]]}),
            "row 0: 'prev_logprobs' has 1 values but 'generation_logprobs' has 2",
        ),
        (
            pa.table({"generation_logprobs": [[-0.5, None]], "prev_logprobs": [[-0.5, -1.0]]}),
            "row 0: 'generation_logprobs' token 1 is nan",
        ),
        (pa.table({"generation_logprobs": [[-0.5]], "prev_logprobs": [[-0.5]], "mask": [[3]]}), "'mask' must hold 0/1"),
        (
            pa.table({"generation_logprobs": [[-0.5]], "prev_logprobs": [[-0.5]], "step": ["x"]}),
            "column 'step' must be numeric",
        ),
        (
            pa.table({"generation_logprobs": [[-0.5]], "prev_logprobs": [[-0.5]], "step": [1.5]}),
            "row 0: 'step' must be an integer",
        ),
        (
            pa.table({"generation_logprobs": [[-0.5]], "prev_logprobs": [[-0.5]], "config": [1]}),
            "column 'config' must be strings",
        ),
        (
            pa.table(
                {
                    "generation_logprobs": pa.array([], pa.list_(pa.float64())),
                    "prev_logprobs": pa.array([], pa.list_(pa.float64())),
                }
            ),
            "no responses found",
        ),
    ],
)
def test_malformed_parquet_names_row_and_column(tmp_path, table, message):
    pq.write_table(table, tmp_path / "d.parquet")
    with pytest.raises(DumpError) as err:
        read_dump(tmp_path / "d.parquet")
    assert message in str(err.value)


def test_parquet_accepts_float32_bool_masks_and_fixed_size_lists(tmp_path):
    gen = pa.array([[-0.5, -1.0]], pa.list_(pa.float32(), 2))
    table = pa.table(
        {
            "generation_logprobs": gen,
            "prev_logprobs": pa.array([[-0.25, -1.0]], pa.list_(pa.float32())),
            "mask": pa.array([[True, False]]),
            "step": pa.array([7], pa.int32()),
        }
    )
    pq.write_table(table, tmp_path / "d.parquet")
    dump = read_dump(tmp_path / "d.parquet")
    assert dump.generation_logprobs.tolist() == [-0.5, 0.0]
    assert dump.mask.tolist() == [True, False] and dump.step.tolist() == [7]


# ------------------------------------------------------------------------------------------------ fuzz
_json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(10**20), 10**20), st.floats(), st.text(max_size=5)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=10,
)
_KEYS = [
    "generation_logprobs",
    "prev_logprobs",
    "training_logprobs",
    "mask",
    "advantage",
    "reward",
    "step",
    "sample_id",
    "config",
]


@st.composite
def mutated_lines(draw):
    """A valid record, then a few random edits: drop / replace keys, replace list items, cut the text."""
    n = draw(st.integers(1, 4))
    rec = {"generation_logprobs": [-0.5] * n, "prev_logprobs": [-0.25] * n, "mask": [1] * n, "step": 1}
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["drop", "set", "item"]))
        key = draw(st.sampled_from(_KEYS))
        if op == "drop":
            rec.pop(key, None)
        elif op == "set":
            rec[key] = draw(_json_values)
        elif isinstance(rec.get(key), list) and rec[key]:
            rec[key][draw(st.integers(0, len(rec[key]) - 1))] = draw(_json_values)
    text = json.dumps(rec)
    if draw(st.booleans()):
        text = text[: draw(st.integers(0, len(text)))]
    return text


@settings(max_examples=400, **_SETTINGS)
@given(lines=st.lists(mutated_lines(), min_size=1, max_size=3))
def test_fuzzed_jsonl_reads_or_raises_dump_error(tmp_path, lines):
    path = _write_lines(tmp_path / "f.jsonl", lines)
    try:
        dump = read_dump(path)
    except DumpError as exc:
        assert str(path) in str(exc)
        return
    assert np.isfinite(dump.generation_logprobs).all() and np.isfinite(dump.prev_logprobs).all()
    assert (dump.generation_logprobs <= 1e-3).all() and (dump.prev_logprobs <= 1e-3).all()
    assert dump.num_responses >= 1 and (dump.lengths >= 1).all()


@settings(max_examples=200, **_SETTINGS)
@given(data=st.binary(max_size=200), parquet_head=st.booleans())
def test_fuzzed_bytes_read_or_raise_dump_error(tmp_path, data, parquet_head):
    path = tmp_path / "f.bin"
    path.write_bytes((b"PAR1" if parquet_head else b"") + data)
    try:
        read_dump(path)
    except DumpError:
        pass


@settings(max_examples=60, **_SETTINGS)
@given(cut=st.integers(0, 2000), seed=st.integers(0, 1000))
def test_truncated_parquet_raises_dump_error(tmp_path, cut, seed):
    from nemo_is_plugin.apps.diagnose import synthetic_records

    write_dump(synthetic_records(3, min_len=2, max_len=8, seed=seed), tmp_path / "ok.parquet")
    blob = (tmp_path / "ok.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(blob[: min(cut, len(blob) - 1)])
    with pytest.raises(DumpError):
        read_dump(tmp_path / "cut.parquet")
