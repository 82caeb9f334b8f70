"""``python -m tools.bench_docs PAGE RESULTS.json [--docs-dir docs]``: write one part of ``docs/performance.md`` from a
saved ``nemo-is bench`` run (see ``tools/bench_docs/__init__.py``). Exit 2 with one line when the results may not be
written (a GPU section from a CPU or ``--quick`` run, a missing file)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

PAGES = ("cpu", "head", "model-step", "host-heads")


def write(page: str, results: dict, docs_dir: Path) -> list[Path]:
    """Write ``page`` of ``docs_dir/performance.md`` from ``results``; ValueError when they may not be written."""
    if page == "cpu":
        from tools.bench_docs.performance_page import write_docs

        return write_docs(results, docs_dir)
    if page == "host-heads":
        from tools.bench_docs.host_heads_section import write_section

        return write_section(results, docs_dir)
    from tools.bench_docs.gpu_sections import write_gpu_section

    return write_gpu_section(results, docs_dir, page)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_docs", description=__doc__)
    parser.add_argument("page", choices=PAGES, help="the CPU page or one GPU section")
    parser.add_argument("results", type=Path, help="the results JSON a nemo-is bench run wrote")
    parser.add_argument("--docs-dir", type=Path, default=Path("docs"), help="the docs directory (default: docs)")
    args = parser.parse_args(argv)
    if not args.results.is_file():
        print(f"error: {args.results}: no such file", file=sys.stderr)
        return 2
    if args.docs_dir.exists() and not args.docs_dir.is_dir():
        print(f"error: --docs-dir {args.docs_dir} is a file", file=sys.stderr)
        return 2
    try:
        written = write(args.page, json.loads(args.results.read_text()), args.docs_dir)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
