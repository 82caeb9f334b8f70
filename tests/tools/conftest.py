"""The golden-suite generators live in ``tools/`` at the repository root, which is not an installed package: put the
root first on sys.path, so ``tools`` is that package whichever way pytest was started (``python -m pytest`` adds the
working directory, the ``pytest`` script does not)."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
