"""The emulated engine's top-k head (score centering's rollout_topk_*): float64 top-k of the very log-softmax it sampled
from, -inf padding past the vocabulary and after a sequence ended. No Megatron: a random state dict in its layout."""

import pytest
import torch

from nemo_is_plugin.apps.demo.decoder import KVCachedDecoder
from nemo_is_plugin.apps.demo.model import ModelShape

SHAPE = ModelShape(vocab_size=16, hidden=32, layers=1, heads=2, experts=2, topk=1, expert_ffn=32, max_seq_len=32)


def random_state(shape: ModelShape, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, v, f = shape.hidden, shape.vocab_size, shape.expert_ffn

    def w(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g) / size[-1] ** 0.5

    state = {
        "embedding.word_embeddings.weight": torch.randn(v, h, generator=g),
        "decoder.final_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "output_layer.weight": 3 * w(v, h),
    }
    pre = "decoder.layers.0."
    state.update(
        {
            pre + "input_layernorm.weight": torch.ones(h),
            pre + "self_attention.linear_qkv.weight": w(3 * h, h),
            pre + "self_attention.linear_proj.weight": w(h, h),
            pre + "pre_mlp_layernorm.weight": torch.ones(h),
            pre + "mlp.router.weight": w(shape.experts, h),
        }
    )
    for e in range(shape.experts):
        ep = f"{pre}mlp.experts.local_experts.{e}."
        state[ep + "linear_fc1.weight"] = w(2 * f, h)
        state[ep + "linear_fc2.weight"] = w(h, f)
    return state


def sample_with_logits(precision: str, k: int, temperature: float, ignore_eos: bool, eos_id: int = 3):
    """Sample with the head, recording the engine-precision logits of every decode step (what the head must be the
    top-k of)."""
    dec = KVCachedDecoder(SHAPE, random_state(SHAPE), precision)
    seen: list[torch.Tensor] = []
    step = dec._step

    def recording_step(tokens, start, cache):
        out = step(tokens, start, cache)
        seen.append(out[:, -1].clone())
        return out

    dec._step = recording_step  # type: ignore[method-assign]
    prompts = torch.randint(4, 14, (5, 4), generator=torch.Generator().manual_seed(1))
    toks, lps, mask, head = dec.sample(
        prompts,
        8,
        eos_id=eos_id,
        pad_id=0,
        ignore_eos=ignore_eos,
        generator=torch.Generator().manual_seed(2),
        temperature=temperature,
        top_k=k,
    )
    return toks, lps, mask, head, seen


@pytest.mark.parametrize(("precision", "k", "temperature"), [("fp8", 4, 1.0), ("int4", 16, 0.7), ("bf16", 20, 1.3)])
def test_head_is_the_float64_topk_of_the_sampled_log_softmax(precision, k, temperature):
    toks, lps, mask, head, seen = sample_with_logits(precision, k, temperature, ignore_eos=True)
    assert head is not None and head.ids.shape == (5, 8, k) and head.logprobs.dtype == torch.float32
    kk = min(k, SHAPE.vocab_size)
    for i, logits in enumerate(seen[:8]):
        ref = torch.log_softmax(logits.double() / temperature, dim=-1)
        top, idx = ref.topk(kk, dim=-1)
        torch.testing.assert_close(head.logprobs[:, i, :kk].double(), top, rtol=1e-6, atol=1e-6)
        # ids by rank: each id's reference log-prob is the slot's (ties would make ids ambiguous, values not)
        torch.testing.assert_close(ref.gather(-1, head.ids[:, i, :kk]), top, rtol=1e-6, atol=1e-6)
        # the sampled token's recorded log-prob is from the same distribution
        torch.testing.assert_close(lps[:, i].double(), ref.gather(-1, toks[:, i : i + 1])[:, 0], rtol=1e-6, atol=1e-6)
    assert torch.isneginf(head.logprobs[..., kk:]).all() and (head.ids[..., kk:] == 0).all()
    assert torch.isfinite(head.logprobs[..., :kk]).all()
    # head mass <= 1, the whole vocabulary's = 1
    mass = head.logprobs.double().exp().sum(-1)
    assert (mass <= 1 + 1e-6).all()
    if k >= SHAPE.vocab_size:
        torch.testing.assert_close(mass, torch.ones_like(mass), rtol=0, atol=1e-5)


def test_head_is_empty_after_a_sequence_ended_and_absent_without_k():
    # eos_id = the most likely first token of some row makes rows end early; pick it from an unrecorded run
    toks, _, mask, head, _ = sample_with_logits("fp8", 4, 1.0, ignore_eos=False, eos_id=5)
    assert head is not None
    ended = mask == 0
    assert ended.any(), "no row ended: pick another eos_id"
    assert torch.isneginf(head.logprobs[ended]).all() and (head.ids[ended] == 0).all()
    assert torch.isfinite(head.logprobs[~ended]).all()
    *_, none, _ = sample_with_logits("fp8", 0, 1.0, ignore_eos=True)
    assert none is None
    dec = KVCachedDecoder(SHAPE, random_state(SHAPE), "fp8")
    with pytest.raises(ValueError, match="top_k must be >= 0"):
        dec.sample(
            torch.ones(1, 2, dtype=torch.long),
            1,
            eos_id=3,
            pad_id=0,
            ignore_eos=True,
            generator=torch.Generator(),
            top_k=-1,
        )
