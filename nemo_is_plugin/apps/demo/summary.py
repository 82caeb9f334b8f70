"""The demo's headline numbers: computed once from a run's rows and rollouts, written into ``summary.json``, printed by
the CLI's final table, and quoted by README.md and docs/demo.md from the committed ``docs/demo_summary.json``
(the Markdown between ``<!-- demo-summary:... -->`` markers is :func:`render` of that file; ``tests/test_docs.py``
checks it, ``python -m nemo_is_plugin.apps.demo.summary`` rewrites it).

Per setting (``settings``): final evaluation reward; short phase: mean over steps of the setting's own IS-weight std,
clip fraction and mismatch KL; long phase: mean over the setting's own long batches of its IS-weight mean and ESS
(the CLI table). Per IS level (``levels``): the four levels computed on the same distinct long responses, and
(``ess_by_length``) their ESS when those responses are cut at 8, 16, ... tokens.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

LEVELS = (
    ("sequence", "sequence, exp(sum)"),
    ("sequence_mean", "sequence_mean"),
    ("token", "token"),
    ("cumulative", "cumulative"),
)
_CUTS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def _mean(values: list[float | None]) -> float | None:
    """The mean of the values present (a metric row may lack one), None without any."""
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def headline(rows: list[dict[str, Any]], run_dir: str | Path, final_reward: dict[str, float]) -> dict[str, Any]:
    """The numbers above from a run's metric rows (``metrics.jsonl``) and its ``rollouts.jsonl``."""
    from nemo_is_plugin.apps.demo.level_stats import level_stats
    from nemo_is_plugin.apps.demo.plot import long_batches

    settings: dict[str, Any] = {}
    for name in dict.fromkeys(r["config"] for r in rows):
        short = [r for r in rows if r["config"] == name and r["phase"] == "short"]
        long = [r for r in rows if r["config"] == name and r["phase"] == "long"]
        settings[name] = {
            "final_reward": final_reward.get(name),
            "short_is_weight_std": _mean([r.get("is_raw_weight_std") for r in short]),
            "short_clip_fraction": _mean([r.get("clip_fraction") for r in short]),
            "short_mismatch_kl_k3": _mean([r.get("mismatch_kl_k3") for r in short]),
            "long_is_weight_mean": _mean([r.get("is_raw_weight_mean") for r in long]),
            "long_is_weight_ess": _mean([r.get("is_raw_weight_ess") for r in long]),
            "long_is_weight_batch_means": [r.get("is_raw_weight_mean") for r in long],
            "long_mismatch_kl_k3": _mean([r.get("mismatch_kl_k3") for r in long]),
        }
    out: dict[str, Any] = {"settings": settings, "levels": {}, "ess_by_length": {}}
    run_dir = Path(run_dir)
    batches = long_batches(run_dir) if (run_dir / "rollouts.jsonl").exists() else []
    if batches:
        stats = [level_stats(p, g, m) for p, g, m in batches]
        out["long_responses"] = sum(b[2].shape[0] for b in batches)
        out["long_response_length"] = min(b[2].shape[1] for b in batches)
        for level, _ in LEVELS:
            out["levels"][level] = {
                k: _mean([s[f"is/{level}_{k}"] for s in stats]) for k in ("mean", "std", "ess", "far")
            }
            out["levels"][level]["min"] = min(s[f"is/{level}_min"] for s in stats)
        cuts = [n for n in _CUTS if n <= out["long_response_length"]]
        for level, _ in LEVELS:
            out["ess_by_length"][level] = {
                str(n): _mean([level_stats(p[:, :n], g[:, :n], m[:, :n])[f"is/{level}_ess"] for p, g, m in batches])
                for n in cuts
            }
    return out


# ------------------------------------------------------------------------------------------------------ Markdown
def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def readme_sentence(summary: dict[str, Any]) -> str:
    """README's demo paragraph numbers: what the final table of ``nemo-is demo`` shows for the two GSPO settings."""
    h = summary["headline"]
    s, length = h["settings"], h.get("long_response_length", 0)
    exp_sum, seq_mean = s["gspo_exp_sum"], s["gspo_seq_mean"]
    lv = h["levels"]["sequence"]
    return (
        f"In the committed run ([docs/demo_summary.json](docs/demo_summary.json)), on {length}-token responses "
        f"NeMo-RL's exp(sum) weight of `gspo_exp_sum` averages {_f(exp_sum['long_is_weight_mean'])} with ESS "
        f'{_f(exp_sum["long_is_weight_ess"])} over its own long batches (the final table\'s "long: IS w mean" '
        f'and "ESS"; {_f(lv["mean"])} and {_f(lv["ess"])} over all {h["long_responses"]} long responses), '
        f"while `gspo_seq_mean`'s sequence_mean weight stays at {_f(seq_mean['long_is_weight_mean'])} (ESS "
        f"{_f(seq_mean['long_is_weight_ess'])})."
    )


def demo_tables(summary: dict[str, Any]) -> str:
    """docs/demo.md's result tables."""
    h = summary["headline"]
    s = h["settings"]
    names = list(s)
    lines = [
        f"Warm-start evaluation reward {summary['warm_start_reward']:.3f}; the whole loop took "
        f"{summary['seconds']:.0f} s.",
        "",
        "| | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    rows = (
        ("final reward", "final_reward", 3),
        ("IS weight std (own level, mean over steps)", "short_is_weight_std", 2),
        ("clip fraction (mean over steps)", "short_clip_fraction", 3),
        ("mismatch KL k3 per token", "short_mismatch_kl_k3", None),
        (f"long ({h.get('long_response_length', '?')} tokens): own IS weight mean", "long_is_weight_mean", 2),
        ("long: own IS weight ESS", "long_is_weight_ess", 2),
    )
    for label, key, digits in rows:
        cells = [
            (f"{s[n][key]:.1e}" if digits is None else _f(s[n][key], digits)) if s[n][key] is not None else "-"
            for n in names
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if h["levels"]:
        lines += [
            "",
            f"The four IS levels on the same {h['long_responses']} distinct long responses "
            "(`is/<level>_*`, mean over the long batches):",
            "",
            "| IS level | mean | std | ESS (E w)²/E w² | outside [½, 2] | min |",
            "|---|---|---|---|---|---|",
        ]
        for level, label in LEVELS:
            v = h["levels"][level]
            lines.append(
                f"| {label} | {_f(v['mean'])} | {_f(v['std'])} | {_f(v['ess'])} | {v['far']:.0%} | {v['min']:.3g} |"
            )
        ess = h["ess_by_length"]
        cuts = list(ess["sequence"])
        lines += [
            "",
            f"ESS when the same responses are cut at {cuts[0]} ... {cuts[-1]} tokens:",
            "",
            "| IS level | " + " | ".join(cuts) + " |",
            "|---|" + "---|" * len(cuts),
        ]
        for level, label in LEVELS:
            lines.append(f"| {label} | " + " | ".join(_f(ess[level][c]) for c in cuts) + " |")
    return "\n".join(lines)


BLOCKS = {"README.md": ("readme", readme_sentence), "docs/demo.md": ("tables", demo_tables)}


def _pattern(tag: str) -> re.Pattern:
    return re.compile(rf"(<!-- demo-summary:{tag} -->\n)(.*?)(\n<!-- /demo-summary:{tag} -->)", re.S)


def render(text: str, tag: str, body: str) -> str:
    """``text`` with the block between the ``tag`` markers replaced by ``body``."""
    pattern = _pattern(tag)
    if not pattern.search(text):
        raise ValueError(f"no <!-- demo-summary:{tag} --> block")
    return pattern.sub(lambda m: m.group(1) + body + m.group(3), text)


def quoted(text: str, tag: str) -> str:
    """The body of the ``tag`` block of ``text``."""
    match = _pattern(tag).search(text)
    if match is None:
        raise ValueError(f"no <!-- demo-summary:{tag} --> block")
    return match.group(2)


def main(argv: list[str]) -> None:
    """``python -m nemo_is_plugin.apps.demo.summary SUMMARY.json [ROOT]``: rewrite the quoted blocks from a summary."""
    summary = json.loads(Path(argv[0]).read_text())
    root = Path(argv[1]) if len(argv) > 1 else Path(".")
    for page, (tag, fn) in BLOCKS.items():
        path = root / page
        path.write_text(render(path.read_text(), tag, fn(summary)))
        print(f"wrote {path}")


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
