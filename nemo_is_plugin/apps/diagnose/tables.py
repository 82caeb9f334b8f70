"""Rich tables of an :class:`Analysis` and its :class:`Recommendation` for the terminal."""

from __future__ import annotations

import math

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from nemo_is_plugin.apps.diagnose.analysis import Analysis, WeightStats
from nemo_is_plugin.apps.diagnose.recommend import CHI2_BELOW_FLOOR, DEFAULT_CRITERIA, Criteria, Recommendation

_MISMATCH_COLUMNS = (
    ("k1", "mismatch_kl_k1"),
    ("k3", "mismatch_kl_k3"),
    ("log-ppl diff", "log_ppl_diff"),
    ("|log-ppl diff|", "log_ppl_abs_diff"),
    ("chi2 token", "chi2_token"),
    ("chi2 seq", "chi2_seq"),
    ("max |p-g|", "max_abs_log_ratio"),
)


def fmt(x: float | None, pct: bool = False) -> str:
    """Compact number: '-' for missing/NaN, 'inf', 3 significant digits, or a percentage."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if pct:
        return f"{x:.1%}"
    return f"{x:.3g}"


_CHI2_KEYS = ("chi2_token", "chi2_seq")
BELOW_FLOOR_MARK = "*"


def mismatch_table(a: Analysis) -> Table:
    t = Table(title="Training/rollout mismatch by response length (valid tokens)", title_justify="left")
    t.add_column("length", style="bold")
    t.add_column("responses", justify="right")
    t.add_column("valid tokens", justify="right")
    for head, _ in _MISMATCH_COLUMNS:
        t.add_column(head, justify="right")
    for b, m in zip(a.bins, a.mismatch_by_bin):
        t.add_row(b.label, *_mismatch_cells(m))
    t.add_section()
    t.add_row("all", *_mismatch_cells(a.mismatch))
    return t


def _mismatch_cells(m: dict[str, float]) -> list[str]:
    cells = []
    for _, k in _MISMATCH_COLUMNS:
        v = m.get(k)
        below = k in _CHI2_KEYS and v is not None and v < 0  # shown raw, marked, explained under the table
        cells.append(fmt(v) + (BELOW_FLOOR_MARK if below else ""))
    return [str(int(m["responses"])), str(int(m["tokens"])), *cells]


def chi2_below_floor(a: Analysis) -> bool:
    """Whether a chi-square cell of the mismatch table is negative (and so carries the footnote)."""
    return any(m.get(k, 0.0) < 0 for m in [a.mismatch, *a.mismatch_by_bin] for k in _CHI2_KEYS)


def settings_table(a: Analysis, rec: Recommendation | None = None) -> Table:
    t = Table(title="IS weights per setting, all lengths (token-weighted)", title_justify="left")
    t.add_column("setting", no_wrap=True)
    for head in ("mean", "std", "min", "max", "ESS", "truncated", "masked"):
        t.add_column(head, justify="right")
    if rec is not None:
        t.add_column("verdict")
    for r in a.settings:
        o = r.overall
        cells: list[str | Text] = [r.setting.name, *_weight_cells(o)]
        style = None
        if rec is not None:
            fails = rec.failures.get(r.setting.name, [])
            cells.append(Text("ok", style="green") if not fails else Text(fails[0], style="red"))
            style = "bold" if r.setting.name == rec.name else None
        t.add_row(*cells, style=style)
    return t


def by_length_table(a: Analysis, criteria: Criteria = DEFAULT_CRITERIA) -> Table:
    """Settings x length bins; each cell: mean weight, ESS, and % of tokens truncated or masked."""
    t = Table(title="IS weights by response length: mean / ESS / truncated+masked", title_justify="left")
    t.add_column("setting", no_wrap=True)
    for b, m in zip(a.bins, a.mismatch_by_bin):
        t.add_column(f"{b.label}\n({int(m['responses'])} resp)", justify="right")
    for r in a.settings:
        t.add_row(r.setting.name, *[_cell(st, criteria) for st in r.by_bin])
    return t


def _cell(st: WeightStats, c: Criteria) -> Text:
    if not st.n_tokens:
        return Text("-")
    cut = st.truncated + st.masked
    bad = st.ess < c.min_ess or not c.mean_band[0] <= st.mean <= c.mean_band[1] or st.masked > c.max_masked
    return Text(f"{fmt(st.mean)} / {fmt(st.ess)} / {fmt(cut, True)}", style="red" if bad else "")


def detail_table(a: Analysis, name: str) -> Table:
    """Every statistic of one setting, one row per length bin."""
    r = a.result(name)
    t = Table(title=f"{name}: weights by response length", title_justify="left")
    for head in (
        "length",
        "responses",
        "tokens",
        "mean",
        "std",
        "min",
        "max",
        "ESS",
        "truncated",
        "masked",
        "saturated",
    ):
        t.add_column(head, justify="left" if head == "length" else "right")
    for label, st in [(b.label, s) for b, s in zip(a.bins, r.by_bin)] + [("all", r.overall)]:
        t.add_row(label, str(st.n_responses), str(st.n_tokens), *_weight_cells(st), fmt(st.saturated, True))
    return t


def _weight_cells(st: WeightStats) -> list[str]:
    """mean, std, min, max, ESS of the weights and the truncated and masked shares."""
    return [*map(fmt, (st.mean, st.std, st.min, st.max, st.ess)), fmt(st.truncated, True), fmt(st.masked, True)]


def recommendation_panel(rec: Recommendation) -> Panel:
    head = Text(("Recommended: " if rec.ok else "Least bad (no setting is healthy): ") + rec.name, style="bold")
    warn = [Text(f"! {w}", style="yellow") for w in rec.warnings]
    body = Group(head, *warn, *[Text(f"- {r}") for r in rec.reasons], Text(""), Text(rec.yaml().rstrip(), style="cyan"))
    title = "recommendation (tentative: small sample)" if rec.tentative else "recommendation"
    return Panel(body, title=title, border_style="yellow" if rec.tentative else "green" if rec.ok else "red")


def render(
    a: Analysis,
    rec: Recommendation,
    console: Console | None = None,
    *,
    detail: bool = False,
    criteria: Criteria = DEFAULT_CRITERIA,
) -> None:
    """Print the whole report: header, mismatch, per-setting, by-length tables, recommendation."""
    console = console or Console()
    valid = int(a.valid_lengths.sum())
    console.print(
        f"[bold]{a.source}[/bold]: {a.num_responses} responses, {a.num_tokens} tokens of which {valid} are valid "
        f"(mask = 1; the tables count valid tokens only), weights computed in {a.dtype}",
        highlight=False,
    )
    console.print(mismatch_table(a))
    if chi2_below_floor(a):
        console.print(f"{BELOW_FLOOR_MARK} {CHI2_BELOW_FLOOR}", style="dim", markup=False, highlight=False)
    console.print(settings_table(a, rec))
    console.print(by_length_table(a, criteria))
    if detail:
        for r in a.settings:
            console.print(detail_table(a, r.setting.name))
    for name, reason in a.skipped:
        console.print(f"[dim]skipped {name}: {reason}[/dim]")
    console.print(recommendation_panel(rec))
    # the same section once more outside the box, as plain text that copies cleanly into a config file
    console.print(
        f"# {rec.name}{' (tentative)' if rec.tentative else ''}: {'recommended' if rec.ok else 'least bad'} "
        "loss_fn section (nemo-is diagnose --write-config FILE writes it)",
        markup=False,
        highlight=False,
    )
    console.print(rec.yaml().rstrip(), markup=False, highlight=False, soft_wrap=True)
