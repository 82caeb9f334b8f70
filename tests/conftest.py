import torch

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA: skipped (not deselected) without it, run by `make test` where there is."""
    if torch.cuda.is_available():
        return
    import pytest

    skip = pytest.mark.skip(reason="needs a CUDA device (tests marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
