"""What every golden-suite generator shares: the command line, writing case files, regenerating a suite or drawing
fresh cases, and comparing a regenerated suite with the committed one (importing the reference from a checkout:
tools/golden/checkout.py).

A generator (``tools/golden/<suite>.py``) declares a :class:`Suite` and hands it to :func:`run`, with three functions:

- ``make_regenerate(repo) -> regenerate``: imports the reference from the checkout; ``regenerate(case) -> expected``
  runs it on one case's stored config and inputs and returns ``expected`` in the suite's format
  (tests/data/golden/<suite>/README.md);
- ``tolerance(case, path) -> (rtol, atol)``: the suite README's tolerance for one entry of ``expected``
  (``path`` is the key path below ``expected``, e.g. ``("metrics", "kl")``); ``(0, 0)`` means exact.
- ``redraw(case, generator, seed, name) -> case``: for ``--fresh``, new inputs on a committed case's config.

A suite written from a released package rather than a checkout (verl_loss_modes: the installed verl 0.9.1) records the
release tag as its ``commit`` and also declares ``make_regenerate_installed() -> regenerate``, which imports the
installed package (``--installed`` in place of ``--repo``) after checking its version.

A case keeps the reference's outputs under ``expected`` (or, for a suite whose ``outputs`` is None, as top-level entries
next to its inputs), and a suite's cases are ``case_*.pt`` files in its directory (or in the sub-directories its
``parts`` name, each regenerated and compared on its own).

Nothing here imports a reference: the generator does, after ``checkout.use_checkout`` has put the checkout first on
``sys.path``, so the code at the suite's recorded commit is what runs (not a copy installed in the environment), or,
with ``--installed``, from the installed release the suite records.
"""

from __future__ import annotations

import argparse
import copy
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tools.golden.checkout import checkout_commit

GOLDEN = Path(__file__).resolve().parents[2] / "tests" / "data" / "golden"

Tolerance = tuple[float, float]
Regenerate = Callable[[dict], dict]
# (template case, generator, seed, template name) -> a new case (no ``expected`` yet): the template's config and
# masks, its inputs redrawn from the generator, its description and seed saying so.
Redraw = Callable[[dict, torch.Generator, int, str], dict]
ToleranceFn = Callable[[dict, tuple[str, ...]], Tolerance]


def seed_everything(seed: int) -> None:
    """Seed every generator a reference could draw from, so that a regeneration is deterministic."""
    random.seed(seed)
    torch.manual_seed(seed)


# ------------------------------------------------------------------------------------------ case files


def case_paths(directory: Path) -> list[Path]:
    return sorted(directory.glob("case_*.pt"))


def load_case(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def save_case(case: dict, path: Path) -> None:
    """Write one case so that ``torch.load(path, weights_only=True)`` reads it back (plain containers, tensors,
    Python scalars, strings and None only)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(case, path)


def to_metrics(metrics: dict) -> dict[str, float]:
    """A reference's metrics as ``{name: float}`` (0-d tensors and ints become floats, as the suites store them)."""
    return {str(k): float(v.item() if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()}


def error_name(exc: BaseException) -> str:
    return type(exc).__name__


# --------------------------------------------------------------------------------------------- compare


def close(got: float, want: float, tol: Tolerance) -> bool:
    """``|got - want| <= atol + rtol |want|`` for ``tol = (rtol, atol)``; NaN and +-inf must match exactly."""
    if math.isnan(want) or math.isinf(want):
        return (math.isnan(want) and math.isnan(got)) or got == want
    rtol, atol = tol
    return abs(got - want) <= atol + rtol * abs(want)


def diff_values(
    got: Any, want: Any, path: tuple[str, ...], tol_of: Callable[[tuple[str, ...]], Tolerance]
) -> list[str]:
    """Every difference between two case entries beyond tolerance, one line each (empty: they agree).

    Dicts must have the same keys; tensors the same shape and dtype, values within tolerance with NaN/inf matching
    exactly; numbers within tolerance; anything else (strings, None, bools) equal.
    """
    where = ".".join(path) or "<case>"
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return [f"{where}: got {type(got).__name__}, want dict"]
        out = [f"{where}: missing key {k!r}" for k in want if k not in got]
        out += [f"{where}: extra key {k!r}" for k in got if k not in want]
        for k in want:
            if k in got:
                out += diff_values(got[k], want[k], (*path, str(k)), tol_of)
        return out
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            return [f"{where}: got {got!r}, want {want!r}"]
        return [line for i, (g, w) in enumerate(zip(got, want)) for line in diff_values(g, w, (*path, str(i)), tol_of)]
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return [f"{where}: got {type(got).__name__}, want tensor"]
        if got.shape != want.shape or got.dtype != want.dtype:
            return [f"{where}: got {got.dtype}{list(got.shape)}, want {want.dtype}{list(want.shape)}"]
        if want.dtype in (torch.bool, torch.int64, torch.int32) or not want.is_floating_point():
            bad = int((got != want).sum())
            return [f"{where}: {bad} entries differ (exact)"] if bad else []
        rtol, atol = tol_of(path)
        g, w = got.double(), want.double()
        special = ~torch.isfinite(w)
        special_ok = torch.equal(torch.isnan(g[special]), torch.isnan(w[special])) and bool(
            (g[special & ~torch.isnan(w)] == w[special & ~torch.isnan(w)]).all()
        )
        finite = ~special
        err = (g[finite] - w[finite]).abs()
        bound = atol + rtol * w[finite].abs()
        if special_ok and bool((err <= bound).all()):
            return []
        worst = float((err - bound).max()) if err.numel() else float("nan")
        count = int((err > bound).sum())
        return [f"{where}: {count} entries beyond rtol {rtol:g} atol {atol:g} (worst excess {worst:.3g})"]
    if isinstance(want, bool) or want is None or isinstance(want, str):
        return [] if got == want and type(got) is type(want) else [f"{where}: got {got!r}, want {want!r}"]
    if isinstance(want, (int, float)):
        if not isinstance(got, (int, float)) or isinstance(got, bool):
            return [f"{where}: got {got!r}, want {want!r}"]
        tol = tol_of(path)
        if close(float(got), float(want), tol):
            return []
        return [f"{where}: got {got!r}, want {want!r} (rtol {tol[0]:g} atol {tol[1]:g})"]
    return [] if got == want else [f"{where}: got {got!r}, want {want!r}"]


def diff_case(got: dict, want: dict, tolerance: ToleranceFn, outputs: str | None = "expected") -> list[str]:
    """Differences between a regenerated case and the committed one: the entry ``outputs`` (``expected``) within the
    suite's tolerance (keyed by the path below it), everything else (ids, config, inputs, provenance) exactly. With
    ``outputs`` None (outputs stored as top-level entries) every entry is compared with the tolerance of its path from
    the case's top, which the suite's tolerance makes exact for the inputs."""
    if outputs is None:
        return diff_values(got, want, (), lambda path: tolerance(want, path))
    out = diff_values(
        {k: v for k, v in got.items() if k != outputs},
        {k: v for k, v in want.items() if k != outputs},
        (),
        lambda _: (0.0, 0.0),
    )
    if outputs in want or outputs in got:
        out += diff_values(got.get(outputs), want.get(outputs), (outputs,), lambda path: tolerance(want, path[1:]))
    return out


def compare_dirs(
    regenerated: Path,
    committed: Path,
    tolerance: ToleranceFn,
    out: Callable[[str], None] = print,
    outputs: str | None = "expected",
) -> int:
    """Print one line per case (``ok`` or its differences) and return the number of cases that differ; a case file
    present on one side only counts as a difference. ``outputs``: where the cases keep the reference's outputs
    (:func:`diff_case`)."""
    new = {p.name: p for p in case_paths(regenerated)}
    old = {p.name: p for p in case_paths(committed)}
    failed = identical = 0
    for name in sorted(new.keys() | old.keys()):
        if name not in new or name not in old:
            out(f"{name}: only in {'the regenerated' if name in new else 'the committed'} suite")
            failed += 1
            continue
        got, want = load_case(new[name]), load_case(old[name])
        lines = diff_case(got, want, tolerance, outputs)
        if lines:
            failed += 1
            out(f"{name}: DIFFERS")
            for line in lines:
                out(f"    {line}")
        else:
            exact = not diff_values(got, want, (), lambda _: (0.0, 0.0))
            identical += exact
            out(f"{name}: ok ({'bitwise identical' if exact else 'within tolerance'})")
    total = len(new.keys() | old.keys())
    out(f"{total - failed}/{total} cases agree within tolerance ({identical} bitwise identical)")
    return failed


# ------------------------------------------------------------------------------------------------- CLI


def parse_args(suite: str, argv: Sequence[str] | None, doc: str | None, installed: bool = False) -> argparse.Namespace:
    """The generator's options; ``installed``: the suite can also run the installed release (``--installed``) in place
    of a checkout (``--repo``), one of the two required."""
    parser = argparse.ArgumentParser(prog=f"python -m tools.golden.{suite}", description=(doc or "").split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--repo", type=Path, help="checkout of the reference repository")
    if installed:
        source.add_argument(
            "--installed",
            action="store_true",
            help="import the reference from the installed package instead of a checkout (it must be the release the "
            "suite records)",
        )
    parser.set_defaults(installed=False)
    parser.add_argument("--out", type=Path, required=True, help="directory the regenerated case files are written to")
    parser.add_argument(
        "--golden",
        type=Path,
        default=GOLDEN / suite,
        help="suite whose stored configs and inputs are re-run (default: the committed suite)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="then compare --out with --golden within the suite's tolerance; exit 1 on a difference",
    )
    parser.add_argument(
        "--fresh",
        type=int,
        metavar="N",
        help="instead of regenerating, write N new cases numbered after --golden's last one: each a valid case's "
        "config and masks (in turn) with inputs drawn from --seed + i, and the reference's expected values",
    )
    parser.add_argument("--seed", type=int, default=0, help="first seed of --fresh (default 0)")
    args = parser.parse_args(argv)
    if args.fresh is not None and (args.check or args.fresh < 1):
        parser.error("--fresh takes a positive count and writes new cases: nothing to --check them against")
    return args


def with_outputs(case: dict, outputs: dict, key: str | None) -> dict:
    """``case`` with the reference's ``outputs`` stored under ``key`` (None: as top-level entries, replacing those of
    the same names)."""
    return {**case, key: outputs} if key is not None else {**case, **outputs}


def is_error_case(case: dict, key: str | None = "expected") -> bool:
    """Whether the reference raised on this case (its outputs are an ``error`` entry)."""
    return "error" in (case[key] if key is not None else case)


def regenerate_suite(golden: Path, out: Path, regenerate: Regenerate, outputs: str | None = "expected") -> int:
    """Re-run the reference on every case of ``golden`` and write the cases with the new outputs (``expected``, or the
    top-level entries ``regenerate`` returns when ``outputs`` is None) to ``out``; every other entry is carried over
    unchanged. Returns the number of cases written."""
    paths = case_paths(golden)
    if not paths:
        raise SystemExit(f"no case_*.pt files in {golden}")
    for path in paths:
        case = load_case(path)
        seed = case.get("params", {}).get("seed", 0) if isinstance(case.get("params"), dict) else 0
        seed_everything(int(seed or 0))
        save_case(with_outputs(case, regenerate(case), outputs), out / path.name)
    return len(paths)


def fresh_suite(
    golden: Path,
    out: Path,
    count: int,
    seed: int,
    redraw: Redraw,
    regenerate: Regenerate,
    outputs: str | None = "expected",
) -> list[Path]:
    """Write ``count`` new cases to ``out``, numbered after the last case of ``golden``: case i takes the config and
    masks of the suite's valid (non-error) cases in turn, inputs redrawn from ``seed + i``, and the reference's
    ``expected``. Returns the paths written."""
    paths = case_paths(golden)
    templates = [(p.stem, case) for p in paths if not is_error_case(case := load_case(p), outputs)]
    if not templates:
        raise SystemExit(f"no valid case in {golden} to take a config from")
    written = []
    for i in range(count):
        name, template = templates[i % len(templates)]
        case_seed = seed + i
        case = redraw(copy.deepcopy(template), torch.Generator().manual_seed(case_seed), case_seed, name)
        new_name = f"case_{len(paths) + i:03d}"
        if "id" in case:
            case["id"] = new_name
        seed_everything(case_seed)
        save_case(with_outputs(case, regenerate(case), outputs), out / f"{new_name}.pt")
        written.append(out / f"{new_name}.pt")
    return written


def normal(shape: Sequence[int], generator: torch.Generator, std: float = 1.0) -> torch.Tensor:
    """float32 N(0, std^2) draws (CPU: the suites' inputs are CPU tensors)."""
    return torch.randn(tuple(shape), generator=generator, dtype=torch.float32) * std


def log_probs(shape: Sequence[int], generator: torch.Generator) -> torch.Tensor:
    """Plausible token log-probs: -|N(0, 1)| - 0.01, strictly negative."""
    return -normal(shape, generator).abs() - 0.01


@dataclass(frozen=True)
class Suite:
    """One golden suite's generator, as tools/golden/<name>.py declares it for :func:`run`."""

    name: str  # its directory under tests/data/golden
    repository: str  # the host, owner/name on GitHub
    # the host commit the committed suite records (40 hex digits), or for a suite written from a released package
    # that names no commit, the release's tag (``v0.9.1``)
    commit: str
    make_regenerate: Callable[[Path], Regenerate]  # imports the reference from a checkout, returns ``regenerate``
    tolerance: ToleranceFn
    redraw: Redraw
    # where a case keeps the reference's outputs: an entry (``expected``), or None for top-level entries next to the
    # inputs (the tolerance then sees paths from the case's top and must make the inputs exact)
    outputs: str | None = "expected"
    # sub-directories holding the cases, each regenerated and compared on its own ("": the suite directory itself)
    parts: tuple[str, ...] = ("",)
    # for a suite written from a released package (``commit`` its release tag): imports the installed package for
    # ``--installed``, refusing any other version than the recorded release, and returns ``regenerate``; None: the
    # suite needs a checkout
    make_regenerate_installed: Callable[[], Regenerate] | None = None


def compare_suite(suite: Suite, regenerated: Path, committed: Path, out: Callable[[str], None] = print) -> int:
    """:func:`compare_dirs` on each of the suite's parts (a part's lines headed by its name); the number of cases that
    differ in all of them."""
    failed = 0
    for part in suite.parts:
        if part:
            out(f"{suite.name}/{part}:")
        failed += compare_dirs(regenerated / part, committed / part, suite.tolerance, out, suite.outputs)
    return failed


def run(suite: Suite, argv: Sequence[str] | None = None, doc: str | None = None) -> int:
    """The command line of a generator (``python -m tools.golden.<name> --help``)."""
    args = parse_args(suite.name, argv, doc, installed=suite.make_regenerate_installed is not None)
    if args.installed and suite.make_regenerate_installed is not None:
        print(f"{suite.name}: {suite.repository} installed; the committed suite records {suite.commit}")
        regenerate = suite.make_regenerate_installed()
    else:
        head = checkout_commit(args.repo)
        print(
            f"{suite.name}: {suite.repository} from {args.repo} at "
            f"{head or 'a commit git cannot tell (not a checkout)'}; the committed suite records {suite.commit}"
        )
        regenerate = suite.make_regenerate(args.repo)
    for part in suite.parts:
        golden, out, name = args.golden / part, args.out / part, "/".join(filter(None, (suite.name, part)))
        if args.fresh is not None:
            written = fresh_suite(golden, out, args.fresh, args.seed, suite.redraw, regenerate, suite.outputs)
            print(f"{name}: wrote {len(written)} new cases to {out} ({written[0].name} to {written[-1].name})")
        else:
            print(f"{name}: wrote {regenerate_suite(golden, out, regenerate, suite.outputs)} cases to {out}")
    if args.fresh is not None or not args.check:
        return 0
    return 1 if compare_suite(suite, args.out, args.golden) else 0
