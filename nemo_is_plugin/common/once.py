"""Once-per-process warnings: the loss and the log-prob kernels run once per micro-batch or chunk loop, so a warning
about their inputs or their backend would otherwise repeat thousands of times."""

from __future__ import annotations

import warnings

_WARNED: set[str] = set()


def warn_once(key: str, message: str, category: type[Warning] = UserWarning) -> None:
    """Warn the first time ``key`` comes up in this process: the package's one once-per-process warning (the loss
    and the log-prob kernels run once per micro-batch or chunk loop)."""
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, category, stacklevel=3)


__all__ = ["warn_once"]
