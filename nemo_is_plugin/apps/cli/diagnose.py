"""``nemo-is diagnose DUMP``: what the training/rollout mismatch of a rollout dump does to each IS setting.

Registered on the main app by ``cli/main.py`` through :func:`register`. Imports of torch / matplotlib happen inside
the command so that ``nemo-is --help`` stays fast.
"""

from __future__ import annotations

from pathlib import Path

import typer

_EXIT_BAD_INPUT = 2


def _floats(text: str, option: str, n: int) -> tuple[float, ...]:
    try:
        vals = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise typer.BadParameter(f"{option} expects {n} comma-separated numbers, got {text!r}") from None
    if len(vals) != n:
        raise typer.BadParameter(f"{option} expects {n} comma-separated numbers, got {text!r}")
    return vals


def _band(text: str, option: str) -> tuple[float, float]:
    low, high = _floats(text, option, 2)
    return low, high


def _names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def register(app: typer.Typer) -> None:
    """Add the ``diagnose`` command to ``app``."""

    @app.command("diagnose")
    def diagnose_cmd(
        dump: Path = typer.Argument(..., help="Rollout dump: .jsonl / .jsonl.gz / .parquet, or a run directory."),
        levels: str = typer.Option("token,sequence,sequence_mean,cumulative", help="IS levels, comma-separated."),
        truncations: str = typer.Option(
            "none,tis,icepop", help="Truncations: none, tis, icepop, seq-mask-tis, seq-mis, geo-rs (comma-separated)."
        ),
        tis_high: float = typer.Option(2.0, help="tis: upper bound C of clamp(w, 0, C)."),
        icepop: str = typer.Option("0.5,5", help="icepop: LOW,HIGH band of kept token weights."),
        seq_mask_tis: str = typer.Option("0.999,1.002", help="seq-mask-tis: LOW,HIGH band of the geometric mean."),
        seq_mis: str = typer.Option("0.5,2", help="seq-mis: LOW,HIGH band of the sequence weight."),
        geo_rs: str = typer.Option("0.999,1.001", help="geo-rs: LOW,HIGH band of the geometric mean."),
        veto: float | None = typer.Option(None, help="Also veto sequences with a token weight below this."),
        bins: str | None = typer.Option(None, help="Length-bin edges, e.g. 256,1024,4096 (default: powers of 2)."),
        max_bins: int = typer.Option(6, min=1, help="Most bins when edges are automatic."),
        step: list[int] | None = typer.Option(None, help="Only responses of this step (repeatable)."),
        config: str | None = typer.Option(None, help="Only responses with this 'config' label."),
        dtype: str = typer.Option("float32", help="float32 (as the loss computes) or float64."),
        min_ess: float = typer.Option(0.5, help="Recommendation: smallest acceptable ESS per length bin."),
        max_masked: float = typer.Option(0.1, help="Recommendation: largest acceptable masked fraction per bin."),
        out: Path | None = typer.Option(None, help="Directory for the PNG plots (default: <dump dir>/diagnose)."),
        no_plots: bool = typer.Option(False, "--no-plots", help="Do not write plots."),
        json_out: Path | None = typer.Option(None, "--json", help="Also write the full report as JSON here."),
        write_config: Path | None = typer.Option(
            None, "--write-config", help="Write the recommended loss_fn section here, a YAML config ready to use."
        ),
        detail: bool = typer.Option(False, "--detail", help="Print every statistic of every setting, bin by bin."),
    ) -> None:
        """Diagnose the training/rollout mismatch of a rollout dump for every IS level and truncation."""
        import json

        from rich.console import Console

        from nemo_is_plugin.apps.cli.paths import check_paths
        from nemo_is_plugin.apps.diagnose import DumpError, diagnose
        from nemo_is_plugin.apps.diagnose.recommend import Criteria

        console = Console()
        check_paths(  # a bad output path is refused before anything is written
            "diagnose",
            [
                (json_out, "--json", "output_file"),
                (write_config, "--write-config", "output_file"),
                (None if no_plots else out, "--out", "output_dir"),
            ],
        )
        try:
            bounds: dict[str, tuple[float | None, float]] = {
                "tis": (None, tis_high),
                "icepop": _band(icepop, "--icepop"),
                "seq-mask-tis": _band(seq_mask_tis, "--seq-mask-tis"),
                "seq-mis": _band(seq_mis, "--seq-mis"),
                "geo-rs": _band(geo_rs, "--geo-rs"),
            }
            edges = [int(v) for v in _floats(bins, "--bins", len(bins.split(",")))] if bins else None
            report = diagnose(
                dump,
                levels=_names(levels),
                truncations=_names(truncations),
                bounds=bounds,
                veto=veto,
                dtype=dtype,
                max_bins=max_bins,
                edges=edges,
                steps=step or None,
                config=config,
                criteria=Criteria(min_ess=min_ess, max_masked=max_masked),
            )
        except (DumpError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
            console.print(f"[red]error:[/red] {exc}", markup=True, highlight=False)
            raise typer.Exit(_EXIT_BAD_INPUT) from None

        report.print(console, detail=detail)
        if not no_plots:
            out_dir = out if out is not None else (dump if dump.is_dir() else dump.parent) / "diagnose"
            for p in report.plot(out_dir):
                console.print(f"wrote {p}")
        if json_out is not None:
            _write_atomically(json_out, json.dumps(report.to_dict(), indent=2))
            console.print(f"wrote {json_out}")
        if write_config is not None:
            rec = report.recommendation
            verdict = "recommended" if rec.ok else "least bad (no setting is healthy)"
            tentative = " (tentative: small sample)" if rec.tentative else ""
            head = (
                f"# written by nemo-is diagnose {dump}: {verdict} setting {rec.name}{tentative}\n"
                "# the IS keys of a loss_fn section; every other key keeps its value (or NeMo-RL's default)\n"
            )
            _write_atomically(write_config, head + rec.yaml())
            console.print(f"wrote {write_config}")


def _write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, so that a failure leaves no half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
