"""Writes ``docs/performance.md`` (+ ``docs/img/perf_*.png``, ``docs/img/perf_results.json``) from one result dict.

Everything numeric in the page comes from the result; the prose explains the method and is the same every run.
Regenerate from a CPU run of ``nemo-is bench`` (its ``results.json``) with ``python -m tools.bench_docs cpu
RESULTS.json`` from the repository root.
"""

from __future__ import annotations

from pathlib import Path

from nemo_is_plugin.apps.bench.failures import failures_markdown
from nemo_is_plugin.apps.bench.plots import plot_memory, plot_ratios
from nemo_is_plugin.apps.bench.report import MIB, markdown_table, memory_fit, table_cells, targets, write_json
from tools.bench_docs.gpu_sections import carry_gpu_sections

METHOD = """\
## What is measured

For every model shape (H, V: `hidden_size`, `vocab_size` of each model's Hugging Face `config.json`) and path:

- **forward**: token log-probs under `no_grad` (the old-policy / reference pass);
- **forward+backward**: log-probs -> `ClippedPGLoss` (GRPO clip, token-level ratio, token-level TIS, k3 KL) ->
  `backward()` into the hidden states and the LM-head weight; `fused_linear` and `fused_2pass` call
  `fused_linear_pg_loss`, which takes the hidden states and computes the loss itself;
- **/ mm**: time divided by the bare forward GEMM `hidden @ W.T` of the same shape, timed in the same rounds as the
  paths (every round times every job once; each job keeps its best round). Limits: 1x for a forward; 3x for a
  forward+backward that keeps the logits (naive) or computes the gradients in its forward (`fused_linear`'s single
  pass: logits, dX, dW per chunk; token-level and cumulative ratios), 4x for one that recomputes the logits in its
  backward (`from_logits`, `fused_2pass`: 1 forward + 1 recompute + 2 gradient GEMMs);
- **GFLOP/s**: effective, counting 8NHV for forward+backward whatever a path executes (Liger's convention);
- **backend**: the chunk-math backend the path's memory-tracked calls ran on (`torch` or `triton`; `-`: the path has
  no chunk math); a fallback from Triton to torch is noted under the table (`NEMO_IS_STRICT_BACKEND=1` makes it an
  error instead). A measurement that raised reads **failed** in its cells, with its error listed under the table;
- **peak MiB**: the high-water mark of tensor bytes allocated above the inputs, tracked by a `TorchDispatchMode` that
  counts every new storage an op returns and uncounts it when freed (`nemo_is_plugin/apps/bench/memory.py`). It includes
  saved activations, workspaces and the gradients (dW alone is V x H x 4 bytes: 1187 MiB at H=2048, V=151936);
  it excludes BLAS-internal buffers. **RSS** is the process's peak resident memory above the start of the same run
  (`/proc/self/clear_refs` + `VmHWM`), a cross-check that includes allocator effects;
- **max dlogp err** and **grad rel err**: against a float64 reference on the first tokens: max absolute log-prob error,
  and the max relative error of `d(-mean logp)/d hidden` of the path's log-prob function (Liger: of its loss gradient
  at ratio 1, which is the same); **loss grad err**: max relative error of the benchmark loss's `d loss/d hidden`
  against the naive path in float64 on a small problem of the same shape (this is what checks the single pass, whose
  gradients come from its forward).

Paths:

| path | what it is |
|---|---|
| matmul | the bare LM-head GEMM (forward) and its 3 GEMMs, logits + dX + dW (forward+backward): the limit |
| naive | full logits, fp32 `log_softmax` kept for backward, gather (NeMo-RL's `DistributedLogprob`) |
| from_logits | full logits, then chunked online-lse log-prob, recomputing backward (`vocab_parallel.py`) |
| fused_linear | hidden states + LM-head shard, chunked: no [tokens x vocab] beyond one chunk. Forward: `fused_linear_logprobs`; forward+backward: `fused_linear_pg_loss`, here in one pass (token-level ratio: each chunk's dL/dlogp is known as soon as its log-probs are, so dX and dW are computed in the forward; `fused_linear_loss.py`) |
| fused_2pass | the same entry forced to two passes (log-probs, loss, recomputing backward): what the `sequence` and `sequence_token` ratios cost, whose per-token gradient needs the whole sequence first (the cumulative ratios are causal and take the single pass). Forward as fused_linear (not re-timed) |
| liger | `LigerFusedLinearGRPOLoss`, its own GRPO loss, grads inside its forward (`compiled=False`) |
| loss | the loss epilogue alone: `ClippedPGLoss` forward+backward on given log-probs |
"""

CAVEATS = """\
## Reading the numbers

- This is a shared 2-core CPU: absolute times carry +-20% noise from other processes; ratios measured in the same run
  are the comparable quantity. Token counts are scaled down (one 256-token GEMM at H=2048, V=151936 is 160 GFLOP).
  At 256 tokens the fused path's default chunk (256 MiB of fp32 logits: 441 tokens at V=151936) holds every token;
  the memory sweep (up to 3072 tokens, 7 chunks) runs the chunk loop.
- On CPU everything is GEMM-bound (the softmax passes over [N, V] cost a fraction of a GEMM). The naive path and the
  single pass both do 3 GEMMs; the single pass saves the [N, V] buffers' allocation and traffic, which is why it is
  faster here too. The two-pass schedule does 4 GEMMs, so on a CPU it can only be slower than the naive path, by up
  to the recompute GEMM; on a GPU the naive path's cost is the memory traffic of the [N, V] logits (~2x the GEMM time
  at H=2048: the unfused tail's bytes per GEMM FLOP scale as 1/H), which neither fused schedule has; that comparison
  needs a GPU run.
- At 256 tokens the gradient GEMMs have a short reduction dimension: the dW GEMM (`dz.T @ X`, K = tokens) writes a
  fresh V x H fp32 buffer (0.5-3.5 GiB) for 256 tokens of work, which is why even the bare matmul's forward+backward is
  above 3x. With more tokens per chunk (a real batch) the ratios move towards their GEMM counts. The two-pass rows
  are held to the same 4.4x target in the targets table; where one misses, compare it with the matmul row's own
  forward+backward ratio of the same run: the two-pass schedule is that plus one recompute GEMM.
- Liger runs with `compiled=False` and loops over the batch rows with 2048-token x 4096-vocab tiles; on this CPU its
  many small GEMMs and the gradients it computes inside the forward cost several times the bare GEMM. It is
  GPU-oriented code; the column is a correctness and memory reference more than a speed one here.
- Memory: the fused path's peak is one chunk of fp32 logits (256 MiB by default) + dW + dX (H x 4 bytes per token) +
  4-8 bytes per token (lse, entropy, the log-probs); nothing grows like tokens x vocab. The naive path holds three
  [N, V] fp32 buffers in its backward (scatter of the gather's gradient, the saved log-softmax, its gradient): 3 x V x 4
  bytes per token once N > H/2 (below that its peak is one [N, V] buffer + dW, which is why the sweep starts at 512
  tokens and the extrapolation uses its two largest points). The memory target is checked on the direct measurement
  at 8192 tokens (naive and fused_linear, one run each); the extrapolated column is the cross-check of the fit.
- dW (V x H fp32) is part of every path's peak here. Megatron's gradient-accumulation fusion writes it into the
  preallocated `main_grad` instead: the fused entry points do that with `grad_weight_out=main_grad` (not used by this
  benchmark, so its peak above counts dW).
- **GPU**: these CPU numbers do not carry over to a GPU. A GPU run (`nemo-is bench --device cuda`, bf16, 16,384
  tokens; then `python -m tools.bench_docs head`) writes its own section at the top of this page, with the GPU
  targets; a CPU regeneration keeps it.
  `scripts/gpu_check.sh` runs the GPU tests, that run and the model step in one command (logs under `$OUT`, default
  `runs/gpu_check`), and fails if any step failed or the Triton backend fell back to torch (docs/testing.md). What
  the GPU runs so far measured and found: [gpu_runs.md](gpu_runs.md).
"""


def _target_lines(results: dict) -> str:
    lines = ["| target | measured | holds |", "|---|---|---|"]
    for t in targets(results):
        lines.append(f"| {t['target']} | {t['value']:.3g} | {'yes' if t['ok'] else '**no**'} |")
    return "\n".join(lines)


def _memory_lines(results: dict) -> str:
    sweep, fits = results["memory_sweep"], memory_fit(results)
    if not sweep:
        return "(not run: `--no-memory-sweep`)"
    tokens = sorted({p["tokens"] for p in sweep})
    paths = list(dict.fromkeys(p["path"] for p in sweep))
    target = results["config"]["extrapolate_tokens"]
    direct = {p["path"]: p["peak_bytes"] for p in results.get("memory_direct", [])}
    headers = (
        ["path"]
        + [f"{n} tok" for n in tokens]
        + ["bytes/token", f"{target} tok (extrapolated)", f"{target} tok (measured)"]
    )
    cells = []
    for path in paths:
        by_n = {p["tokens"]: p["peak_bytes"] for p in sweep if p["path"] == path}
        fit = fits.get(path)
        cells.append(
            [path]
            + [f"{by_n[n] / MIB:,.0f}" if n in by_n else "-" for n in tokens]
            + ([f"{fit['bytes_per_token']:,.0f}", f"{fit['extrapolated'] / MIB:,.0f}"] if fit else ["-", "-"])
            + [f"{direct[path] / MIB:,.0f}" if path in direct else "-"]
        )
    return markdown_table(headers, cells)


def render_markdown(results: dict, img_prefix: str = "img/") -> str:
    cfg, machine = results["config"], results["machine"]
    headers, cells = table_cells(results)
    h, v = cfg["memory_shape"]
    skipped = "".join(f"\n- `{name}` skipped: {why}" for name, why in results.get("skipped", {}).items())
    return f"""# Performance of the log-prob + loss path

Generated by `nemo-is bench` + `python -m tools.bench_docs cpu` ({machine["date"]}; {machine["cpu"]},
torch {machine["torch"]}, {machine["threads"]} thread(s); {cfg["tokens"]} tokens per shape in {cfg["batch"]} sequences, TP shard 1/{cfg["tp"]},
chunk size {cfg["chunk_size"] or "default"}, best of {cfg["repeats"]} timing round(s) after a memory-tracked warm-up).
Raw results: [`img/perf_results.json`]({img_prefix}perf_results.json).{skipped}

## Results

{markdown_table(headers, cells)}{failures_markdown(results)}

![time ratios]({img_prefix}perf_ratios.png)

## Peak memory vs tokens (forward + loss + backward, H={h}, V={v}, MiB above the inputs)

{_memory_lines(results)}

![memory]({img_prefix}perf_memory.png)

## Targets (checkable on CPU)

{_target_lines(results)}

{METHOD}
{CAVEATS}"""


def write_docs(results: dict, docs_dir: Path) -> list[Path]:
    """Write the page, its two figures and the raw JSON under ``docs_dir``; returns the paths written."""
    img = docs_dir / "img"
    written = [write_json(results, img / "perf_results.json"), plot_ratios(results, img / "perf_ratios.png")]
    if results["memory_sweep"]:
        written.append(plot_memory(results, img / "perf_memory.png"))
    page = docs_dir / "performance.md"
    old = page.read_text() if page.exists() else ""
    page.write_text(carry_gpu_sections(old, render_markdown(results)))  # a GPU run's sections stay
    return written + [page]


__all__ = ["render_markdown", "write_docs"]
