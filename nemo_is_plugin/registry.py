"""The documented import path of the loss registry; the registry itself is :mod:`nemo_is_plugin.loss.registry`."""

from nemo_is_plugin.loss.registry import (
    DEFAULT_LOSS_NAME,
    ENTRY_POINT_GROUP,
    LOSSES,
    NAME_KEY,
    UnknownLossError,
    build_loss_fn,
    check_loss_name,
    get_loss,
    registered_names,
    split_name,
)

__all__ = [
    "DEFAULT_LOSS_NAME",
    "ENTRY_POINT_GROUP",
    "LOSSES",
    "NAME_KEY",
    "UnknownLossError",
    "build_loss_fn",
    "check_loss_name",
    "get_loss",
    "registered_names",
    "split_name",
]
