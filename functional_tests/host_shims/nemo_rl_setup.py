"""What NeMo-RL's GRPO module needs to be imported and its ``setup`` run up to the loss, on this CPU machine.

Written against NVIDIA-NeMo/RL @7ea279abfbeb698b092856d0dab61e7cf39bc909. None of it touches the loss: module-level
imports of code ``setup`` does not reach before it builds the loss (audio and other datasets, Dynamo's HTTP client), the
dataloader class, and one typing alias on Python < 3.12.

- ``install()``: call once in a fresh process before importing ``nemo_rl.algorithms.grpo``. It stubs, as
  host_shims/nemo_rl.py's ``stub_unused_imports`` does (found, without package metadata: "not installed"), what is
  not installed here: soundfile and scipy (the audio datasets, nemo_rl/data/datasets/response_datasets/avqa.py:21-23,
  audiomcq.py:20-23), absl (its logging in response_datasets/helpsteer3.py:17 and preference_datasets/helpsteer3.py:16),
  aiohttp (Dynamo's HTTP client, nemo_rl/models/generation/dynamo/http_client.py:22), and torchdata, whose
  ``StatefulDataLoader`` (grpo.py:28, built by ``setup`` at grpo.py:593 for the prompts) is torch's ``DataLoader``
  plus checkpointable state ``setup`` does not use before the loss.
- Python 3.11: pydantic refuses ``typing.TypedDict`` fields before Python 3.12 and NeMo-RL's ``MasterConfig``
  (grpo.py:357) has them (``PolicyConfig``, ``DataConfig``, ...); ``typing_extensions.TypedDict`` is the same class
  for older Pythons, so ``typing.TypedDict`` is pointed at it before NeMo-RL is imported (NeMo-RL itself requires
  Python >= 3.12).
"""

from __future__ import annotations

import sys
import typing

import torch.utils.data
import typing_extensions

from host_shims.nemo_rl import _empty_module, _Unused, stub_unused_imports


class StatefulDataLoader(torch.utils.data.DataLoader):
    """torchdata's class as ``setup`` uses it before the loss: built, then ``len()``."""


def install() -> None:
    if sys.version_info < (3, 12):
        typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]
    # transformers decides what is installed from the real environment, before the stubs below exist
    import transformers  # noqa: F401
    from transformers import AutoProcessor, PreTrainedTokenizerBase  # noqa: F401

    # nemo_rl/experience/rollouts.py:32, metric_utils.py:21: W&B tables and histograms of rollouts
    sys.modules.setdefault("wandb", _empty_module("wandb", Table=_Unused, Histogram=_Unused))
    stub_unused_imports()
    for name in ("soundfile", "scipy", "aiohttp", "absl.logging"):
        sys.modules.setdefault(name, _empty_module(name))
    sys.modules.setdefault("scipy.signal", _empty_module("scipy.signal", resample_poly=_Unused))
    sys.modules.setdefault("absl", _empty_module("absl", logging=sys.modules["absl.logging"]))
    sys.modules.setdefault("torchdata", _empty_module("torchdata"))
    sys.modules.setdefault(
        "torchdata.stateful_dataloader",
        _empty_module("torchdata.stateful_dataloader", StatefulDataLoader=StatefulDataLoader),
    )
