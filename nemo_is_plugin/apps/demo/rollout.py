"""Rollout backends: the engine that samples responses and reports their generation log-probs.

``cpu`` (default): :class:`~nemo_is_plugin.apps.demo.decoder.KVCachedDecoder` in the configured precision, embedded in
the rollout worker. ``vllm``: :mod:`nemo_is_plugin.apps.demo.vllm_backend`, only when vLLM is installed and a GPU is
present (:mod:`nemo_is_plugin.apps.demo.backends` picks one). Either way the log-probs returned here are the
``generation_logprobs`` the loss consumes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from nemo_is_plugin.apps.demo.decoder import KVCachedDecoder
from nemo_is_plugin.apps.demo.model import ModelShape
from nemo_is_plugin.apps.demo.task import EOS, PAD


@dataclass
class RolloutOutput:
    """``tokens [B, R]`` (PAD after the end), ``logprobs [B, R]`` fp32 (0 on padding), ``mask [B, R]`` 0/1 long;
    with a head size k the sampler's top-k head per token, ``topk_ids`` / ``topk_logprobs [B, R, k]`` (-inf: empty
    slot; see :class:`~nemo_is_plugin.apps.demo.decoder.SamplerHead`)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    mask: torch.Tensor
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None


class RolloutBackend(Protocol):
    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Receive the policy's full (unsharded) Megatron weights: the weight sync after every update."""

    def generate(self, prompts: torch.Tensor, max_new_tokens: int, *, ignore_eos: bool, seed: int) -> RolloutOutput:
        """Sample one response per prompt row ([B, P], all rows the same length)."""


class CPUBackend:
    """The embedded sampler: a KV-cached decoder whose numerics differ from Megatron's (see ``decoder``)."""

    def __init__(self, shape: ModelShape, precision: str, temperature: float = 1.0, top_k: int = 0) -> None:
        self.shape, self.precision, self.temperature, self.top_k = shape, precision, temperature, top_k
        self._decoder: KVCachedDecoder | None = None

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        self._decoder = KVCachedDecoder(self.shape, state, self.precision)

    def generate(self, prompts: torch.Tensor, max_new_tokens: int, *, ignore_eos: bool, seed: int) -> RolloutOutput:
        if self._decoder is None:
            raise RuntimeError("load_weights() before generate()")
        tokens, logprobs, mask, head = self._decoder.sample(
            prompts,
            max_new_tokens,
            eos_id=EOS,
            pad_id=PAD,
            ignore_eos=ignore_eos,
            generator=torch.Generator().manual_seed(seed),
            temperature=self.temperature,
            top_k=self.top_k,
        )
        if head is None:
            return RolloutOutput(tokens, logprobs, mask)
        return RolloutOutput(tokens, logprobs, mask, head.ids, head.logprobs)
