"""A fake installed NeMo-RL for ``nemo-is compat``: NeMo-RL cannot be installed here, so the test writes a ``nemo_rl``
package on ``sys.path`` whose ``nemo_rl.algorithms.loss.loss_functions`` holds the project's own model of NeMo-RL's
loss: ``ClippedPGLossConfig`` is ``adapters.nemo_rl_host.HostLossConfig`` (NeMo-RL's pydantic model, extra keys
allowed) and ``ClippedPGLossFn`` calls ``test_nemo_rl_differential.nemo_rl_loss`` (an independent float re-derivation
of NeMo-RL's formulas at commit 7ea279ab), raising ``AssertionError`` where NeMo-RL refuses a config."""

from __future__ import annotations

import sys
import textwrap

import pytest

LOSS_FUNCTIONS = textwrap.dedent('''
    """Fake NeMo-RL (tests/apps/compat/conftest.py): the project's model of NeMo-RL's ClippedPGLossFn."""
    from adapters.nemo_rl_host import HostLossConfig as ClippedPGLossConfig
    from test_nemo_rl_differential import Rejected, nemo_rl_loss


    class ClippedPGLossFn:
        def __init__(self, cfg, use_fused_linear_logprobs=False):
            self.cfg = {k: getattr(cfg, k) for k in ClippedPGLossConfig.model_fields}

        def __call__(self, next_token_logprobs, data, global_valid_seqs, global_valid_toks):
            try:
                return nemo_rl_loss(self.cfg, next_token_logprobs, data, global_valid_seqs, global_valid_toks)
            except Rejected:
                raise AssertionError("NeMo-RL refuses this loss_fn config") from None
''')


def _drop_nemo_rl_modules() -> None:
    for name in [m for m in sys.modules if m == "nemo_rl" or m.startswith("nemo_rl.")]:
        del sys.modules[name]


@pytest.fixture
def fake_nemo_rl(tmp_path, monkeypatch):
    """The fake ``nemo_rl.algorithms.loss.loss_functions`` module, importable for the test's duration."""
    root = tmp_path / "site"
    pkg = root / "nemo_rl" / "algorithms" / "loss"
    pkg.mkdir(parents=True)
    for d in (root / "nemo_rl", root / "nemo_rl" / "algorithms", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "loss_functions.py").write_text(LOSS_FUNCTIONS)
    _drop_nemo_rl_modules()
    monkeypatch.syspath_prepend(str(root))
    import nemo_rl.algorithms.loss.loss_functions as module

    yield module
    _drop_nemo_rl_modules()
