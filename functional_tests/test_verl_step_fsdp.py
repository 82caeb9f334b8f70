"""verl 0.9.1's real actor update on its FSDP engine (fsdp2, DP 2) on CPU gloo ranks, see ``_verl_step``."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "verl.workers.engine_workers", reason="verl's training stack is not importable (requirements/ci.lock)"
)

from _verl_step import assert_same_update, run_step, setup_rank  # noqa: E402
from distributed._spawn import run_checks  # noqa: E402

WORLD = 2


def setup_workers(rank: int, world_size: int) -> None:
    setup_rank(rank, world_size)


def _native_vs_plugin(rank: int, world_size: int) -> None:
    native = run_step("fsdp2")
    plugin = run_step("fsdp2", loss_mode="nemo_is.clipped_pg", nemo_is={})
    if rank == 0:
        print(native.metrics)
        print(plugin.metrics)
    assert_same_update(native, plugin)


CHECKS = [("native_vs_plugin", _native_vs_plugin)]


@pytest.fixture(scope="module")
def gloo_results() -> dict[str, str | None]:
    """Every check of ``CHECKS`` in one spawn of ``WORLD`` gloo ranks (verl's set-up is paid once per module)."""
    return run_checks(__name__, WORLD)


@pytest.mark.parametrize("name", [name for name, _ in CHECKS])
def test_verl_fsdp_step(gloo_results, name):
    results = gloo_results
    assert results[name] is None, results[name]
