"""A stand-in ``nemo_rl`` tree whose ``nemo_rl.distributed.model_utils`` is the project's model of NeMo-RL's fused
log-prob head (``tests/adapters/nemo_rl_head_host.py``, torch only): what the host-head tests import as NeMo-RL, in
this process or in a worker interpreter that does not import the plugin by itself."""

from __future__ import annotations

import sys
from pathlib import Path

MODEL = Path(__file__).resolve().parents[1] / "adapters" / "nemo_rl_head_host.py"


def write_fake_nemo_rl(root: Path, model_utils: str | None = None) -> Path:
    """Write ``root/nemo_rl/{__init__,distributed/__init__,distributed/model_utils}.py`` (``model_utils``: the
    model's source, or the given text) and return ``root`` (the directory to put on the path)."""
    pkg = root / "nemo_rl" / "distributed"
    pkg.mkdir(parents=True, exist_ok=True)
    (root / "nemo_rl" / "__init__.py").write_text('"""Stand-in NeMo-RL (tests/helpers/fake_nemo_rl_head.py)."""\n')
    (pkg / "__init__.py").write_text("")
    (pkg / "model_utils.py").write_text(MODEL.read_text() if model_utils is None else model_utils)
    return root


def drop_nemo_rl_modules() -> None:
    for name in [m for m in sys.modules if m == "nemo_rl" or m.startswith("nemo_rl.")]:
        del sys.modules[name]


# A worker script's first log-prob pass through the fake tree's NeMo-RL head (``first``) and the original function's
# result on the same inputs (``want``); ``fn`` is the function the hook may have replaced. Dedented, for
# ``textwrap.dedent`` scripts that splice it in after their own start-up probes.
FIRST_LOGPROB_PASS = """
import nemo_rl.distributed.model_utils as mu
import torch
fn = mu.from_parallel_hidden_states_to_logprobs
g = torch.Generator().manual_seed(0)
hidden = torch.randn(6, 2, 8, generator=g, dtype=torch.float64)
weight = torch.randn(11, 8, generator=g, dtype=torch.float64)
labels = torch.randint(0, 11, (2, 6), generator=g)
first = mu._gpt_forward_with_linear_ce_fusion(hidden, weight, labels, None, chunk_size=4)  # the first log-prob pass
original = getattr(mu, "_nemo_is_original_from_parallel_hidden_states_to_logprobs", fn)
want = original(hidden, weight, None, labels, 0, 11, None, chunk_size=4)
"""
