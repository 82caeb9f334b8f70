"""The extras' one-line errors (nemo_is_plugin/common/extras.py): which modules are missing, found without importing
them, and the extra each missing module names."""

from __future__ import annotations

import sys

import pytest

from nemo_is_plugin.common.extras import (
    EXTRA_MODULES,
    MissingExtraError,
    missing_extra,
    missing_modules,
    require_extra,
)


def test_every_extra_is_installed_in_the_test_environment():
    assert all(missing_modules(modules) == [] for modules in EXTRA_MODULES.values())


def test_a_blocked_or_absent_module_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow` raises ModuleNotFoundError
    assert missing_modules(("typer", "pyarrow", "a_module_that_does_not_exist")) == [
        "pyarrow",
        "a_module_that_does_not_exist",
    ]


def test_require_extra_names_the_extra_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    monkeypatch.setitem(sys.modules, "megatron", None)
    require_extra("cli", "x")  # the cli extra is whole
    with pytest.raises(MissingExtraError) as exc:
        require_extra("demo", "nemo_is_plugin.apps.demo")
    assert str(exc.value) == (
        "nemo_is_plugin.apps.demo needs the 'demo' extra (megatron, ray not installed): "
        "pip install 'nemo-is-plugin[demo]'"
    )
    assert isinstance(exc.value, ImportError) and exc.value.name == "megatron" and exc.value.extra == "demo"
    assert missing_extra(exc.value) == "demo"


@pytest.mark.parametrize(
    ("exc", "extra"),
    [
        (ModuleNotFoundError("No module named 'rich'", name="rich"), "cli"),
        (ModuleNotFoundError("No module named 'click'", name="click"), "cli"),
        (ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib.pyplot"), "cli"),
        (ModuleNotFoundError("No module named 'megatron'", name="megatron.core"), "megatron"),
        (ModuleNotFoundError("No module named 'ray'", name="ray"), "demo"),
        (MissingExtraError("m", name="typer", extra="demo"), "demo"),  # the error's own extra, not typer's
        (ModuleNotFoundError("No module named 'scipy'", name="scipy"), None),  # not an extra's: the traceback stays
        (ImportError("cannot import name 'x' from 'rich'", name="rich"), None),  # installed but broken: not missing
    ],
)
def test_missing_extra(exc, extra):
    assert missing_extra(exc) == extra
