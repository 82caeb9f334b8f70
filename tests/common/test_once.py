"""The ground floor's once-per-process warning."""

import warnings

import pytest

from nemo_is_plugin.common import once


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(once, "_WARNED", set())


def test_warn_once_warns_once_per_key_with_its_category():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            once.warn_once("k", "first", RuntimeWarning)
        once.warn_once("other", "second")
    assert [(w.category, str(w.message)) for w in caught] == [(RuntimeWarning, "first"), (UserWarning, "second")]
