"""megatron-core's context and expert parallelism on CPU gloo ranks (2, spawned once; the stacks tier).

The CPU core attention that takes context parallelism (``host_shims/megatron_cp_attention.py``) at CP 2 equals the
single-rank attention: fp32 and float64, grouped-query heads (4 query, 2 key / value). Each rank computes the
single-rank reference on the whole batch, then its CP shard, and compares its shard's output and the gradients of its
query, key and value (the key / value gradients reduce-scattered from both ranks' queries) with the reference's at its
tokens, for a random output gradient:

- unpacked ``[s, b, ...]``: reference megatron-core's local ``DotProductAttention`` (causal); the shard cut by
  megatron-core's own ``get_batch_on_this_cp_rank``; once with no mask, once with a causal mask that also masks out
  each row's padding keys (the mask's query rows cut by that function as well);
- packed THD as NeMo-RL packs at CP 2 (each sequence padded to a multiple of 2 * cp, ``cu_seqlens_q`` = the padded
  boundaries, ``nemo_rl/models/megatron/data.py`` lines 1012-1141): reference the single-rank packed attention
  ``megatron_cpu.PackedCausalAttention``; the shard cut per sequence by NeMo-RL's ``_get_tokens_on_this_cp_rank``,
  as that packing does (data.py lines 1088-1091).

Megatron-Bridge's ``get_packed_seq_cp_partition_indices`` (the other THD cut NeMo-RL names, data.py line 445, for
models that cut their own CP inputs) cannot run here: at CP > 1 megatron-core 0.19.2 computes it with Transformer
Engine's ``thd_get_partitioned_indices`` (``megatron/core/utils.py`` line 2441).

Expert parallelism 2 with the allgather token dispatcher: a tiny MoE GPT's loss and gradients at EP 2 equal EP 1's
(``check_expert_parallel``); NeMo-RL's Megatron step runs that layout too (test_nemo_rl_megatron_step.py).

Runs on the stacks tier (Python 3.13, megatron-core 0.19.2, the version NeMo-RL's Megatron step test runs; 0.17
changed ``get_batch_on_this_cp_rank``'s signature, so the main tier's 0.16.1 skips it).
"""

from __future__ import annotations

import pytest

megatron_core = pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from host_shims import nemo_rl as nemo_rl_shims  # noqa: E402
from packaging.version import Version  # noqa: E402

if Version(megatron_core.__version__) < Version("0.19"):
    pytest.skip(
        f"megatron-core {megatron_core.__version__}: the CP / EP test runs on the stacks tier (0.19.2)",
        allow_module_level=True,
    )
if nemo_rl_shims.nemo_rl_path() is None:
    pytest.skip(nemo_rl_shims.SKIP_REASON, allow_module_level=True)

import torch  # noqa: E402
from distributed._spawn import run_checks  # noqa: E402

WORLD = 2
HEADS, GROUPS, HEAD_DIM = 4, 2, 8
B, S = 2, 16  # unpacked: S a multiple of 2 * cp
REAL_LENGTHS = [5, 11, 8]  # packed: padded to 8, 12, 8
TOLERANCE = {torch.float32: dict(rtol=2e-5, atol=2e-6), torch.float64: dict(rtol=1e-12, atol=1e-13)}


def setup_workers(rank: int, world_size: int) -> None:
    import sys

    from megatron.core import parallel_state

    from nemo_is_plugin.apps.demo.model import apply_cpu_patches

    apply_cpu_patches()
    parallel_state.initialize_model_parallel(context_parallel_size=world_size)
    sys.path.insert(0, nemo_rl_shims.nemo_rl_path())


def _nemo_rl_cut(x: torch.Tensor, rank: int, world: int, seq_dim: int = 0) -> torch.Tensor:
    """NeMo-RL's cut of one sequence (``nemo_rl/distributed/model_utils.py`` lines 1199-1230)."""
    from nemo_rl.distributed.model_utils import _get_tokens_on_this_cp_rank

    return _get_tokens_on_this_cp_rank(x, rank, world, seq_dim=seq_dim)


def _config(cp: int):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        context_parallel_size=cp,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        masked_softmax_fusion=False,
        use_cpu_initialization=True,
    )


def _attention(cls, cp: int):
    from megatron.core.transformer.enums import AttnMaskType

    return cls(config=_config(cp), layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")


def _cp_attention():
    from host_shims.megatron_cp_attention import cp_core_attention_cls

    return _attention(cp_core_attention_cls(), WORLD)


def _inputs(tokens_shape: tuple[int, ...], dtype: torch.dtype, seed: int):
    """query, key, value ``[*tokens_shape, heads, head_dim]`` and the output gradient ``[*tokens_shape, hidden]``."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(*tokens_shape, n, HEAD_DIM, generator=g, dtype=torch.float64).to(dtype)
        for n in (HEADS, GROUPS, GROUPS)
    )
    return q, k, v, torch.randn(*tokens_shape, HEADS * HEAD_DIM, generator=g, dtype=torch.float64).to(dtype)


def _run(module, q, k, v, grad_out, **kwargs):
    """Output and the (q, k, v) gradients of ``module`` for the output gradient ``grad_out``."""
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out = module(q, k, v, **kwargs)
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


def _assert_shard(got, want, to_shard, dtype, what: str) -> None:
    for name, g, w in zip(("output", "query grad", "key grad", "value grad"), got, want, strict=True):
        torch.testing.assert_close(g, to_shard(w), **TOLERANCE[dtype], msg=lambda m, n=name: f"{what} {n}: {m}")


def _causal_mask(padding: bool) -> torch.Tensor:
    """[B, 1, S, S], True = masked: causal; with ``padding``, also each row's keys past its length (rows of 11 and 16
    tokens)."""
    causal = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)
    lengths = torch.tensor([11 if padding else S, S])
    past_length = torch.arange(S)[None, :] >= lengths[:, None]
    return (causal[None] | past_length[:, None, :])[:, None]


def _megatron_cut(batch: dict) -> dict:
    """megatron-core's ``get_batch_on_this_cp_rank`` (``[b, s, ...]`` tensors; ``attention_mask`` cut on dim 2)."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=parallel_state.get_context_parallel_group())


def check_unpacked(rank: int, world: int) -> None:
    """The CP attention without a mask (causal by global position, as Transformer Engine's under GPTModel) and with
    the padding mask; the reference is given the mask explicitly (without one megatron-core 0.19.2 builds its causal
    mask on "cuda", transformer/utils.py line 39)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    reference, cp_attention = _attention(DotProductAttention, 1), _cp_attention()
    for dtype in (torch.float32, torch.float64):
        for padding in (False, True):
            q, k, v, grad = _inputs((S, B), dtype, seed=1)
            mask = _causal_mask(padding)
            want = _run(reference, q, k, v, grad, attention_mask=mask)

            def to_shard(x):  # [s, b, ...] -> this rank's [s / cp, b, ...], cut by megatron-core ([b, s, ...])
                return _megatron_cut({"x": x.transpose(0, 1)})["x"].transpose(0, 1)

            local_mask = _megatron_cut({"attention_mask": mask})["attention_mask"] if padding else None
            got = _run(cp_attention, *(to_shard(x) for x in (q, k, v, grad)), attention_mask=local_mask)
            _assert_shard(got, want, to_shard, dtype, f"unpacked {dtype} padding mask={padding}")


def _packed_params(cu_padded: torch.Tensor):
    """PackedSeqParams as NeMo-RL's ``_pack_sequences_for_megatron`` builds them at CP > 1 (data.py lines 1130-1139)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    longest = int((cu_padded[1:] - cu_padded[:-1]).max())
    return PackedSeqParams(
        cu_seqlens_q=cu_padded,
        cu_seqlens_kv=cu_padded,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        qkv_format="thd",
        total_tokens=int(cu_padded[-1]),
    )


def _nemo_rl_packed_cut(x: torch.Tensor, cu_padded: list[int], rank: int, world: int) -> torch.Tensor:
    """Each packed sequence cut on its own and the pieces concatenated, as NeMo-RL's packing cuts at CP > 1."""
    pieces = [x[a:b] for a, b in zip(cu_padded[:-1], cu_padded[1:], strict=True)]
    return torch.cat([_nemo_rl_cut(piece, rank, world) for piece in pieces])


def _cu_padded(world: int) -> list[int]:
    """NeMo-RL's padded boundaries of REAL_LENGTHS at CP ``world`` (each to a multiple of 2 * cp)."""
    multiple, cu = 2 * world, [0]
    for n in REAL_LENGTHS:
        cu.append(cu[-1] + -(-n // multiple) * multiple)
    return cu


def check_packed(rank: int, world: int) -> None:
    from host_shims.megatron_cpu import packed_causal_attention_cls

    cu = _cu_padded(world)
    params = _packed_params(torch.tensor(cu, dtype=torch.int32))
    reference, cp_attention = _attention(packed_causal_attention_cls(), 1), _cp_attention()
    for dtype in (torch.float32, torch.float64):
        q, k, v, grad = _inputs((cu[-1],), dtype, seed=2)
        want = _run(reference, q, k, v, grad, attention_mask=None, packed_seq_params=params)

        def to_shard(x):
            return _nemo_rl_packed_cut(x, cu, rank, world)

        got = _run(cp_attention, *(to_shard(x) for x in (q, k, v, grad)), attention_mask=None, packed_seq_params=params)
        _assert_shard(got, want, to_shard, dtype, f"packed {dtype}")


def check_layout_is_the_hosts(rank: int, world: int) -> None:
    """The positions the attention assumes for this rank's tokens are the ones megatron-core's and NeMo-RL's cuts
    give it."""
    from host_shims.megatron_cp_attention import load_balanced_positions

    _, positions = load_balanced_positions(torch.tensor([0, S]), rank, world, S // world)
    assert positions.tolist() == _megatron_cut({"p": torch.arange(S)[None]})["p"][0].tolist()
    assert positions.tolist() == _nemo_rl_cut(torch.arange(S), rank, world).tolist()
    cu = _cu_padded(world)
    seq, positions = load_balanced_positions(torch.tensor(cu), rank, world, cu[-1] // world)
    assert (torch.tensor(cu)[seq] + positions).tolist() == _nemo_rl_packed_cut(
        torch.arange(cu[-1]), cu, rank, world
    ).tolist()


VOCAB, EXPERTS, SEQ = 16, 4, 12


def _moe_gpt(ep: int):
    """A tiny MoE GPT (2 layers, 4 SwiGLU experts top-2, the allgather token dispatcher, megatron-core's local spec
    with an RMSNorm), its experts split over expert parallelism ``ep``; seeded, so every EP 1 build is the same."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from nemo_is_plugin.apps.demo.model import SPRMSNorm

    config = TransformerConfig(
        num_layers=2,
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        ffn_hidden_size=64,
        num_moe_experts=EXPERTS,
        moe_router_topk=2,
        moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none",
        moe_router_dtype="fp32",
        expert_model_parallel_size=ep,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        init_method_std=0.05,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
    )
    layer = get_gpt_layer_local_spec(num_experts=EXPERTS, normalization="RMSNorm")
    layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = SPRMSNorm
    torch.manual_seed(0)
    return GPTModel(
        config=config,
        transformer_layer_spec=TransformerBlockSubmodules(layer_specs=[layer] * 2, layer_norm=SPRMSNorm),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )


def _mean_logprob(model, rank: int) -> torch.Tensor:
    """The mean log-probability of this rank's own random tokens (its DP shard)."""
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(100 + rank))
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    logits = model(ids, torch.arange(SEQ)[None].expand(2, SEQ), causal)
    return logits.log_softmax(-1).gather(-1, ids[..., None]).mean()


def _global_expert(name: str, ep_rank: int, local_experts: int) -> str:
    """The EP 1 name of an EP-split parameter (local expert j of EP rank r is expert r * local_experts + j)."""
    if ".local_experts." not in name:
        return name
    head, tail = name.split(".local_experts.")
    local, rest = tail.split(".", 1)
    return f"{head}.local_experts.{ep_rank * local_experts + int(local)}.{rest}"


def check_expert_parallel(rank: int, world: int) -> None:
    """megatron-core runs EP 2 on gloo with the allgather dispatcher: each rank's loss on its own tokens equals EP 1's
    (the weights copied expert by expert), and the gradients equal EP 1's summed over the ranks (a dense parameter's
    all-reduced; an expert's already holds every rank's tokens, which the dispatcher gathered), each to 1e-6 of the
    tensor's largest entry (fp32)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    try:
        parallel_state.initialize_model_parallel()  # EP 1, DP 2: the whole model on each rank
        whole = _moe_gpt(1)
        want_loss = _mean_logprob(whole, rank)
        want_loss.backward()
        want = {n: p.grad.clone() for n, p in whole.named_parameters()}
        for grad in want.values():
            dist.all_reduce(grad)
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
        split = _moe_gpt(world)
        ep_rank, local = parallel_state.get_expert_model_parallel_rank(), EXPERTS // world
        weights = whole.state_dict()
        names = [n for n in split.state_dict() if "_extra_state" not in n]
        split.load_state_dict({n: weights[_global_expert(n, ep_rank, local)] for n in names}, strict=False)
        loss = _mean_logprob(split, rank)
        loss.backward()
        errors = {}
        for name, param in split.named_parameters():
            grad = param.grad.clone()
            if ".local_experts." not in name:
                dist.all_reduce(grad)
            reference = want[_global_expert(name, ep_rank, local)]
            errors[name] = float((grad - reference).abs().max() / reference.abs().max())
    finally:
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(context_parallel_size=world)  # the other checks' layout
    assert sum(".local_experts." in n for n in errors) == 2 * local * 2  # 2 layers x local experts x (fc1, fc2)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    assert max(errors.values()) < 1e-6, {n: e for n, e in errors.items() if e >= 1e-6}


CHECKS = [
    ("layout", check_layout_is_the_hosts),
    ("unpacked", check_unpacked),
    ("packed", check_packed),
    ("expert_parallel", check_expert_parallel),
]


@pytest.fixture(scope="module")
def results() -> dict[str, str | None]:
    return run_checks(__name__, WORLD)


@pytest.mark.parametrize("name", [name for name, _ in CHECKS])
def test_cp_attention_and_expert_parallel(results, name):
    assert results[name] is None, results[name]


def test_boundaries_the_load_balanced_cut_cannot_make_are_refused():
    from host_shims.megatron_cp_attention import check_cp_boundaries

    check_cp_boundaries(torch.tensor([0, 8, 20]), 2, 10)  # sequences of 8 and 12 at CP 2: 10 tokens per rank
    for cu, tokens in (([0, 6, 20], 10), ([0, 8, 20], 12), ([4, 8, 20], 8)):
        with pytest.raises(ValueError, match="multiples of 2 \\* cp_size = 4"):
            check_cp_boundaries(torch.tensor(cu), 2, tokens)
