"""The demo's headline numbers (summary.json's "headline"): computed from a run's rows and rollouts exactly as the
final table and the plot compute them; the quoted Markdown blocks are rendered from them and replaced in place."""

from __future__ import annotations

import json
import math

import pytest
import torch

from nemo_is_plugin.apps.demo.level_stats import level_stats
from nemo_is_plugin.apps.demo.summary import demo_tables, headline, quoted, readme_sentence, render

SETTINGS = ("gspo_exp_sum", "gspo_seq_mean")


@pytest.fixture
def run(tmp_path):
    """A tiny run directory: two settings, 2 short and 2 long steps each, long responses of 16 tokens."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for name in SETTINGS:
        for phase in ("short", "long"):
            for step in range(2):
                rows.append(
                    {
                        "config": name,
                        "phase": phase,
                        "step": step,
                        "is_raw_weight_std": 0.1 * (step + 1),
                        "clip_fraction": 0.01 * step,
                        "mismatch_kl_k3": 1e-3,
                        "is_raw_weight_mean": 0.5 + 0.1 * step,
                        "is_raw_weight_ess": 0.8 - 0.1 * step,
                    }
                )
    with open(tmp_path / "rollouts.jsonl", "w") as fh:
        for name in SETTINGS:
            for step in range(2):
                for _ in range(3):
                    gen = (-torch.rand(16, generator=g) - 0.1).tolist()
                    prev = [min(x + 0.05 * float(torch.randn(1, generator=g)), -1e-3) for x in gen]
                    fh.write(
                        json.dumps(
                            {
                                "config": f"{name}@long",
                                "phase": "long",
                                "step": step,
                                "mask": [1] * 16,
                                "generation_logprobs": gen,
                                "prev_logprobs": prev,
                            }
                        )
                        + "\n"
                    )
    return tmp_path, rows


def test_headline_numbers_are_the_means_the_table_and_plot_show(run):
    run_dir, rows = run
    h = headline(rows, run_dir, {"gspo_exp_sum": 0.5, "gspo_seq_mean": 0.25})
    s = h["settings"]["gspo_exp_sum"]
    assert s["final_reward"] == 0.5
    assert s["long_is_weight_mean"] == pytest.approx(0.55) and s["long_is_weight_ess"] == pytest.approx(0.75)
    assert s["long_is_weight_batch_means"] == [0.5, pytest.approx(0.6)]
    assert s["short_is_weight_std"] == pytest.approx(0.15) and s["short_clip_fraction"] == pytest.approx(0.005)
    # distinct long batches: step 0 is shared by every setting, so 3 batches of 3 responses
    assert h["long_responses"] == 9 and h["long_response_length"] == 16
    from nemo_is_plugin.apps.demo.plot import long_batches

    batches = long_batches(run_dir)
    want = [level_stats(p, g, m)["is/sequence_mean"] for p, g, m in batches]
    assert h["levels"]["sequence"]["mean"] == pytest.approx(sum(want) / len(want))
    assert list(h["ess_by_length"]["token"]) == ["8", "16"]
    assert h["ess_by_length"]["sequence"]["16"] == pytest.approx(h["levels"]["sequence"]["ess"])


def test_quoted_blocks_render_from_the_summary_and_replace_in_place(run):
    run_dir, rows = run
    summary = {
        "warm_start_reward": 0.125,
        "seconds": 12.0,
        "headline": headline(rows, run_dir, {"gspo_exp_sum": 0.5, "gspo_seq_mean": 0.25}),
    }
    sentence = readme_sentence(summary)
    assert "on 16-token responses" in sentence and "averages 0.55 with ESS 0.75" in sentence
    tables = demo_tables(summary)
    assert "| final reward | 0.500 | 0.250 |" in tables and "Warm-start evaluation reward 0.125" in tables
    page = "intro\n<!-- demo-summary:readme -->\nold numbers\n<!-- /demo-summary:readme -->\nrest\n"
    new = render(page, "readme", sentence)
    assert quoted(new, "readme") == sentence and new.startswith("intro\n") and new.endswith("rest\n")
    with pytest.raises(ValueError, match="no <!-- demo-summary:tables --> block"):
        render(page, "tables", tables)
    assert not math.isnan(summary["headline"]["levels"]["token"]["far"])


def test_reward_panel_labels_the_stars(run, monkeypatch):
    import matplotlib.pyplot as plt

    from nemo_is_plugin.apps.demo.plot import plot_comparison

    run_dir, rows = run
    rows = [dict(r, reward=0.3 + 0.1 * r["step"], grad_norm=1.0, response_length=16.0) for r in rows]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "summary.json").write_text(
        json.dumps(
            {
                "warm_start_reward": 0.3,
                "config": {"eval": {"prompts": 128}},
                "final_reward": {"gspo_exp_sum": 0.5, "gspo_seq_mean": 0.4},
            }
        )
    )
    closed = []
    monkeypatch.setattr(plt, "close", closed.append)
    plot_comparison(run_dir)
    labels = [t.get_text() for t in closed[0].axes[0].get_legend().get_texts()]
    assert "* final eval reward (128 prompts, colour: setting)" in labels
    assert labels.count("* final eval reward (128 prompts, colour: setting)") == 1
