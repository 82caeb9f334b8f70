"""Host time per loss call at small N, the eager loss against the compiled epilogue, in one run: the ratio.

    python tools/epilogue_host_time.py [--rounds 7] [--calls 20] [--tokens 4x64] [--path loss|fused] [--json]

At a few hundred tokens the loss's [N]-vector work is negligible and a call's time is the host's: Python, dispatch
and, on a GPU, kernel launches (docs/gpu_runs.md), so this is the time the compiled path
(``nemo_is_plugin/loss/compiled.py``) is meant to cut. Per config of ``tools/launch_count.py``:
``ClippedPGLoss.__call__`` + backward, eager and compiled, on the same inputs (``make_problem``, log-probs from the
model); ``calls`` calls per round, the median of ``rounds`` rounds of wall time per call (``time.perf_counter``),
twice, interleaved (both paths see the same machine load), after one warm-up call (the compiled path's first call
compiles: its time is reported apart, ``compile_s``). ``--path fused``: the fused LM-head single pass instead
(``fused_linear_pg_loss`` forward + backward over 8 chunks, H = 32, V = 256: GEMMs of that size cost little, so the
host's share is what the compiled path changes). On a CPU the compiled graph's kernels are C++ (inductor), so the
time also includes arithmetic a GPU would do; the number says what the host saves per call, not what a GPU step saves.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nemo_is_plugin import build_loss_fn  # noqa: E402
from nemo_is_plugin.apps.bench.problem import make_problem  # noqa: E402
from nemo_is_plugin.loss.compiled import CompiledLoss  # noqa: E402
from tools.launch_count import CONFIGS, fused_call, loss_call  # noqa: E402


def per_call_seconds(call: Any, rounds: int, calls: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def time_config(
    config: dict[str, Any], batch: int, seq_len: int, rounds: int, calls: int, path: str = "loss"
) -> dict[str, float]:
    p = make_problem(batch, seq_len + 1, 32, 256, base_logprobs="model")
    x0 = p.data["prev_logprobs"][:, 1:].to(torch.float32).clone()

    def make(loss_fn: Any) -> Any:
        return fused_call(loss_fn, p) if path == "fused" else loss_call(loss_fn, p, x0, True)

    eager, compiled = make(build_loss_fn(config)), make(CompiledLoss(build_loss_fn(config)))
    start = time.perf_counter()
    compiled()
    compile_s = time.perf_counter() - start
    eager()
    out = {"eager_ms": 0.0, "compiled_ms": 0.0}
    for _ in range(2):  # interleaved: both paths see the same machine load
        out["eager_ms"] += 500 * per_call_seconds(eager, rounds, calls)
        out["compiled_ms"] += 500 * per_call_seconds(compiled, rounds, calls)
    out["ratio"] = out["eager_ms"] / out["compiled_ms"]
    out["compile_s"] = compile_s
    return out


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--tokens", default="4x64", help="BxT: sequences x log-prob positions")
    parser.add_argument("--path", choices=("loss", "fused"), default="loss", help="the loss call, or the fused pass")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    batch, seq_len = (int(v) for v in args.tokens.split("x"))
    torch.manual_seed(0)
    timing = (batch, seq_len, args.rounds, args.calls, args.path)
    result = {name: time_config(config, *timing) for name, config in CONFIGS.items()}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        what = "fused single pass" if args.path == "fused" else "loss call"
        print(f"host ms per {what} (+ backward), {batch}x{seq_len} tokens, torch {torch.__version__}")
        print(f"{'config':<16}{'eager ms':>10}{'compiled ms':>13}{'eager/compiled':>16}{'compile s':>11}")
        for name, r in result.items():
            print(
                f"{name:<16}{r['eager_ms']:>10.3f}{r['compiled_ms']:>13.3f}{r['ratio']:>16.2f}{r['compile_s']:>11.1f}"
            )
    return result


if __name__ == "__main__":
    main()
