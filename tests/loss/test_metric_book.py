"""MetricBook's deferred reductions: token means and extrema are computed at ``finish`` together, one stacked
reduction per mask (and dtype for NeMo-RL's means), with the values of the per-metric formulas (float64
references by hand), the metrics' order kept, and +-inf extrema where nothing is valid."""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nemo_is_plugin.loss.denominator import Denominator
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.metrics import EPS, MetricBook


def _book(valid: torch.Tensor) -> MetricBook:
    layout = TokenLayout.padded(*valid.shape, device=valid.device)
    n_tok = valid.sum().to(torch.float32)
    return MetricBook(layout, valid, n_tok, torch.tensor(float(valid.shape[0])))


def _inputs():
    g = torch.Generator().manual_seed(0)
    valid = (torch.rand(3, 7, generator=g) > 0.3).float()
    other = (torch.rand(3, 7, generator=g) > 0.5).float()
    values = [torch.randn(3, 7, generator=g) for _ in range(4)]
    values[1][0, 0] = float("nan") if valid[0, 0] == 0 else values[1][0, 0]  # masked NaN: an exact 0 in the sum
    return valid, other, values


def test_deferred_means_and_extrema_equal_the_float64_formulas_in_order():
    valid, other, values = _inputs()
    book = _book(valid)
    book.token_mean("a", values[0])
    book.nemo_rl_token_mean("nemo_rl_mean", values[1])
    book.add_sum("plain", torch.tensor(2.5), Denominator.NONE)
    book.token_mean("b", values[2], mask=other)
    book.token_mean("c", values[3])
    book.min_max("m", values[0])
    book.extrema("none_valid", values[2], torch.zeros_like(valid, dtype=torch.bool))
    out = book.finish()
    assert list(out)[:5] == ["a", "nemo_rl_mean", "plain", "b", "c"]  # the order the metrics were added in

    def mean(v, m, dtype=torch.float64):
        v64 = torch.where(m != 0, v.to(dtype) * m.to(dtype), 0.0)
        return float(v64.sum() / (valid.sum().to(dtype) + EPS))

    assert out["a"] == mean(values[0], valid) and out["c"] == mean(values[3], valid)
    assert out["b"] == mean(values[2], other) and out["plain"] == 2.5
    assert abs(out["nemo_rl_mean"] - mean(values[1], valid, torch.float32)) <= 1e-7 * abs(out["nemo_rl_mean"])
    kept = values[0][valid != 0].double()
    assert out["m_min"] == float(kept.min()) and out["m_max"] == float(kept.max())
    assert out["none_valid_min"] == float("inf") and out["none_valid_max"] == float("-inf")
    assert out.denominators["a"] is Denominator.TOKENS and out.denominators["m_min"] is Denominator.NONE


class _Reductions(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_one_reduction_per_mask_however_many_metrics():
    """Why the deferral exists: the epilogue's cost on a GPU is its number of kernel launches. Ten token means over
    one mask and two over another are three sums at finish (two float64 groups, one in NeMo-RL's dtype), not twelve."""
    valid, other, values = _inputs()
    book = _book(valid)
    for i in range(10):
        book.token_mean(f"t{i}", values[i % 4])
    book.token_mean("o1", values[0], mask=other)
    book.token_mean("o2", values[1], mask=other)
    book.nemo_rl_token_mean("l1", values[2])
    for i in range(5):
        book.min_max(f"x{i}", values[i % 4])
    with _Reductions() as seen:
        book.finish()
    assert seen.count["sum"] == 3  # three mean groups (no process group: the sums are not reduced further)
    assert seen.count["amin"] == 1 and seen.count["amax"] == 1 and seen.count["min"] == seen.count["max"] == 0


def test_values_of_broadcastable_shapes_share_a_group():
    """A packed layout hands some per-token values as [1, N] and others as [N]: each is read broadcast with the mask,
    as the per-metric formula does."""
    g = torch.Generator().manual_seed(1)
    valid = (torch.rand(1, 9, generator=g) > 0.3).float()
    a, b = torch.randn(1, 9, generator=g), torch.randn(9, generator=g)
    book = _book(valid)
    book.token_mean("a", a)
    book.token_mean("b", b)
    book.min_max("b", b)
    out = book.finish()
    n = float(valid.sum()) + EPS
    assert out["a"] == float((a.double() * valid.double()).sum() / n)
    assert out["b"] == float((b.double() * valid.double()).sum() / n)
    assert out["b_max"] == float(b[valid[0] != 0].double().max())
