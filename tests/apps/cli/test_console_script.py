"""The `nemo-is` console script (``nemo_is_plugin.apps:run``): the command line is an extra, so a plugin installed
without it answers with the extra to install, not a traceback. A real install without the extra is checked by
functional_tests/test_clean_install.py."""

from __future__ import annotations

import sys

import pytest

from nemo_is_plugin.apps import run


def _exit_message(monkeypatch, argv):
    monkeypatch.setattr(sys, "argv", ["nemo-is", *argv])
    with pytest.raises(SystemExit) as exc:
        run()
    return exc.value.code


def test_missing_typer_names_the_cli_extra(monkeypatch):
    monkeypatch.delitem(sys.modules, "nemo_is_plugin.apps.cli.main", raising=False)
    monkeypatch.setitem(sys.modules, "typer", None)  # `import typer` raises ModuleNotFoundError(name="typer")
    assert _exit_message(monkeypatch, ["--version"]) == (
        "nemo-is needs typer, which is not installed: install nemo-is-plugin[cli] (pip install 'nemo-is-plugin[cli]')"
    )


def test_a_command_missing_ray_names_the_demo_extra(monkeypatch):
    def demo_without_ray(*args, **kwargs):
        import ray  # noqa: F401

    monkeypatch.setitem(sys.modules, "ray", None)
    import nemo_is_plugin.apps.cli.main as app_module

    monkeypatch.setattr(app_module, "app", demo_without_ray)
    assert _exit_message(monkeypatch, ["demo"]) == (
        "nemo-is needs ray, which is not installed: install nemo-is-plugin[demo] (pip install 'nemo-is-plugin[demo]')"
    )


def test_with_the_extra_installed_the_script_runs_the_app(monkeypatch, capsys):
    assert _exit_message(monkeypatch, ["--version"]) == 0
    assert capsys.readouterr().out.startswith("nemo-is-plugin ")


def test_a_missing_module_no_extra_brings_is_raised(monkeypatch):
    import nemo_is_plugin.apps.cli.main as app_module

    def broken(*args, **kwargs):
        import a_module_that_does_not_exist  # noqa: F401

    monkeypatch.setattr(app_module, "app", broken)
    monkeypatch.setattr(sys, "argv", ["nemo-is"])
    with pytest.raises(ModuleNotFoundError, match="a_module_that_does_not_exist"):
        run()
