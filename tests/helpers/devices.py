"""Devices to run a test on: CPU always, CUDA where there is one (tests on it are marked ``gpu``).

Parametrise with ``@pytest.mark.parametrize("device", DEVICES)``; a CUDA-only test uses ``@pytest.mark.gpu`` (the
conftest skips it without CUDA). The fused-path parity tests reuse the same list.
"""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]
