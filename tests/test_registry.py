"""Loss registry: entry points of the ``nemo_is_plugin.losses`` group plus in-process registrations."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest

from nemo_is_plugin.loss import ClippedPGLoss, registry
from nemo_is_plugin.loss.registry import (
    DEFAULT_LOSS_NAME,
    UnknownLossError,
    build_loss,
    get_loss,
    register_loss,
    registered_names,
    split_name,
    unregister_loss,
)


@pytest.fixture
def scratch_name():
    name = "tests.scratch_loss"
    yield name
    unregister_loss(name)


def test_pyproject_entry_point_resolves_the_clipped_pg_loss():
    assert DEFAULT_LOSS_NAME in registered_names()
    assert get_loss("nemo_is.clipped_pg") is ClippedPGLoss


def test_unknown_name_lists_registered_names_and_suggests():
    with pytest.raises(UnknownLossError) as info:
        get_loss("nemo_is.clipped_pq")
    msg = str(info.value)
    assert "'nemo_is.clipped_pq'" in msg and "Did you mean 'nemo_is.clipped_pg'?" in msg
    assert "Registered losses: " in msg and "'nemo_is.clipped_pg'" in msg
    assert info.value.known == registered_names()
    assert isinstance(info.value, LookupError)


def test_unknown_name_without_close_match_still_lists_names():
    with pytest.raises(UnknownLossError, match=r"unknown loss 'zzz'\. Registered losses: .*nemo_is\.clipped_pg"):
        build_loss({"name": "zzz"})


def test_register_decorator_and_direct(scratch_name):
    @register_loss(scratch_name)
    class Mine:
        def __init__(self, config):
            self.config = config

    assert get_loss(scratch_name) is Mine
    assert scratch_name in registered_names()
    register_loss(scratch_name, Mine)  # the same object again: a no-op
    with pytest.raises(ValueError, match="already registered"):
        register_loss(scratch_name, dict)
    register_loss(scratch_name, dict, override=True)
    assert get_loss(scratch_name) is dict
    unregister_loss(scratch_name)
    assert scratch_name not in registered_names()


def test_register_rejects_bad_targets(scratch_name):
    with pytest.raises(TypeError, match="callable or a 'module:attr'"):
        register_loss(scratch_name, 42)
    with pytest.raises(ValueError, match="non-empty string"):
        register_loss("", dict)


def test_lazy_string_target_is_imported_on_lookup(scratch_name):
    register_loss(scratch_name, "nemo_is_plugin.loss:ClippedPGLoss")
    assert get_loss(scratch_name) is ClippedPGLoss


def test_in_process_registration_shadows_an_entry_point():
    sentinel = lambda config: ("local", config)  # noqa: E731
    register_loss(DEFAULT_LOSS_NAME, sentinel, override=True)
    try:
        assert build_loss({"ratio_clip_min": 0.1}) == ("local", {"ratio_clip_min": 0.1})
    finally:
        unregister_loss(DEFAULT_LOSS_NAME)
    assert get_loss(DEFAULT_LOSS_NAME) is ClippedPGLoss  # the entry point is back


def test_build_loss_from_a_loss_fn_section():
    loss = build_loss({"name": "nemo_is.clipped_pg", "ratio_clip_min": 0.1, "token_level_loss": False})
    assert isinstance(loss, ClippedPGLoss)
    assert loss.config.ratio_clip_min == 0.1 and loss.config.effective_loss_aggregation == "seq-mean-token-mean"
    assert isinstance(build_loss(None), ClippedPGLoss)  # no section: the default loss with defaults
    assert build_loss({}).config.ratio_clip_min == 0.2


def test_build_loss_prefers_from_config_and_forwards_kwargs(scratch_name):
    seen = {}

    class WithFactory:
        @classmethod
        def from_config(cls, config, **kwargs):
            seen.update(config=config, kwargs=kwargs)
            return cls()

    register_loss(scratch_name, WithFactory)
    assert isinstance(build_loss({"name": scratch_name, "a": 1}, tp_group=None), WithFactory)
    assert seen == {"config": {"a": 1}, "kwargs": {"tp_group": None}}
    # the name argument wins over the section's
    assert isinstance(build_loss({"name": "nope"}, name=scratch_name), WithFactory)


def test_split_name():
    assert split_name({"name": "x", "a": 1}) == ("x", {"a": 1})
    assert split_name(None) == (DEFAULT_LOSS_NAME, {})
    with pytest.raises(TypeError, match="must be a string"):
        split_name({"name": 3})


def test_broken_entry_point_names_the_entry_point(monkeypatch):
    broken = EntryPoint("tests.broken", "nemo_is_plugin.does_not_exist:Loss", registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "_entry_points", lambda: {"tests.broken": broken})
    assert "tests.broken" in registered_names()
    with pytest.raises(ImportError, match=r"entry point 'nemo_is_plugin.does_not_exist:Loss' .* failed to load"):
        get_loss("tests.broken")
