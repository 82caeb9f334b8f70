"""Compare two copies of a golden suite within the suite's tolerance, without any host checkout.

    python -m tools.golden.compare --suite ctpo OLD_DIR NEW_DIR

For reviewing a change of the committed case files (binary, so ``git diff`` cannot show it): extract the previous
version (``git archive HEAD~1 tests/data/golden/ctpo | tar -x -C /tmp/old``) and compare it with the working tree.
Prints one line per case and the differences beyond tolerance; exits 1 when a case differs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from tools.golden import (
    common,
    ctpo,
    nemo_rl,
    nemo_rl_compat,
    slime,
    verl_loss_modes,
    verl_rollout_corr,
    verl_score_centering,
)

SUITES = {
    suite.name: suite
    for suite in (
        nemo_rl.SUITE,
        nemo_rl_compat.SUITE,
        ctpo.SUITE,
        verl_rollout_corr.SUITE,
        verl_loss_modes.SUITE,
        slime.SUITE,
        verl_score_centering.SUITE,
    )
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.golden.compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", required=True, choices=sorted(SUITES), help="whose tolerances apply")
    parser.add_argument("old", type=Path, help="the reference copy (e.g. the committed suite)")
    parser.add_argument("new", type=Path, help="the copy under review (e.g. a regenerated suite)")
    args = parser.parse_args(argv)
    return 1 if common.compare_suite(SUITES[args.suite], args.new, args.old) else 0


if __name__ == "__main__":
    sys.exit(main())
