"""Which response tokens of a slime micro-batch this context-parallel rank holds, and where they sit in the logits.

slime packs a micro-batch's samples (prompt + response, ``total_lengths[i]`` tokens, the last
``response_lengths[i]`` of them the response) one after the other into ``logits [1, T, V/TP]``. The logit at position
j predicts token j + 1, so the response's log-probs come from positions ``[P - 1, L - 1)`` (P = prompt length, L =
total length). Under context parallelism (slime's ring-attention layout, ``slime/backends/megatron_utils/cp_utils.py``
at commit 624b824a) each sample is cut into ``2 * cp`` chunks of ``ceil(L / (2 * cp))`` positions (the last padded),
and rank r holds chunks r and 2 * cp - 1 - r, laid out as ``2 * chunk`` rows per sample. slime's per-token tensors
(``pg_loss``, per-sample log-probs, advantages) list each sample's local response tokens, chunk r's before chunk
2 * cp - 1 - r's; its per-sample ``loss_masks`` stay whole (``[R_i]``) and are sliced by the same rule.

:class:`ResponseShard` holds that bookkeeping once (Python ints: slime's lengths are lists, so there is no host
synchronisation) and gives the plugin's :class:`~nemo_is_plugin.loss.layout.TokenLayout` of the local tokens: a
packed layout without CP, a :class:`~nemo_is_plugin.distributed.parallel.context_parallel.CPTokenLayout` with global
chunk ids under CP, so that sequence sums and cumulative prefixes span the CP ranks exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nemo_is_plugin.distributed.parallel.context_parallel import CPTokenLayout
from nemo_is_plugin.distributed.parallel.groups import ProcessGroup, group_rank, group_size
from nemo_is_plugin.loss.layout import TokenLayout


@dataclass(frozen=True)
class Span:
    """One contiguous run of a sample's local response tokens.

    response: ``[lo, hi)`` response positions; row: the logits row of position ``lo``; chunk: its global chunk id.
    """

    response: tuple[int, int]
    row: int
    chunk: int

    @property
    def length(self) -> int:
        return self.response[1] - self.response[0]


def _spans(total: int, response: int, cp_rank: int, cp_size: int, row0: int) -> tuple[list[Span], int]:
    """The local spans of one sample, and the rows the sample takes in the logits."""
    prompt = total - response
    if cp_size == 1:
        return [Span((0, response), row0 + prompt - 1, 0)] if response > 0 else [], total
    chunk = -(-total // (2 * cp_size))
    spans = []
    for slot, chunk_id in enumerate((cp_rank, 2 * cp_size - 1 - cp_rank)):
        lo, hi = max(chunk_id * chunk, prompt - 1), min((chunk_id + 1) * chunk, total - 1)
        if lo < hi:  # logit positions [lo, hi) predict response positions [lo - (prompt - 1), hi - (prompt - 1))
            spans.append(
                Span((lo - prompt + 1, hi - prompt + 1), row0 + slot * chunk + lo - chunk_id * chunk, chunk_id)
            )
    return spans, 2 * chunk


class ResponseShard:
    """The response tokens of one slime micro-batch held by this CP rank (see the module docstring).

    Args:
        total_lengths, response_lengths: slime's per-sample lengths (Python ints).
        cp_group: the context-parallel group (None: one rank holds everything).
        device: where index tensors and the layout live (the logits' / log-probs' device).
    """

    def __init__(
        self,
        total_lengths: Sequence[int],
        response_lengths: Sequence[int],
        cp_group: ProcessGroup | None,
        device: torch.device | str | None,
    ):
        self.cp_size, self.cp_rank = group_size(cp_group), group_rank(cp_group)
        self.cp_group = cp_group if self.cp_size > 1 else None
        self.response_lengths = [int(r) for r in response_lengths]
        self.device = device
        self.spans: list[list[Span]] = []
        row = 0
        for total, response in zip(total_lengths, self.response_lengths, strict=True):
            if not 0 < response < int(total):
                raise ValueError(
                    f"a slime sample needs a prompt and a response: total_length={total}, response_length={response}"
                )
            spans, rows = _spans(int(total), response, self.cp_rank, self.cp_size, row)
            self.spans.append(spans)
            row += rows
        self.local_lengths = [sum(s.length for s in spans) for spans in self.spans]
        self.num_tokens = sum(self.local_lengths)

    @property
    def num_seqs(self) -> int:
        return len(self.spans)

    def _ints(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def logit_rows(self) -> torch.Tensor:
        """Long[N]: the row of ``logits[0]`` of each local response token."""
        return self._ints([s.row + k for spans in self.spans for s in spans for k in range(s.length)])

    def target_index(self, response_offset: Sequence[int]) -> torch.Tensor:
        """Long[N]: the index, in the concatenation of the samples' *full* token lists, of each local token's id.

        ``response_offset[i]``: where sample i's response starts in that concatenation (its start + prompt length).
        """
        return self._ints(
            [
                off + s.response[0] + k
                for spans, off in zip(self.spans, response_offset, strict=True)
                for s in spans
                for k in range(s.length)
            ]
        )

    def local(self, per_sample: Sequence[torch.Tensor]) -> torch.Tensor:
        """The local tokens of whole per-sample response tensors (``[R_i]`` each, e.g. slime's ``loss_masks``)."""
        if len(per_sample) != self.num_seqs:
            raise ValueError(f"{len(per_sample)} per-sample tensors for {self.num_seqs} samples")
        parts = [x[s.response[0] : s.response[1]] for x, spans in zip(per_sample, self.spans) for s in spans]
        if not parts:
            return per_sample[0][:0] if per_sample else torch.zeros(0, device=self.device)
        return torch.cat(parts)

    def check_local(self, name: str, per_sample: Sequence[torch.Tensor]) -> torch.Tensor:
        """Concatenate slime's CP-local per-sample tensors (e.g. ``log_probs``), checking their lengths."""
        got = [int(x.numel()) for x in per_sample]
        if got != self.local_lengths:
            raise ValueError(
                f"slime's {name} hold {got} tokens per sample, but this CP rank holds {self.local_lengths} "
                f"(cp_size={self.cp_size}, cp_rank={self.cp_rank})"
            )
        return torch.cat(list(per_sample)) if per_sample else torch.zeros(0, device=self.device)

    def check_local_rows(self, name: str, per_sample: Sequence[torch.Tensor]) -> torch.Tensor:
        """Concatenate slime's CP-local per-sample ``[R_i, k]`` tensors (the sampler's head), checking their rows."""
        if any(not isinstance(x, torch.Tensor) for x in per_sample):
            kinds = sorted({type(x).__name__ for x in per_sample if not isinstance(x, torch.Tensor)})
            raise TypeError(
                f"slime's {name} hold {kinds}, not tensors: a spilled head (a disk reference) is not read by the "
                "plugin; keep the head resident (no --rollout-routed-experts-store-dir)"
            )
        got = [int(x.shape[0]) if x.dim() == 2 else -1 for x in per_sample]
        if got != self.local_lengths:
            raise ValueError(
                f"slime's {name} hold {[list(x.shape) for x in per_sample]} per sample, expected [rows, k] with rows "
                f"{self.local_lengths} on this CP rank (cp_size={self.cp_size}, cp_rank={self.cp_rank})"
            )
        return torch.cat(list(per_sample)) if per_sample else torch.zeros(0, 0, device=self.device)

    def scatter_local(self, per_sample: Sequence[torch.Tensor], local: torch.Tensor) -> list[torch.Tensor]:
        """Whole per-sample tensors with this rank's positions replaced by ``local`` ([N]); others unchanged."""
        out, start = [], 0
        for x, spans in zip(per_sample, self.spans, strict=True):
            y = x.clone()
            for s in spans:
                y[s.response[0] : s.response[1]] = local[start : start + s.length].to(y.dtype)
                start += s.length
            out.append(y)
        return out

    def layout(self) -> TokenLayout:
        """The plugin's layout of the local tokens (global response positions; CP-exact sequence reductions)."""
        if self.cp_size == 1:
            cu = [0]
            for n in self.local_lengths:
                cu.append(cu[-1] + n)
            return TokenLayout.packed(cu, device=self.device)
        flat = [
            (i, s.response[0] + k, s.chunk)
            for i, spans in enumerate(self.spans)
            for s in spans
            for k in range(s.length)
        ]
        seq, pos, chunk = (self._ints([t[j] for t in flat]) for j in range(3))
        return CPTokenLayout(seq, pos, chunk, self.num_seqs, 2 * self.cp_size, self.cp_group, in_order=True)


__all__ = ["ResponseShard", "Span"]
