"""Importing the config's schema imports no torch (checked in a fresh interpreter, where nothing has loaded it yet).

A config-only tool (``nemo-is validate`` refusing a key, an adapter's start-up hook reading a section) must not pay
for torch; the assembled model (``nemo_is_plugin.loss.config_model``) loads the objective modules, and torch with
them, only when a name of it is first read.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

# Every module of the config package that is the config layer (tests/test_layers.py), and the package roots.
TORCH_FREE = (
    "nemo_is_plugin",
    "nemo_is_plugin.config",
    "nemo_is_plugin.config.contradictions",
    "nemo_is_plugin.config.errors",
    "nemo_is_plugin.config.field_types",
    "nemo_is_plugin.config.keys",
    "nemo_is_plugin.config.rejection_rule",
    "nemo_is_plugin.config.unknown_keys",
)


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_config_schema_imports_no_torch():
    imports = "; ".join(f"import {name}" for name in TORCH_FREE)
    loaded = _run(f"import sys; {imports}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    assert loaded == "[]"


def test_the_assembled_model_loads_on_first_use():
    """The package root's lazy re-export is the loss layer's class, and reading it is what imports torch (the check
    above can fail); the config package does not re-export it (it imports nothing of the loss: tests/test_layers.py)
    and says where it lives."""
    out = _run(
        "import sys; import nemo_is_plugin, nemo_is_plugin.config as c; before = 'torch' in sys.modules; "
        "from nemo_is_plugin import ClippedPGLossConfig; "
        "from nemo_is_plugin.loss.config_model import ClippedPGLossConfig as Model, load_loss_config; "
        "print(before, 'torch' in sys.modules, ClippedPGLossConfig is Model, "
        "load_loss_config({'ratio_clip_min': 0.1}).ratio_clip_min)"
    )
    assert out == "False True True 0.1"


@pytest.mark.parametrize("name", ["ClippedPGLossConfig", "load_loss_config", "NUMERIC_RANGES", "PolicyObjective"])
def test_the_config_package_says_where_the_assembled_model_lives(name):
    """A fresh interpreter: the ImportError names the loss module, and the attempt imports no torch."""
    out = _run(
        "import sys\n"
        "try:\n"
        f"    from nemo_is_plugin.config import {name}\n"
        "except ImportError as exc:\n"
        "    print(exc.name, 'nemo_is_plugin.loss.config_model' in str(exc), 'torch' in sys.modules)\n"
    )
    assert out == f"{name} True False"
    import nemo_is_plugin.config as config

    assert not hasattr(config, "KeySection")  # any other missing name stays an AttributeError
