"""Fixtures of the diagnose tests."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture
def records():
    from nemo_is_plugin.apps.diagnose.synthetic import synthetic_records

    return synthetic_records(12, min_len=2, max_len=40, steps=3, configs=["a", "b"], seed=3)
