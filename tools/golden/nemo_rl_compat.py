"""Regenerate the NeMo-RL compat golden suite (tests/data/golden/nemo_rl_compat) from a NeMo-RL checkout.

    python -m tools.golden.nemo_rl_compat --repo /path/to/NVIDIA-NeMo/RL --out /tmp/nemo_rl_compat [--check]

The same call of ``ClippedPGLossFn`` as tools/golden/nemo_rl.py (same commit, same stubs, same tolerances), on the
batches of this suite: some carry ``curr_logprobs_unfiltered``, handed to NeMo-RL inside ``data`` as a leaf that
requires grad, whose gradient is stored as ``expected["grad_curr_logprobs_unfiltered"]``.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

from tools.golden import common, nemo_rl

SUITE = dataclasses.replace(nemo_rl.SUITE, name="nemo_rl_compat")


def main(argv: Sequence[str] | None = None) -> int:
    return common.run(SUITE, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
