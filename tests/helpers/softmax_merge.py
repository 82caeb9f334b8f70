"""The online-softmax merge of two parts' partials, which the package does over TP ranks inside its all-reduce
(``distributed.head.vocab_parallel``); the tests merge shards one by one with it to check the algebra."""

from __future__ import annotations

import torch

from nemo_is_plugin.kernels.softmax_partials import SoftmaxPartials, rescale_partials


def merge_partials(a: SoftmaxPartials, b: SoftmaxPartials) -> SoftmaxPartials:
    """Online-softmax merge of two disjoint vocab blocks of the same tokens (targets add: one of them is 0)."""
    m = torch.maximum(a.max, b.max)
    a, b = rescale_partials(a, m), rescale_partials(b, m)
    if (a.sum_zexp is None) != (b.sum_zexp is None):
        raise ValueError("cannot merge partials with an entropy field into partials without one")
    sum_zexp = None if a.sum_zexp is None or b.sum_zexp is None else a.sum_zexp + b.sum_zexp
    return SoftmaxPartials(m, a.sumexp + b.sumexp, a.target + b.target, sum_zexp)
