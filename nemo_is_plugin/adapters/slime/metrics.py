"""The policy objectives' own metrics in slime's metric dictionary, reduced as slime reduces every metric.

slime's ``loss_function`` (slime/backends/megatron_utils/loss.py @624b824a) puts the values of the custom loss's
metric dictionary in one tensor per micro-batch; ``reduce_train_step_metrics`` (slime/observability/
train_metric_utils.py) sums those tensors over the step's micro-batches and the DP x CP ranks and divides by the step's
sample count (``sum_of_sample_mean`` values: per-sample means), or by its token count under
``--calculate-per-token-loss``. So every value here is additive in that sense, and every micro-batch of every rank
returns the same names in the same order (slime adds the tensors position by position).

An objective reports through the part of the loss's ``MetricBook`` it uses (``token_mean``, ``seq_mean``,
``extrema``; ``layout``, ``valid``): :class:`SlimeObjectiveBook` gives it that interface with slime's reducer:

- ``token_mean``: the per-token value reduced with slime's ``sum_of_sample_mean`` (slime's own metrics' meaning);
- ``seq_mean``: the per-sequence value on each of the sequence's tokens, reduced the same way (with per-sample means:
  the mean over the step's samples);
- ``extrema`` of one value per loss call (M2PO's clip bounds, a statistic of the call's batch): that value on every
  token, reduced the same way, under ``<name>_mean``: the mean over the step's samples of the bound their micro-batch
  used. slime has no min / max reduction, so a ``_min`` / ``_max`` name would not say what slime reports;
- the objective's derived statistics (``PolicyObjective.finalize``, M2PO's ``m2po_m2`` / ``m2po_m2_after``): computed
  from the call's token means over its whole batch (every CP and DP rank of the call: the statistic the objective used),
  then on every token as above; 0 where the objective derives nothing (M2PO without a harmful token).

Names carry the adapter's ``nemo_is/`` prefix.

Score centering's metrics (:func:`centering_metrics`) are the loss's (``score_centering_metrics``: token means over the
tokens the term acts on, here reduced with ``sum_of_sample_mean``; ``score_centering_loss`` is the term as the loss
adds it), and upstream slime's names for the head masses and the per-token correction (THUDM/slime 2e5cd7cd,
``policy_loss_function``): ``sc_sampler_head_mass`` (Q_H), ``sc_train_head_mass`` (P_H), ``sc_correction``
(sum_v c_v log p_v, before the advantage). The loss's ``score_centering_share`` is a ratio of step sums, which slime's
additive reduction cannot form: it is left out (``score_centering_grad_abs`` and ``score_centering_pg_grad_abs`` are
its two sums).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nemo_is_plugin.loss.denominator import Denominator
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.masked import where_mask
from nemo_is_plugin.loss.objectives import ObjectiveOut, PolicyObjective
from nemo_is_plugin.loss.score_centering import CenteringOut, score_centering_metrics
from nemo_is_plugin.loss.terms import TermInputs

Reducer = Callable[[torch.Tensor], torch.Tensor]


class SlimeObjectiveBook:
    """The metric book an objective's ``report`` writes to, for slime (module docstring). ``valid``: this rank's
    response-token mask (slime's loss masks); ``reduce``: slime's ``sum_of_sample_mean``."""

    def __init__(self, layout: TokenLayout, valid: torch.Tensor, reduce: Reducer, prefix: str):
        self.layout, self.valid, self.reduce, self.prefix = layout, valid, reduce, prefix
        self.values: dict[str, torch.Tensor] = {}
        self._call_sums: dict[str, torch.Tensor] = {}  # token sums over this rank's valid tokens, for finalize
        self._call_scalars: dict[str, torch.Tensor] = {}

    def _tokens(self, values: torch.Tensor) -> torch.Tensor:
        return values.detach().double().expand(self.valid.shape)

    def token_mean(self, name: str, values: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        x = where_mask(self._tokens(values), self.valid if mask is None else mask)
        self.values[name] = self.reduce(x)
        self._call_sums[name] = where_mask(x, self.valid).sum()

    def add_sum(self, name: str, value: torch.Tensor, per: Denominator) -> None:
        """A value already reduced with slime's reducer (additive as slime sums it); ``per`` is the loss's denominator
        argument, which slime's reducer has applied."""
        self.values[name] = value.detach().double()

    def seq_mean(self, name: str, per_seq: torch.Tensor, sample_mask: torch.Tensor) -> None:
        kept = where_mask(per_seq.detach().double(), sample_mask)
        self.values[name] = self.reduce(self._tokens(self.layout.to_tokens(kept)))

    def extrema(self, name: str, values: torch.Tensor, valid: torch.Tensor) -> None:
        if values.numel() != 1:
            raise NotImplementedError(
                f"slime sums its metrics over micro-batches and ranks: the extrema of '{name}' over tokens have no "
                "slime reduction; report one value per loss call, or token / sequence means"
            )
        self._call_scalars[f"{name}_mean"] = values.detach().double().reshape(())

    def finish(self, objective: PolicyObjective) -> dict[str, torch.Tensor]:
        """Every metric, prefixed, in a fixed order: the means, the per-call values, then the derived statistics."""
        derived = objective.finalize(dict.fromkeys(self._call_sums, 1.0))  # the names it derives (fixed per config)
        if derived:
            names = list(self._call_sums)
            count = where_mask(torch.ones_like(self.valid, dtype=torch.float64), self.valid).sum()
            sums = self.layout.reduce_batch_sums(torch.stack([self._call_sums[n] for n in names] + [count]))
            means = dict(zip(names, (sums[:-1] / sums[-1].clamp_min(1.0)).tolist(), strict=True))
            got = objective.finalize(means)
            for key in derived:
                derived_value = got.get(key, 0.0)
                self._call_scalars[key] = torch.as_tensor(derived_value, dtype=torch.float64, device=self.valid.device)
        for name, scalar in self._call_scalars.items():
            self.values[name] = self.reduce(self._tokens(scalar))
        dtype = self.valid.dtype if self.valid.is_floating_point() else torch.float32
        return {self.prefix + name: value.to(dtype) for name, value in self.values.items()}


def objective_metrics(
    objective: PolicyObjective,
    out: ObjectiveOut,
    layout: TokenLayout,
    valid: torch.Tensor,
    reduce: Reducer,
    prefix: str,
) -> dict[str, torch.Tensor]:
    """The objective's own metrics for slime (module docstring); {} for an objective that reports none."""
    with torch.no_grad():
        book = SlimeObjectiveBook(layout, valid, reduce, prefix)
        sample_mask = (layout.seq_sum(where_mask(torch.ones_like(valid, dtype=torch.float64), valid)) > 0).double()
        objective.report(book, out, sample_mask)
        return book.finish(objective)


def centering_metrics(
    t: TermInputs,
    out: CenteringOut,
    sc_loss: torch.Tensor,
    c: torch.Tensor,
    trainer_head: torch.Tensor,
    reduce: Reducer,
    prefix: str,
) -> dict[str, torch.Tensor]:
    """Score centering's metrics for slime (module docstring): the loss's, prefixed, and upstream slime's names."""
    with torch.no_grad():
        book = SlimeObjectiveBook(t.layout, t.valid, reduce, prefix)
        score_centering_metrics(book, out, sc_loss, Denominator.NONE, c, trainer_head, t.advantages, t.is_weight)
        dtype = c.dtype
        got = {prefix + name: value.to(dtype) for name, value in book.values.items()}
        lp = torch.where(out.filled, trainer_head.detach().to(out.coef.dtype), torch.zeros_like(out.coef))
        zero = torch.zeros_like(out.sampler_tail)
        for name, values in (
            ("sc_sampler_head_mass", 1.0 - out.sampler_tail),
            ("sc_train_head_mass", 1.0 - out.trainer_tail),
            ("sc_correction", (out.coef * lp).sum(-1)),
        ):
            got[name] = reduce(torch.where(out.counted, values, zero).to(dtype))
        return got


__all__ = ["SlimeObjectiveBook", "centering_metrics", "objective_metrics"]
