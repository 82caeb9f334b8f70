"""Each app imports only with its extra: without one of the extra's packages, importing the app (any of its modules)
raises an ImportError whose one-line message names the extra to install. Checked in a fresh interpreter per app, the
package blocked as ``import`` sees a missing one (``sys.modules[name] = None``); the clean-install test
(functional_tests/test_clean_install.py) checks the same in a venv that really lacks them."""

from __future__ import annotations

import subprocess
import sys

import pytest

# app -> (its extra, a module of the app, a package of the extra to block)
APPS = {
    "cli": ("cli", "nemo_is_plugin.apps.cli.main", "typer"),
    "compat": ("cli", "nemo_is_plugin.apps.compat.compare", "rich"),
    "demo": ("demo", "nemo_is_plugin.apps.demo.settings", "ray"),
    "diagnose": ("cli", "nemo_is_plugin.apps.diagnose.binning", "pyarrow"),
    "evidence": ("cli", "nemo_is_plugin.apps.evidence.stats", "matplotlib"),
    "bench": ("cli", "nemo_is_plugin.apps.bench.shapes", "matplotlib"),
}
CODE = """
import sys
sys.modules[{blocked!r}] = None
try:
    import {module}
except ImportError as exc:
    print(type(exc).__name__, exc.name, exc, sep="|")
else:
    print("imported")
"""


def test_every_app_is_listed():
    from pathlib import Path

    import nemo_is_plugin.apps

    root = Path(nemo_is_plugin.apps.__file__).parent
    assert {p.name for p in root.iterdir() if (p / "__init__.py").exists()} == set(APPS)


@pytest.mark.parametrize("app", sorted(APPS))
def test_an_app_without_its_extra_names_the_extra(app):
    extra, module, blocked = APPS[app]
    code = CODE.format(blocked=blocked, module=module)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    kind, name, message = out.stdout.strip().split("|")
    assert (kind, name) == ("MissingExtraError", blocked)
    assert message == (
        f"nemo_is_plugin.apps.{app} needs the '{extra}' extra ({blocked} not installed): "
        f"pip install 'nemo-is-plugin[{extra}]'"
    )


def test_the_runtime_imports_without_any_extra():
    """The loss, the distributed entry points and the adapters import with every extra's package blocked."""
    blocked = ("typer", "rich", "matplotlib", "pyarrow", "ray", "click")
    code = (
        "import sys\n"
        + "".join(f"sys.modules[{m!r}] = None\n" for m in blocked)
        + "import nemo_is_plugin, nemo_is_plugin.recipes, nemo_is_plugin.adapters.nemo_rl.loss_fn, "
        "nemo_is_plugin.adapters.verl, nemo_is_plugin.adapters.slime, "
        "nemo_is_plugin.distributed.entry_points.logit_loss, "
        "nemo_is_plugin.distributed.entry_points.fused_linear_loss\n"
        "print(sorted(m for m in sys.modules if m.startswith('nemo_is_plugin.apps')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip() == "[]"
