import os

import torch

torch.set_num_threads(1)

SWEEP_ENV = "NEMO_IS_TEST_SWEEP"  # `make test-sweep`: the opt-in exhaustive runs (tests marked sweep)


def pytest_configure(config):
    config.addinivalue_line("markers", f"sweep: exhaustive runs, skipped unless {SWEEP_ENV}=1 (make test-sweep)")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA: skipped (not deselected) without it, run by `make test` where there is. Tests
    marked ``sweep`` (exhaustive runs, tens of minutes) are skipped unless ``$NEMO_IS_TEST_SWEEP`` is 1."""
    import pytest

    skips = []
    if not torch.cuda.is_available():
        skips.append(("gpu", pytest.mark.skip(reason="needs a CUDA device (tests marked gpu)")))
    if os.environ.get(SWEEP_ENV) != "1":
        skips.append(("sweep", pytest.mark.skip(reason=f"opt-in sweep: {SWEEP_ENV}=1 (make test-sweep)")))
    for item in items:
        for marker, skip in skips:
            if marker in item.keywords:
                item.add_marker(skip)
