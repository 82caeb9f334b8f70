"""Loss registry: entry points of the ``nemo_is_plugin.losses`` group plus in-process registrations (``LOSSES``)."""

from __future__ import annotations

import json
from importlib.metadata import EntryPoint

import pytest

from nemo_is_plugin import build_loss_fn
from nemo_is_plugin.loss import ClippedPGLoss, registry
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
from nemo_is_plugin.loss.registry import (
    DEFAULT_LOSS_NAME,
    LOSSES,
    UnknownLossError,
    check_loss_name,
    get_loss,
    registered_names,
    split_name,
)

SCRATCH = "tests.scratch_loss"


@pytest.fixture(autouse=True)
def _unread_entry_points(monkeypatch):
    """Each test starts before the registry's first read of the installed entry points (its cache)."""
    monkeypatch.setattr(registry, "_INSTALLED", None)


def test_installed_entry_points_are_read_once_and_again_on_a_miss(monkeypatch):
    reads: list[str] = []
    late = EntryPoint("their.late_loss", "json:dumps", registry.ENTRY_POINT_GROUP)
    installed: list[EntryPoint] = []

    def counted(group):
        reads.append(group)
        return list(installed)

    monkeypatch.setattr(registry, "entry_points", counted)
    for _ in range(3):
        assert get_loss(DEFAULT_LOSS_NAME) is ClippedPGLoss
    assert len(reads) == 1  # one scan of the installed distributions, not one per lookup
    installed.append(late)  # a package installed after the first read: a lookup of its name reads again
    assert get_loss("their.late_loss") is json.dumps
    assert len(reads) == 2
    with pytest.raises(UnknownLossError):
        get_loss("their.missing_loss")


def test_the_packages_own_loss_resolves_without_installed_metadata(monkeypatch):
    assert DEFAULT_LOSS_NAME in registered_names()
    assert get_loss("nemo_is.clipped_pg") is ClippedPGLoss
    # imported from PYTHONPATH (a Ray worker, the GPU check): no installed entry point at all, the loss still resolves
    monkeypatch.setattr(registry, "entry_points", lambda group: [])
    assert registered_names() == [DEFAULT_LOSS_NAME]
    assert isinstance(build_loss_fn({"name": DEFAULT_LOSS_NAME}), ClippedPGLoss)


def test_an_installed_entry_point_is_listed_and_may_override_a_builtin_name(monkeypatch):
    theirs = EntryPoint(DEFAULT_LOSS_NAME, "json:loads", registry.ENTRY_POINT_GROUP)
    extra = EntryPoint("their.loss", "json:dumps", registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(
        registry, "entry_points", lambda group: [theirs, extra] if group == registry.ENTRY_POINT_GROUP else []
    )
    assert registered_names() == [DEFAULT_LOSS_NAME, "their.loss"]
    assert get_loss(DEFAULT_LOSS_NAME) is json.loads and get_loss("their.loss") is json.dumps


def test_unknown_name_lists_registered_names_and_suggests():
    with pytest.raises(UnknownLossError) as info:
        get_loss("nemo_is.clipped_pq")
    msg = str(info.value)
    assert "'nemo_is.clipped_pq'" in msg and "Did you mean 'nemo_is.clipped_pg'?" in msg
    assert "Registered losses: " in msg and "'nemo_is.clipped_pg'" in msg
    assert info.value.known == registered_names()
    assert isinstance(info.value, LookupError)
    with pytest.raises(UnknownLossError):
        check_loss_name("nemo_is.clipped_pq")
    check_loss_name(DEFAULT_LOSS_NAME)


def test_unknown_name_without_close_match_still_lists_names():
    with pytest.raises(UnknownLossError, match=r"unknown loss 'zzz'\. Registered losses: .*nemo_is\.clipped_pg"):
        build_loss_fn({"name": "zzz"})


def test_an_in_process_registration_is_found_and_built_with_kwargs(monkeypatch):
    seen = {}

    def factory(config, **kwargs):
        seen.update(config=config, kwargs=kwargs)
        return "mine"

    monkeypatch.setitem(LOSSES, SCRATCH, factory)
    assert get_loss(SCRATCH) is factory and SCRATCH in registered_names()
    assert build_loss_fn({"name": SCRATCH, "a": 1}, tp_group=None) == "mine"
    assert seen == {"config": {"a": 1}, "kwargs": {"tp_group": None}}
    monkeypatch.delitem(LOSSES, SCRATCH)
    assert SCRATCH not in registered_names()


def test_in_process_registration_shadows_an_entry_point(monkeypatch):
    monkeypatch.setitem(LOSSES, DEFAULT_LOSS_NAME, lambda config: ("local", config))
    assert build_loss_fn({"ratio_clip_min": 0.1}) == ("local", {"ratio_clip_min": 0.1})
    monkeypatch.delitem(LOSSES, DEFAULT_LOSS_NAME)
    assert get_loss(DEFAULT_LOSS_NAME) is ClippedPGLoss  # the entry point is back


def test_build_loss_fn_from_a_section_or_a_validated_config():
    loss = build_loss_fn({"name": "nemo_is.clipped_pg", "ratio_clip_min": 0.1, "token_level_loss": False})
    assert isinstance(loss, ClippedPGLoss)
    assert loss.config.ratio_clip_min == 0.1 and loss.config.effective_loss_aggregation == "seq-mean-token-mean"
    assert isinstance(build_loss_fn(None), ClippedPGLoss)  # no section: the default loss with defaults
    assert build_loss_fn({}).config.ratio_clip_min == 0.2
    config = ClippedPGLossConfig(ratio_clip_max=0.4)
    assert build_loss_fn(config).config is config


def test_split_name():
    assert split_name({"name": "x", "a": 1}) == ("x", {"a": 1})
    assert split_name(None) == (DEFAULT_LOSS_NAME, {})
    with pytest.raises(TypeError, match="must be a string"):
        split_name({"name": 3})


def test_broken_entry_point_names_the_entry_point(monkeypatch):
    broken = EntryPoint("tests.broken", "nemo_is_plugin.does_not_exist:Loss", registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "_entry_points", lambda reread=False: {"tests.broken": broken})
    assert "tests.broken" in registered_names()
    with pytest.raises(ImportError, match=r"entry point 'nemo_is_plugin.does_not_exist:Loss' .* failed to load"):
        get_loss("tests.broken")
