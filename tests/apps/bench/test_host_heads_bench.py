"""``nemo-is bench --host-heads`` end to end on CPU at tiny shapes, and its report:

- the run (a child process: it creates a process group for NeMo-RL's head) measures every head; NeMo-RL from a
  checkout given by path (the stand-in tree of tests/helpers/fake_nemo_rl_head.py, the project's model of NeMo-RL's
  head), whose source and the JSON record; each measured head's errors against the float64 reference are fp32-small
  (the plugin's drop-ins and NeMo-RL's alike); verl's kernel needs CUDA, so on CPU its row reads failed with verl's
  error (or verl is reported not measured where it is not installed); a NeMo-RL that does not import is reported not
  measured with the reason; the docs tool (``python -m tools.bench_docs host-heads``) refuses a CPU run;
- the targets on a GPU-like result: the ratio, speed-up and memory targets at their thresholds, nothing for a CPU or
  quick run; the docs section from a GPU result names the device, date and versions and keeps the page's other GPU
  sections.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.fake_nemo_rl_head import write_fake_nemo_rl

from nemo_is_plugin.apps.bench.host_heads_report import SECTION, targets
from nemo_is_plugin.apps.bench.report import GIB
from tools.bench_docs.__main__ import main as bench_docs_main
from tools.bench_docs.gpu_sections import markers, splice
from tools.bench_docs.host_heads_section import render_section, write_section

from ._cli import run_cli


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory) -> tuple[dict, str]:
    tmp = tmp_path_factory.mktemp("host_heads")
    checkout = write_fake_nemo_rl(tmp / "nemo_rl_checkout")
    proc = run_cli("bench", "--host-heads", "--quick", "--nemo-rl-path", str(checkout), "--out", str(tmp / "out"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((tmp / "out" / "host_heads.json").read_text()), proc.stdout


def test_every_head_runs_on_cpu_and_matches_the_float64_reference(cpu_run):
    results, stdout = cpu_run
    rows = {(r["model"], r["head"]): r for r in results["rows"]}
    assert {m for m, _ in rows} == {"tiny-a", "tiny-b"}
    assert results["config"]["quick"] and results["config"]["device"] == "cpu"
    assert results["hosts"]["nemo_rl"]["source"].endswith("nemo_rl_checkout")
    for model in ("tiny-a", "tiny-b"):
        assert rows[(model, "matmul")]["ratio"] == 1.0
        for head in ("plugin", "plugin_nemo_rl", "nemo_rl", "plugin_verl"):
            row = rows[(model, head)]
            assert not row["failed"], row["failed"]
            assert row["ratio"] > 0 and row["peak_bytes"] > 0
            assert max(row["lp_err"], row["dx_err"], row["dw_err"]) < 1e-5
        assert rows[(model, "plugin_verl")]["ent_err"] < 1e-5
        assert "ent_err" not in rows[(model, "plugin")]
    verl = results["hosts"].get("verl")
    if verl is None:
        assert "verl" in results["skipped"]
    else:
        assert verl["version"] and "time" in rows[("tiny-a", "verl")]["failed"]  # its Triton kernel needs CUDA
        assert "tiny-a verl time:" in stdout
    assert "smoke run" in stdout and "met" not in stdout.replace("not meaningful", "")


def test_a_nemo_rl_that_does_not_import_is_reported_not_measured(tmp_path):
    proc = run_cli(
        "bench", "--host-heads", "--quick", "--head", "nemo_rl", "--head", "plugin", "--nemo-rl-path", str(tmp_path),
        "--out", str(tmp_path / "out"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads((tmp_path / "out" / "host_heads.json").read_text())
    assert "holds no nemo_rl/ package directory" in results["skipped"]["nemo_rl"]
    assert {r["head"] for r in results["rows"]} == {"matmul", "plugin"}
    assert "nemo_rl not measured" in proc.stdout


def test_the_docs_tool_refuses_a_cpu_run(tmp_path):
    proc = run_cli("bench", "--host-heads", "--quick", "--head", "plugin", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    docs = tmp_path / "docs"
    assert bench_docs_main(["host-heads", str(tmp_path / "host_heads.json"), "--docs-dir", str(docs)]) == 2
    assert not (docs / "performance.md").exists()


def _gpu_result(plugin_ratio=4.2, nemo_rl_s=0.5, plugin_nemo_rl_s=0.1, verl_s=0.12, plugin_verl_s=0.1, peak=1.2):
    def row(head, seconds, ratio=None, peak_gib=None, **extra):
        peak_bytes = None if peak_gib is None else peak_gib * GIB
        shape = dict(model="Qwen3-30B-A3B", tokens=16384, hidden=2048, vocab=151936)
        return dict(shape, head=head, failed={}, fwdbwd_s=seconds, ratio=ratio, peak_bytes=peak_bytes, **extra)

    return {
        "kind": "host_heads",
        "config": dict(device="cuda", dtype="bfloat16", tokens=16384, batch=8, tp=1, repeats=5, warmup=2, quick=False),
        "machine": dict(device_name="NVIDIA H200", date="2026-12-01", torch="2.11.0", triton="3.6.0", cuda="13.0"),
        "hosts": {"nemo_rl": {"version": "0.5", "commit": "7ea279abfbeb", "source": "/x"}},
        "skipped": {"verl": "not installed"},
        "rows": [
            row("matmul", 0.02, 1.0),
            row("plugin", 0.084, plugin_ratio, peak, lp_err=1e-7, dx_err=1e-2, dw_err=1e-2),
            row("plugin_nemo_rl", plugin_nemo_rl_s, plugin_nemo_rl_s / 0.02, peak),
            row("nemo_rl", nemo_rl_s, nemo_rl_s / 0.02, 12.0),
            row("plugin_verl", plugin_verl_s, plugin_verl_s / 0.02, peak),
            row("verl", verl_s, verl_s / 0.02, 1.1),
        ],
    }


def test_targets_on_a_gpu_result_at_their_thresholds():
    found = {t["target"]: t for t in targets(_gpu_result())}
    bound = (151936 + 16384) * 2048 * 2 / GIB + 1
    assert found["Qwen3-30B-A3B: plugin f+b <= 4.5x GEMM"]["ok"]
    assert not found["Qwen3-30B-A3B: plugin_nemo_rl f+b <= 4.5x GEMM"]["ok"]  # 0.1 s = 5x the 0.02 s GEMM
    nemo_rl = found["Qwen3-30B-A3B: plugin_nemo_rl >= 5x faster than nemo_rl"]
    assert nemo_rl["value"] == pytest.approx(5.0) and nemo_rl["ok"]
    assert found["Qwen3-30B-A3B: plugin_verl > 1x faster than verl"]["ok"]
    peak = found[f"Qwen3-30B-A3B: plugin peak <= dW + dX + 1 GiB = {bound:.3g} GiB (GiB)"]
    assert peak["value"] == pytest.approx(1.2) and peak["ok"]
    slow = {t["target"]: t["ok"] for t in targets(_gpu_result(nemo_rl_s=0.49, verl_s=0.1, peak=bound + 0.01))}
    assert not slow["Qwen3-30B-A3B: plugin_nemo_rl >= 5x faster than nemo_rl"]
    assert not slow["Qwen3-30B-A3B: plugin_verl > 1x faster than verl"]
    assert not slow[f"Qwen3-30B-A3B: plugin peak <= dW + dX + 1 GiB = {bound:.3g} GiB (GiB)"]
    cpu = _gpu_result()
    cpu["config"]["device"] = "cpu"
    assert targets(cpu) == []


def test_the_docs_section_names_device_date_and_versions_and_keeps_the_other_sections(tmp_path):
    results = _gpu_result()
    section = render_section(results)
    start, end = markers(SECTION)
    assert section.startswith(start) and section.endswith(end)
    for text in ("NVIDIA H200", "2026-12-01", "torch 2.11.0", "triton 3.6.0", "CUDA 13.0", "NeMo-RL 0.5 @7ea279ab"):
        assert text in " ".join(section.split())  # the generated paragraph is wrapped
    assert "verl not measured: not installed" in section and "| Qwen3-30B-A3B | nemo_rl |" in section
    head_start, head_end = markers("head")
    page = f"# Performance of the log-prob + loss path\n\n{head_start}\nGPU head table\n{head_end}\n\n## CPU\n"
    (tmp_path / "performance.md").write_text(page)
    write_section(results, tmp_path)
    written = (tmp_path / "performance.md").read_text()
    assert "GPU head table" in written and "## CPU" in written and section in written
    assert json.loads((tmp_path / "img" / "perf_gpu_host_heads.json").read_text())["kind"] == "host_heads"
    assert splice(written, SECTION, section) == written  # rewriting replaces the section in place
    quick = dict(results, config=dict(results["config"], quick=True))
    with pytest.raises(ValueError, match="--quick"):
        write_section(quick, tmp_path)
    assert Path(tmp_path / "performance.md").read_text() == written
