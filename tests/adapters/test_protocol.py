"""The protocol module uses NeMo-RL's own enums when NeMo-RL is importable (Enum classes never compare across
definitions), and look-alikes with NeMo-RL's members and values otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from nemo_is_plugin.adapters.nemo_rl import protocol

STUB = """
import enum
class LossType(enum.Enum):
    TOKEN_LEVEL = "token_level"
    SEQUENCE_LEVEL = "sequence_level"
class MetricNormalizer(enum.Enum):
    TOKENS = "tokens"
    SEQUENCES = "sequences"
    NONE = "none"
class LossInputType(enum.Enum):
    LOGIT = "logit"
    LOGPROB = "logprob"
    DISTILLATION = "distillation"
"""


def test_fallback_enums_mirror_nemo_rl_values():
    assert not protocol.USING_HOST_ENUMS  # NeMo-RL is not installed in CI
    assert {m.name: m.value for m in protocol.LossType} == {
        "TOKEN_LEVEL": "token_level",
        "SEQUENCE_LEVEL": "sequence_level",
    }
    assert {m.value for m in protocol.MetricNormalizer} == {"tokens", "sequences", "none"}
    assert protocol.LossInputType("logprob") is protocol.LossInputType.LOGPROB


def test_host_enums_are_used_when_nemo_rl_is_importable(tmp_path: Path):
    pkg = tmp_path / "nemo_rl" / "algorithms" / "loss"
    pkg.mkdir(parents=True)
    for d in (tmp_path / "nemo_rl", tmp_path / "nemo_rl" / "algorithms", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "interfaces.py").write_text(STUB)
    script = textwrap.dedent("""
        from nemo_rl.algorithms.loss import interfaces as host
        from nemo_is_plugin.adapters.nemo_rl import protocol
        from nemo_is_plugin.adapters.nemo_rl import NeMoRLLossFn
        assert protocol.USING_HOST_ENUMS
        fn = NeMoRLLossFn({"token_level_loss": False})
        assert fn.input_type is host.LossInputType.LOGPROB
        assert fn.loss_type is host.LossType.SEQUENCE_LEVEL
        assert all(isinstance(v, host.MetricNormalizer) for v in fn.metric_normalizations.values())
        assert fn.metric_normalizations["loss"] is host.MetricNormalizer.SEQUENCES
        print("ok")
    """)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
