"""Several ``nemo-is bench`` runs of one setting on different models rendered as one table (``--from-json`` given
more than once; the GPU check runs one model per process): rows and shapes concatenated in order, ``skipped``
united, a Triton fallback of any part kept; parts measured differently are refused, not merged."""

from __future__ import annotations

import json

import pytest

from nemo_is_plugin.apps.bench.merge import merge_results

from ._cli import run_cli


def _part(model: str, tokens: int = 64, device_name: str = "H100", fallback: str | None = None) -> dict:
    return dict(
        config=dict(tokens=tokens, device="cuda", shapes=[dict(name=model, hidden=8, vocab=16)]),
        machine=dict(device_name=device_name),
        rows=[dict(model=model, path="matmul"), dict(model=model, path="fused_linear")],
        memory_sweep=[],
        memory_direct={},
        skipped={f"cce ({model})": "not installed"},
        triton_fallback=fallback,
    )


def test_parts_are_concatenated_in_order_and_a_fallback_is_kept():
    merged = merge_results([_part("a"), _part("b", fallback="compile failed"), _part("c")])
    assert [s["name"] for s in merged["config"]["shapes"]] == ["a", "b", "c"]
    assert [(r["model"], r["path"]) for r in merged["rows"]] == [
        (m, p) for m in "abc" for p in ("matmul", "fused_linear")
    ]
    assert merged["skipped"] == {f"cce ({m})": "not installed" for m in "abc"}
    assert merged["triton_fallback"] == "compile failed"
    assert merged["config"]["tokens"] == 64 and merged["machine"] == {"device_name": "H100"}


@pytest.mark.parametrize(
    ("other", "message"),
    [
        (_part("b", tokens=128), r"another setting \(tokens\)"),
        (_part("b", device_name="A100"), "another device"),
        (_part("a"), "more than one of the results"),
    ],
)
def test_parts_measured_differently_are_refused(other, message):
    with pytest.raises(ValueError, match=message):
        merge_results([_part("a"), other])


def test_cli_renders_two_quick_runs_as_one_table(tmp_path):
    for model in ("tiny-a", "tiny-b"):
        done = run_cli("bench", "--quick", "--no-memory-sweep", "--model", model, "--out", str(tmp_path / model))
        assert done.returncode == 0, done.stdout + done.stderr
    parts = [json.loads((tmp_path / m / "results.json").read_text()) for m in ("tiny-a", "tiny-b")]
    args = [
        "--from-json",
        str(tmp_path / "tiny-a" / "results.json"),
        "--from-json",
        str(tmp_path / "tiny-b" / "results.json"),
    ]
    done = run_cli("bench", *args, "--out", str(tmp_path / "all"))
    assert done.returncode == 0, done.stdout + done.stderr
    merged = json.loads((tmp_path / "all" / "results.json").read_text())
    assert merged["rows"] == parts[0]["rows"] + parts[1]["rows"]
    assert "tiny-a" in done.stdout and "tiny-b" in done.stdout
    # a run of another setting is refused with the reason, exit 2
    done = run_cli(
        "bench", "--quick", "--no-memory-sweep", "--tokens", "32", "--model", "tiny-b", "--out", str(tmp_path / "b32")
    )
    assert done.returncode == 0, done.stdout + done.stderr
    done = run_cli(
        "bench", args[0], args[1], "--from-json", str(tmp_path / "b32" / "results.json"), "--out", str(tmp_path / "x")
    )
    assert done.returncode == 2 and "another setting (tokens)" in done.stdout
