"""A verl worker where the plugin's entry point fails to load: every nemo_is setting stops the run where verl reads it,
in one line naming the import error and the fix (adapters/verl/plugin_guard.py), instead of verl's own kernel running
with ``impl_backend=nemo_is`` set (verl logs the failure at DEBUG and goes on).

Run on verl 0.9.1's real modules, in a subprocess whose pydantic is made unimportable before ``import verl`` (verl
imports without it; the plugin's loss needs it): what a worker environment with a broken dependency of the plugin looks
like. ~10 s (one verl import).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.worker_result import result_json

pytest.importorskip("verl.workers.config.model", reason="verl is the verl extra: pip install 'nemo-is-plugin[verl]'")
from importlib.metadata import entry_points  # noqa: E402

from nemo_is_plugin.adapters.verl import fsdp_head, head, plugin_guard  # noqa: E402
from nemo_is_plugin.adapters.verl.policy_loss import VERL_LOSS_NAME  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LOSS_SWITCH_MODULE = "nemo_rl.algorithms.loss.loss_functions"
BROKEN_WORKER = textwrap.dedent("""
    import json, sys
    from types import SimpleNamespace
    sys.modules["pydantic"] = None  # a dependency of the plugin broken in this environment
    import verl

    out = {"hooks": {m: sorted(k) for m, k in getattr(sys, "_nemo_is_after_import_callbacks", {}).items()}}

    def outcome(fn, *args, **kwargs):
        try:
            fn(*args, **kwargs)
            return "ran"
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"

    from verl.workers.config.model import HFModelConfig
    def config(**kw):
        return HFModelConfig(path=sys.argv[1], load_tokenizer=False, **kw)
    out["config_nemo_is"] = outcome(config, use_fused_kernels=True, fused_kernel_options={"impl_backend": "nemo_is"})
    out["config_nemo_is_unfused"] = outcome(config, fused_kernel_options={"impl_backend": "nemo_is"})
    out["config_verl"] = outcome(config, use_fused_kernels=True, fused_kernel_options={"impl_backend": "triton"})

    from verl.trainer.ppo import core_algos
    from verl.workers.utils import losses  # what verl's ppo_loss looks the loss mode up with
    out["lookup_is_guarded"] = getattr(losses.get_policy_loss_fn, "nemo_is_guard", False)
    out["loss_nemo_is"] = outcome(losses.get_policy_loss_fn, sys.argv[2])
    out["loss_verl"] = outcome(losses.get_policy_loss_fn, "vanilla")

    from verl.models.transformers import monkey_patch
    out["fsdp_nemo_is"] = outcome(monkey_patch.patch_forward_with_backends, None, True, "nemo_is")

    from verl.workers.engine.megatron.transformer_impl import MegatronEngine
    engine = SimpleNamespace(model_config=SimpleNamespace(fused_kernel_options={"impl_backend": "nemo_is"}),
                             engine_config=SimpleNamespace(use_fused_kernels=True))
    out["megatron_nemo_is"] = outcome(MegatronEngine._maybe_enable_fused_kernels, engine)
    engine.engine_config.use_fused_kernels = False  # verl's own method returns at once
    engine.model_config.fused_kernel_options = {}
    out["megatron_verl"] = outcome(MegatronEngine._maybe_enable_fused_kernels, engine)
    print("RESULT " + json.dumps(out))
""")
IMPORT_ERROR = "ModuleNotFoundError: import of pydantic halted; None in sys.modules"


def test_the_guard_names_the_modules_head_and_the_loss_use():
    assert plugin_guard.BACKEND == head.BACKEND
    assert (plugin_guard.CONFIG_MODULE, plugin_guard.ENGINE_MODULE) == (head.CONFIG_MODULE, head.ENGINE_MODULE)
    assert (plugin_guard.ENGINE_CLASS, plugin_guard.ENGINE_METHOD) == (head.ENGINE_CLASS, head.ENGINE_METHOD)
    assert (plugin_guard.FSDP_PATCH_MODULE, plugin_guard.FSDP_PATCH) == (fsdp_head.PATCH_MODULE, fsdp_head.PATCH)
    assert VERL_LOSS_NAME.startswith(plugin_guard.LOSS_PREFIX)
    names = [ep.value for ep in entry_points(group="verl.plugins") if ep.name == "nemo_is"]
    assert names == [plugin_guard.ENTRY_POINT]


def test_the_entry_point_reaches_its_guard_on_the_standard_library_alone(tmp_path):
    """torch and pydantic both unimportable: the entry point still imports, warns once and installs the guard."""
    code = (
        "import sys; sys.modules['torch'] = sys.modules['pydantic'] = None\n"
        "import nemo_is_plugin.adapters.verl.plugin\n"
        "print('RESULT ' + ' '.join(sorted(getattr(sys, '_nemo_is_after_import_callbacks', {}))))"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("RESULT ")[1].split() == sorted(
        [
            LOSS_SWITCH_MODULE,  # the start-up hook's loss_fn.name switch (the repository root on PYTHONPATH)
            plugin_guard.CONFIG_MODULE,
            plugin_guard.ENGINE_MODULE,
            plugin_guard.FSDP_PATCH_MODULE,
            plugin_guard.LOSS_MODULE,
        ]
    )
    warnings = [line for line in proc.stderr.splitlines() if "verl entry point failed to load" in line]
    assert len(warnings) == 1 and "import of torch halted" in warnings[0]


@pytest.fixture(scope="module")
def broken_worker(tmp_path_factory) -> tuple[dict, str]:
    tmp = tmp_path_factory.mktemp("verl-guard")
    hf = tmp / "tiny_hf"
    hf.mkdir()
    (hf / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 16, "n_layer": 1})
    )
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_PLUGINS", "VERL_USE_EXTERNAL_MODULES")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", BROKEN_WORKER, str(hf), VERL_LOSS_NAME],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return result_json(proc), proc.stderr


def _assert_stops(message: str, setting: str, fix: str) -> None:
    assert message.startswith(f"PluginNotLoadedError: {setting} asks for nemo-is-plugin, but its verl entry point")
    assert IMPORT_ERROR in message and f"python -c '{plugin_guard.TRACEBACK_CHECK}'" in message
    assert fix in message and "\n" not in message


def test_import_verl_warns_once_and_installs_only_the_guard(broken_worker):
    out, stderr = broken_worker
    warnings = [line for line in stderr.splitlines() if "verl entry point failed to load" in line]
    assert len(warnings) == 1 and IMPORT_ERROR in warnings[0]
    assert out["hooks"] == {  # none of head.py's
        LOSS_SWITCH_MODULE: ["nemo_is.loss_fn_name"],  # the start-up hook's (the repository root on PYTHONPATH)
        plugin_guard.CONFIG_MODULE: ["nemo_is.verl_guard.config"],
        plugin_guard.ENGINE_MODULE: ["nemo_is.verl_guard.engine"],
        plugin_guard.FSDP_PATCH_MODULE: ["nemo_is.verl_guard.fsdp"],
        plugin_guard.LOSS_MODULE: ["nemo_is.verl_guard.loss"],
    }


def test_impl_backend_nemo_is_stops_where_verl_reads_the_model_config(broken_worker):
    out, _ = broken_worker
    fix = "set actor_rollout_ref.model.fused_kernel_options.impl_backend to one of verl's"
    for case in ("config_nemo_is", "config_nemo_is_unfused", "fsdp_nemo_is", "megatron_nemo_is"):
        _assert_stops(out[case], "fused_kernel_options.impl_backend=nemo_is", fix)
    assert out["config_verl"] == out["megatron_verl"] == "ran"  # verl's own settings are untouched


def test_a_nemo_is_loss_mode_stops_at_verls_loss_lookup(broken_worker):
    out, _ = broken_worker
    assert out["lookup_is_guarded"]  # the function verl's ppo_loss calls
    _assert_stops(out["loss_nemo_is"], f"loss_mode={VERL_LOSS_NAME}", "choose one of verl's loss modes")
    assert out["loss_verl"] == "ran"
