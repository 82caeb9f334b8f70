"""verl 0.9.1's real actor update on its Megatron engine (mbridge; TP 2 with sequence parallelism, DP 2: four CPU gloo
ranks), see ``_verl_step``; megatron-core's GPU-only calls shimmed by ``host_shims/megatron_cpu.py``.

- verl's ``vanilla`` against the plugin selected through verl's config: the same loss, grad norm and parameters after
  two optimizer steps (fp32, 1e-6 relative);
- the plugin's own settings: the step runs, every metric the plugin's loss returns reaches verl's metrics under its
  name (the documented ones included), nothing non-finite;
- the head switch (``use_fused_kernels=True``, ``fused_kernel_options.impl_backend=nemo_is``): verl's fused forward
  runs the plugin's head (its calls counted) and the update equals verl's unfused torch path's.

One spawn of four ranks for the module.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip(
    "verl.workers.engine_workers",
    reason="verl's training stack is not importable (verl 0.9.1 with the packages requirements/ci.lock pins for it)",
)
pytest.importorskip("mbridge", reason="mbridge (verl's Megatron bridge, requirements/ci.lock) is not installed")
pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from _ranks import gather_objects  # noqa: E402
from _verl_step import (  # noqa: E402
    MODEL_DIR_ENV,
    OWN_SETTINGS,
    LossSpy,
    assert_metrics_reach_verl,
    assert_same_update,
    run_step,
    setup_rank,
)
from distributed._spawn import run_checks  # noqa: E402

WORLD = 4
ENGINE = "megatron"
PLUGIN = "nemo_is.clipped_pg"
# TP 2 with sequence parallelism (DP = 4 / 2); verl's mbridge path; megatron-core's plain optimizer (its distributed
# optimizer requires CUDA tensor types, megatron/core/optimizer/distrib_optimizer.py line 420)
MEGATRON = {
    "tensor_model_parallel_size": 2,
    "sequence_parallel": True,
    "vanilla_mbridge": True,
    "use_distributed_optimizer": False,
    "override_transformer_config": {"use_cpu_initialization": True},
}
FUSED_NEMO_IS = {"use_fused_kernels": True, "fused_kernel_options": {"impl_backend": "nemo_is"}}


def setup_workers(rank: int, world_size: int) -> None:
    from host_shims import megatron_cpu

    setup_rank(rank, world_size)
    megatron_cpu.install()


def _step(**kwargs):
    return run_step(ENGINE, engine_keys=MEGATRON, **kwargs)


def _native_vs_plugin(rank: int, world_size: int) -> None:
    native = _step()
    with LossSpy() as spy:
        plugin = _step(loss_mode=PLUGIN, nemo_is={})
    assert len(spy.calls) == 4
    assert_same_update(native, plugin)
    assert sum(gather_objects(bool(native.metrics))) == 2  # verl returns metrics from one rank per DP group (TP rank 0)


def _own_setting(name: str):
    keys, documented = OWN_SETTINGS[name]

    def check(rank: int, world_size: int) -> None:
        with LossSpy() as spy:
            result = _step(loss_mode=PLUGIN, nemo_is=keys, rollout_is_weights=True)
        assert len(spy.calls) == 4
        assert_metrics_reach_verl(result, spy, documented)

    return check


def _fused_head(rank: int, world_size: int) -> None:
    import nemo_is_plugin.adapters.verl.head as head

    # SGD: the parameters move by lr x the gradient, so they compare the two heads' gradients (Adam's first steps
    # move every entry by about lr whatever its size, turning a 1e-7 difference of a near-zero gradient into lr)
    sgd = {"optimizer": "sgd"}
    torch_path = _step(optim_keys=sgd)
    calls = []
    original = head.fused_linear_logprobs

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    head.fused_linear_logprobs = counting
    try:
        fused = _step(model_keys=FUSED_NEMO_IS, optim_keys=sgd)
    finally:
        head.fused_linear_logprobs = original
    assert head.head_installed()
    # every micro-batch's forward (two steps x two micro-batches on this rank) went through the plugin's head
    assert len(calls) >= 4, len(calls)
    assert_same_update(torch_path, fused)


CHECKS = [
    ("vanilla", _native_vs_plugin),
    *((f"own_{name}", _own_setting(name)) for name in OWN_SETTINGS),
    ("fused_head_nemo_is", _fused_head),
]
if os.environ.get("NEMO_IS_VERL_STEP_ONLY"):  # to run one check alone while debugging
    CHECKS = [(n, f) for n, f in CHECKS if n == os.environ["NEMO_IS_VERL_STEP_ONLY"]]


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory) -> dict[str, str | None]:
    """Every check of ``CHECKS`` in one spawn of ``WORLD`` gloo ranks (the tiny model in a temporary directory)."""
    os.environ[MODEL_DIR_ENV] = str(tmp_path_factory.mktemp("verl_step_megatron"))
    return run_checks(__name__, WORLD)


@pytest.mark.parametrize("name", [name for name, _ in CHECKS])
def test_verl_megatron_step(gloo_results, name):
    assert gloo_results[name] is None, gloo_results[name]
