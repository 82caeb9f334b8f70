"""The diagnose plots explain every mark (legend) and keep settings with equal values visible (offsets, markers)."""

from __future__ import annotations

import numpy as np
import pytest

from nemo_is_plugin.apps.diagnose import diagnose, plots, synthetic_records, write_dump


@pytest.fixture
def figures(monkeypatch, tmp_path):
    """The figures the plot functions would save, keyed by file name."""
    saved = {}

    def keep(fig, path):
        saved[str(path).rsplit("/", 1)[-1]] = fig
        return path

    monkeypatch.setattr(plots, "_save", keep)
    path = write_dump(synthetic_records(40, min_len=4, max_len=300, mismatch_std=0.02, seed=4), tmp_path / "d.jsonl")
    diagnose(path, truncations=("none", "tis")).plot(tmp_path)
    return saved


def _legend_texts(fig) -> list[str]:
    return [t.get_text() for legend in fig.legends for t in legend.get_texts()]


def test_weights_vs_length_legend_names_the_dots_the_dashed_lines_and_the_medians(figures):
    texts = _legend_texts(figures["diagnose_weights_vs_length.png"])
    assert texts == ["one response", "median of a length bin", "w = 2 and w = 1/2", "w = 1 (no mismatch)"]


def test_bins_plot_offsets_equal_settings_and_marks_levels(figures):
    fig = figures["diagnose_bins.png"]
    ax_ess = fig.axes[0]
    lines = {ln.get_label(): ln for ln in ax_ess.get_lines()}
    token, seq_mean = lines["token"], lines["sequence_mean"]
    # a 2% mismatch leaves token and sequence_mean weights at ESS ~1 in every bin: same values, different places
    assert np.allclose(token.get_ydata(), seq_mean.get_ydata(), atol=0.01)
    assert np.all(np.abs(np.asarray(token.get_xdata()) - np.asarray(seq_mean.get_xdata())) > 0.05)
    assert token.get_marker() != seq_mean.get_marker()
    assert all(abs(x - round(x)) <= plots._DODGE / 2 + 1e-9 for ln in lines.values() for x in ln.get_xdata())
    assert set(_legend_texts(fig)) == set(lines)
