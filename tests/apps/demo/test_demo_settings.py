"""The demo's loss settings ship with the package: found next to the code in a source tree (symlink to configs/demo)
and listed as package data, so an installed wheel runs ``nemo-is demo`` too."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import tomllib

from nemo_is_plugin.apps.demo.settings import DEFAULT_LOSS_SETTINGS, configs_dir, load_loss_settings

ROOT = Path(__file__).resolve().parents[3]


def test_default_settings_load_from_the_package_directory():
    assert configs_dir().resolve() == (ROOT / "configs" / "demo").resolve()
    settings = load_loss_settings(list(DEFAULT_LOSS_SETTINGS))
    assert list(settings) == list(DEFAULT_LOSS_SETTINGS)
    assert settings["ctpo"]["ratio_level"] == "cumulative"


def test_package_data_globs_cover_every_demo_setting():
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    package_dir = ROOT / "nemo_is_plugin"
    files = [p.relative_to(package_dir).as_posix() for p in configs_dir().glob("*.yaml")]
    assert len(files) >= len(DEFAULT_LOSS_SETTINGS)
    for f in files:
        assert any(fnmatch.fnmatch(f, pat) for pat in patterns["nemo_is_plugin"]), f
    assert (package_dir / "py.typed").exists()
