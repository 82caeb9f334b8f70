"""What a benchmark run says about its failures: the measurements a result row's ``failed`` can name (the runner
records ``{measurement: error}`` when a measurement raises), which result column comes from which measurement (its
cells then read ``failed``, never empty), and the lines / markdown that list the errors and a Triton fallback under
the tables (terminal, CPU page, GPU section)."""

from __future__ import annotations

# the measurements a row's ``failed`` can name, and what each is called in the reports
MEASUREMENTS = {
    "fwd": "forward",
    "fwdbwd": "forward+backward",
    "reference": "log-prob and gradient errors vs float64",
    "loss_grad": "loss gradient error vs naive float64",
}
FAILED_CELL = "failed"


def measurement_of(key: str) -> str | None:
    """The measurement (a key of ``MEASUREMENTS``) a result column comes from; None for the row's labels."""
    if key.startswith("fwdbwd_") or key in ("loss_err", "dx_err", "dw_err", "useful_tflops"):
        return "fwdbwd"
    if key.startswith("fwd_"):
        return "fwd"
    if key in ("lp_err", "grad_err"):
        return "reference"
    return "loss_grad" if key == "loss_grad_err" else None


def failure_lines(results: dict) -> list[str]:
    """One line per failed measurement: ``model path measurement: error``."""
    return [
        f"{r['model']} {r['path']} {MEASUREMENTS.get(what, what)}: {error}"
        for r in results["rows"]
        for what, error in (r.get("failed") or {}).items()
    ]


def failures_markdown(results: dict) -> str:
    """The failed measurements and the Triton fallback as markdown paragraphs under a results table ("" if none)."""
    lines = [f"- {line}" for line in failure_lines(results)]
    text = f"\n\nFailed measurements (their cells read `{FAILED_CELL}`):\n" + "\n".join(lines) if lines else ""
    note = fallback_note(results)
    return text + (f"\n\n**Note:** {note}." if note else "")


def fallback_note(results: dict) -> str | None:
    """A sentence when the Triton backend fell back to torch during the run (None: it did not)."""
    reason = results.get("triton_fallback")
    if reason is None:
        return None
    return f"the Triton backend fell back to torch in this run ({reason}): rows with backend torch ran without Triton"


__all__ = ["FAILED_CELL", "MEASUREMENTS", "failure_lines", "failures_markdown", "fallback_note", "measurement_of"]
