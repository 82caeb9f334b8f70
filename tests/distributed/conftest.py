"""The multi-process checks' results, shared by the modules that define ``CHECKS`` and ``WORLD`` (see ``_spawn``)."""

from __future__ import annotations

import pytest

from ._spawn import run_checks


@pytest.fixture(scope="module")
def gloo_results(request) -> dict[str, str | None]:
    """``{check name: None or the failing ranks' tracebacks}`` of the requesting module's ``CHECKS``, run once per
    module in ``WORLD`` gloo processes."""
    return run_checks(request.module.__name__, request.module.WORLD)
