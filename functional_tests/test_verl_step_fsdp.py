"""verl 0.9.1's real actor update on its FSDP engine (fsdp2, DP 2) on CPU gloo ranks (``_verl_step``: verl's
``TrainingWorker.train_mini_batch`` -> ``ppo_loss`` -> ``get_policy_loss_fn``, two optimizer steps of two micro-batches
per rank, fp32 parameters, a tiny random Qwen2; verl's default mixed precision computes in bf16).

- verl's ``vanilla`` against the plugin selected through verl's own config (``policy_loss.loss_mode=nemo_is.clipped_pg``
  with an empty ``nemo_is`` section: verl's settings only): the same loss, grad norm and parameters after the two
  steps (1e-6 relative), remove-padding on and off;
- the plugin's own settings (``_verl_step.OWN_SETTINGS``): the step runs, every metric the plugin's loss returns reaches
  verl's step metrics under its name (the documented ones included), nothing non-finite;
- M2PO's batch statistic in verl's step spans one micro-batch of one DP rank (docs/verl.md): at DP 1 and DP 2 the
  first step's calls on the same rows give the same M2 and bounds, each call's M2 is its own rows' by hand, and verl's
  value is the mean of the calls' (``_micro_batch_mean``);
- the head switch (``use_fused_kernels=True``, ``fused_kernel_options.impl_backend=nemo_is``), fp32 compute and SGD:
  verl's fused forward runs the plugin's head (its calls counted) and the update equals verl's unfused path's and
  verl's own ``torch`` backend's (tied embeddings), and verl's unfused path's with an untied LM head (FSDP2 shards it
  on its own; verl's ``torch`` backend fails there).

One spawn of two ranks for the module, running the checks the session selected (and one of one rank for the DP 1
half of the M2PO check); ~70 s on 2 cores, of which the fused-head checks take ~1.5 s (the first check pays the
steps' warm-up, ~10 s).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip(
    "verl.workers.engine_workers",
    reason="verl's training stack is not importable (verl 0.9.1 with the packages requirements/ci.lock pins for it)",
)

from _ranks import gather_objects, publish, published, results_folder  # noqa: E402
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

WORLD = 2
ENGINE = "fsdp2"
PLUGIN = "nemo_is.clipped_pg"
ONLY_ENV = "NEMO_IS_VERL_STEP_ONLY"


def setup_workers(rank: int, world_size: int) -> None:
    setup_rank(rank, world_size)


def _native_vs_plugin(remove_padding: bool):
    def check(rank: int, world_size: int) -> None:
        native = run_step(ENGINE, remove_padding=remove_padding)
        with LossSpy() as spy:
            plugin = run_step(ENGINE, loss_mode=PLUGIN, nemo_is={}, remove_padding=remove_padding)
        assert len(spy.calls) == 4  # two steps of two micro-batches on this rank, all through the plugin
        assert_same_update(native, plugin)

    return check


def _own_setting(name: str):
    keys, documented = OWN_SETTINGS[name]

    def check(rank: int, world_size: int) -> None:
        with LossSpy() as spy:
            result = run_step(ENGINE, loss_mode=PLUGIN, nemo_is=keys, rollout_is_weights=True)
        assert len(spy.calls) == 4
        assert_metrics_reach_verl(result, spy, documented)

    return check


def _m2po_span(rank: int, world_size: int) -> None:
    """Each call's M2 from its own rows by hand; verl's reported value per step = the mean of that step's calls over
    every rank; the first step's per-row values written out for the DP 1 / DP 2 comparison."""
    keys, documented = OWN_SETTINGS["m2po"]
    with LossSpy() as spy:
        result = run_step(ENGINE, loss_mode=PLUGIN, nemo_is=keys, rollout_is_weights=False)
    assert_metrics_reach_verl(result, spy, documented)
    ours = "actor/nemo_is/"
    records = []
    for call in spy.calls:
        x, metrics = call["inputs"], call["out"][1]
        mask = x["response_mask"].bool()
        delta = (x["old_log_prob"] - x["log_prob"]).double()
        first = mask.double().argmax(-1)
        adv0 = x["advantages"].double().gather(1, first[:, None]).expand_as(delta)
        ratio = (-delta).exp()
        harmful = mask & (((adv0 > 1e-12) & (ratio > 1 + 1e-12)) | ((adv0 < -1e-12) & (ratio < 1 - 1e-12)))
        m2 = (delta[harmful] ** 2).mean().item() if harmful.any() else 0.0
        assert abs(metrics[ours + "m2po_m2"] - m2) <= 1e-6 * max(m2, 1e-12), (metrics[ours + "m2po_m2"], m2)
        row = round(float((x["old_log_prob"] * mask).sum()), 4)  # the row's identity: its old log-probs
        names = (
            "m2po_m2",
            "m2po_m2_after",
            "m2po_clip_high_max_micro_batch_mean",
            "m2po_clip_low_min_micro_batch_mean",
        )
        records.append({"row": row, **{n: float(metrics[ours + n]) for n in names}})
    gathered = gather_objects(records)
    half = len(records) // 2
    for step in range(2):
        calls = [r for rank_records in gathered for r in rank_records[step * half : (step + 1) * half]]
        for name in ("m2po_m2", "m2po_clip_high_max_micro_batch_mean"):
            mean = sum(c[name] for c in calls) / len(calls)
            got = result.metrics[ours + name][step] if rank == 0 else mean
            assert abs(got - mean) <= 1e-9 * max(abs(mean), 1.0), (name, step, got, mean)
    publish(f"dp{world_size}", [r for rank_records in gathered for r in rank_records[:half]])  # the first step


def _counting_head():
    """A context manager counting the calls of the plugin's head from verl's FSDP fused forward."""
    import contextlib

    from nemo_is_plugin.adapters.verl import fsdp_head

    @contextlib.contextmanager
    def counting():
        calls: list[int] = []
        original = fsdp_head.fused_linear_logprobs

        def counted(*args, **kwargs):
            calls.append(1)
            return original(*args, **kwargs)

        fsdp_head.fused_linear_logprobs = counted
        try:
            yield calls
        finally:
            fsdp_head.fused_linear_logprobs = original

    return counting()


def _fused_head(rank: int, world_size: int) -> None:
    """The head switch on the FSDP engine, tied embeddings: verl's fused forward (``use_fused_kernels=True``) with
    ``impl_backend=nemo_is`` runs the plugin's head in every micro-batch's forward (counted) and gives the update of
    verl's unfused path and of the same fused forward on verl's torch backend (``FusedLinearForPPO``)."""
    unfused = _fp32_step(tied=True)
    verl_fused = _fp32_step(fused_keys("torch"), tied=True)
    with _counting_head() as calls:
        plugin_fused = _fp32_step(fused_keys("nemo_is"), tied=True)
    assert len(calls) == 4, len(calls)  # two steps x two micro-batches on this rank, each forward on the plugin's head
    assert_same_update(unfused, plugin_fused)
    assert_same_update(verl_fused, plugin_fused)


def _fused_head_untied(rank: int, world_size: int) -> None:
    """Untied embeddings: verl's FSDP2 wrapping shards ``lm_head`` as its own unit and verl's fused forwards read its
    weight outside its forward (this rank's shard; verl's torch backend fails there, "got mixed torch.Tensor and
    DTensor"): the plugin's head runs as an FSDP2 forward method of ``lm_head`` and gives verl's unfused update."""
    unfused = _fp32_step(tied=False)
    with _counting_head() as calls:
        plugin_fused = _fp32_step(fused_keys("nemo_is"), tied=False)
    assert len(calls) == 4, len(calls)
    assert_same_update(unfused, plugin_fused)


# fp32 compute: without ``mixed_precision`` verl's FSDP engine computes in bf16 (FSDP2 ``param_dtype`` and autocast,
# ``FSDPEngine._build_fsdp_module`` in verl/workers/engine/fsdp/transformer_impl.py), where the heads' roundings
# differ; SGD: the parameters move by lr x the gradient, so they compare the heads' gradients (Adam's first steps move
# every entry by about lr whatever its size, turning a 1e-7 difference of a near-zero gradient into lr)
FP32 = {"mixed_precision": {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}}


def _fp32_step(model_keys: dict | None = None, *, tied: bool):
    """One ``run_step`` in fp32 with SGD; the model class's forward restored after it: verl's fused patch sets it on
    the class (``patch_forward_with_backends`` in verl/models/transformers/monkey_patch.py: ``model.__class__.forward
    = ...``), so every later Qwen2 of the process, an unfused one included, would run the fused forward."""
    from transformers import Qwen2ForCausalLM

    forward = Qwen2ForCausalLM.forward
    try:
        return run_step(ENGINE, model_keys=model_keys, engine_keys=FP32, optim_keys={"optimizer": "SGD"}, tied=tied)
    finally:
        Qwen2ForCausalLM.forward = forward  # type: ignore[method-assign]


def fused_keys(backend: str) -> dict:
    return {"use_fused_kernels": True, "fused_kernel_options": {"impl_backend": backend}}


CHECKS = [
    ("vanilla_remove_padding", _native_vs_plugin(True)),
    ("vanilla_padded", _native_vs_plugin(False)),
    *((f"own_{name}", _own_setting(name)) for name in OWN_SETTINGS if name != "m2po"),
    ("m2po_span", _m2po_span),
    ("fused_head_nemo_is", _fused_head),
    ("fused_head_nemo_is_untied", _fused_head_untied),
]
if os.environ.get(ONLY_ENV):  # the checks the session selected (pytest -k), or the DP 1 spawn's one
    CHECKS = [(n, f) for n, f in CHECKS if n in os.environ[ONLY_ENV].split(",")]


@pytest.fixture(scope="module")
def span_dir(tmp_path_factory) -> Path:
    """The M2PO span records and the tiny model (``_verl_step.model_dir``), for both spawns of the module."""
    path = tmp_path_factory.mktemp("verl_step_fsdp")
    os.environ[MODEL_DIR_ENV] = str(path)
    return path


def _selected_checks(session) -> list[str]:
    """The checks this session's tests of the module need (all of them without ``-k``)."""
    names = set()
    for item in session.items:
        if getattr(item, "module", None) is None or item.module.__name__ != __name__:
            continue
        callspec = getattr(item, "callspec", None)
        names.add(callspec.params["name"] if callspec is not None else "m2po_span")
    return [name for name, _ in CHECKS if name in names]


@pytest.fixture(scope="module")
def gloo_results(request, span_dir) -> dict[str, str | None]:
    """The selected checks of ``CHECKS`` in one spawn of ``WORLD`` gloo ranks (verl's set-up is paid once per
    module)."""
    with results_folder(span_dir, **{ONLY_ENV: ",".join(_selected_checks(request.session))}):
        return run_checks(__name__, WORLD)


@pytest.fixture(scope="module")
def dp1_results(span_dir) -> dict[str, str | None]:
    with results_folder(span_dir, **{ONLY_ENV: "m2po_span"}):
        return run_checks(__name__, 1)


@pytest.mark.parametrize("name", [name for name, _ in CHECKS])
def test_verl_fsdp_step(gloo_results, name):
    assert gloo_results[name] is None, gloo_results[name]


def test_m2po_statistic_spans_one_micro_batch_at_dp1_and_dp2(gloo_results, dp1_results, span_dir):
    """The first step runs every call on the initial parameters: rows the DP 1 and the DP 2 step both hold give the
    same M2 and bounds, so the statistic saw neither the other rank's rows nor the other micro-batches'."""
    assert gloo_results["m2po_span"] is None, gloo_results["m2po_span"]
    assert dp1_results["m2po_span"] is None, dp1_results["m2po_span"]
    dp1 = {r["row"]: r for r in published(span_dir, "dp1")}
    dp2 = {r["row"]: r for r in published(span_dir, "dp2")}
    shared = sorted(set(dp1) & set(dp2))
    assert len(shared) >= 2, (sorted(dp1), sorted(dp2))
    for row in shared:
        for name, value in dp1[row].items():
            assert value == pytest.approx(dp2[row][name], rel=1e-6, abs=1e-12), (row, name)
    # and the statistic is not a constant: the rows' M2s differ
    assert len({round(dp1[r]["m2po_m2"], 9) for r in dp1}) > 1
