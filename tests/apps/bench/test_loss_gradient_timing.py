"""The loss-gradient timing bench (nemo_is_plugin/apps/bench/loss_gradient_timing.py) runs end to end at a tiny shape:
every config is timed in the schedule it takes, and the torch.func variant it compares computes the same gradient as
the single pass's TokenLossGradient (checked inside the bench before timing). No timing is asserted."""

from __future__ import annotations

import json

from nemo_is_plugin.apps.bench.loss_gradient_timing import CONFIGS, main


def test_every_config_is_timed_in_its_schedule(capsys):
    result = main(["--tokens", "32", "--hidden", "8", "--vocab", "50", "--chunk", "5", "--rounds", "1"])
    assert json.loads(capsys.readouterr().out) == result
    assert result["device"] == "cpu" and result["chunk"] == 5
    for name in CONFIGS:
        steps = set(result[name])
        # GSPO's sequence ratio takes the two-pass schedule: no per-chunk gradient to time
        assert steps == ({"fused"} if name == "gspo_sequence" else {"fused", "build", "grad", "func_vjp"}), name
        assert all(result[name][k] > 0 for k in steps)
