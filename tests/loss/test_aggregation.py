"""Loss aggregation modes over global counts (hand-computed)."""

import pytest
import torch

from nemo_is_plugin.loss.aggregation import aggregate
from nemo_is_plugin.loss.layout import TokenLayout

F64 = torch.float64
X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 100.0]], dtype=F64)
TM = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=F64)
SM = torch.tensor([1.0, 1.0], dtype=F64)
LAY = TokenLayout.padded(2, 3)


@pytest.mark.parametrize(
    "mode, want",
    [
        ("token-mean", 15.0 / 10.0),  # global tokens 10 (other ranks hold 5)
        ("token-sum", 15.0),  # verl's token-sum: no count
        ("seq-mean-token-mean", (2.0 + 4.5) / 4.0),  # global sequences 4
        ("seq-mean-token-sum", (6.0 + 9.0) / 4.0),
        ("seq-mean-token-sum-norm", (6.0 / 8 + 9.0 / 8) / 4.0),
    ],
)
def test_modes(mode, want):
    got = aggregate(X, TM, SM, LAY, mode=mode, global_valid_toks=10.0, global_valid_seqs=4.0, norm=8.0)
    assert abs(got.item() - want) < 1e-7


def test_masked_sample_and_empty_batch():
    sm = torch.tensor([1.0, 0.0], dtype=F64)
    got = aggregate(X, TM, sm, LAY, mode="token-mean", global_valid_toks=3.0, global_valid_seqs=1.0)
    assert abs(got.item() - 2.0) < 1e-7
    zero = aggregate(
        X, torch.zeros_like(TM), SM, LAY, mode="seq-mean-token-mean", global_valid_toks=0.0, global_valid_seqs=2.0
    )
    assert zero.item() == 0.0


def test_token_sum_reaches_the_single_pass_through_its_aggregation_weights():
    """separable.aggregation_weights differentiates aggregate(): token-sum's weights are the valid mask itself."""
    from nemo_is_plugin.loss import LossInputs
    from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
    from nemo_is_plugin.loss.separable import aggregation_weights

    cfg = ClippedPGLossConfig(loss_aggregation="token-sum")
    assert cfg.token_level_loss  # no per-sequence normalisation: NeMo-RL's token level
    inputs = LossInputs(X, X, X, None, X, TM, torch.tensor([1.0, 0.0], dtype=F64), 4.0, 10.0)
    a = aggregation_weights(cfg, TM, inputs.sample_mask, LAY, inputs)
    assert torch.equal(a, TM * torch.tensor([[1.0], [0.0]], dtype=F64))
