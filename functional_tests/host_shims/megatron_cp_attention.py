"""A CPU core attention that takes context parallelism, for megatron-core's local layer spec.

Why it exists: megatron-core's local ``DotProductAttention`` refuses context parallelism in its constructor
(``transformer/dot_product_attention.py`` lines 57-59, tag core_v0.19.2 of NVIDIA/Megatron-LM: "Context parallelism is
only supported by TEDotProductAttention!") and packed sequences in its forward (line 153); Transformer Engine's
attention, the only one that takes CP, has no CPU path. NeMo-RL's Megatron step at CP > 1
(``nemo_rl/models/megatron/setup.py`` line 881 makes sequence packing mandatory there) needs a core attention that does.

What it computes: causal attention of this CP rank's queries over the keys and values of the whole sequence, the
result Transformer Engine's CP attention gives. The keys and values are all-gathered over the CP group with
megatron-core's ``gather_from_sequence_parallel_region`` (forward all-gather, backward reduce-scatter: each rank's
K / V gradient is the sum of every rank's queries' contributions), and the causal mask is applied by global position.
The positions follow the load-balanced order both of megatron-core's CP layouts use: a sequence of length ``L`` (a
multiple of ``2 * cp``) is cut into ``2 * cp`` chunks and CP rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``,
in that order:

- unpacked ``[s, b, ...]`` (sbhd): the whole sequence dimension is one sequence, as megatron-core's
  ``get_batch_on_this_cp_rank`` (``megatron/core/utils.py``) and NeMo-RL's ``_get_tokens_on_this_cp_rank``
  (``nemo_rl/distributed/model_utils.py`` lines 1199-1230) cut it;
- packed THD (``packed_seq_params.qkv_format == "thd"``): every packed sequence is cut on its own, the sequences'
  local pieces concatenated in order (NeMo-RL's ``_pack_sequences_for_megatron``, ``nemo_rl/models/megatron/data.py``
  lines 1088-1091; Megatron-Bridge's ``get_packed_seq_cp_partition_indices``, ``megatron/bridge/training/utils/
  packed_seq_utils.py``, at the commit NeMo-RL @7ea279ab pins). The boundaries are the whole stream's
  ``cu_seqlens_q_padded`` (else ``cu_seqlens_q``), each rank holding ``1 / cp`` of every sequence, as in
  Transformer Engine's THD CP attention. Padding tokens inside a padded sequence are attended like any token (the
  causal mask keeps them out of the real tokens' outputs).

An ``attention_mask`` (megatron-core's convention: True masks a key out) is applied on top of the causal mask, its key
dimension in global order (unpacked only): ``[b or 1, 1, s_local, s_global]``, the query dimension cut as
``get_batch_on_this_cp_rank`` cuts it, or the whole ``[.., s_global, s_global]`` mask.
"""

from __future__ import annotations

import torch


def load_balanced_positions(
    cu_seqlens: torch.Tensor, cp_rank: int, cp_size: int, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence index, position in its sequence) of the ``num_tokens`` tokens CP rank ``cp_rank`` holds, for the
    whole stream's sequence boundaries ``cu_seqlens`` (each length a multiple of ``2 * cp_size``): per sequence the
    chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank`` of ``2 * cp_size``, sequences in order."""
    local_cu = cu_seqlens // cp_size
    token = torch.arange(num_tokens, device=cu_seqlens.device)
    seq = torch.searchsorted(local_cu, token, right=True) - 1
    offset = token - local_cu[seq]
    chunk = (cu_seqlens[1:] - cu_seqlens[:-1])[seq] // (2 * cp_size)
    second = offset >= chunk  # the chunk mirrored from the end of the sequence
    position = torch.where(second, (2 * cp_size - 2 - cp_rank) * chunk + offset, cp_rank * chunk + offset)
    return seq, position


def check_cp_boundaries(cu_seqlens: torch.Tensor, cp_size: int, num_tokens: int) -> None:
    """Refuse boundaries the load-balanced cut cannot have made (ValueError naming the padding that fixes them)."""
    bounds = cu_seqlens.tolist()  # one host read per forward: the layout has to be valid before it is used
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    if bounds[0] != 0 or bounds[-1] != cp_size * num_tokens or any(n % (2 * cp_size) for n in lengths):
        raise ValueError(
            f"context-parallel attention: sequence boundaries {bounds} must start at 0, end at cp_size * local tokens "
            f"({cp_size} * {num_tokens}) and cut lengths that are multiples of 2 * cp_size = {2 * cp_size} (pad each "
            "sequence as NeMo-RL's make_sequence_length_divisible_by does)"
        )


def cp_core_attention_cls():
    """The core-attention class (built on first use: megatron-core is imported then)."""
    from megatron.core import tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.utils import is_layer_window_attention

    causal_types = (AttnMaskType.causal, AttnMaskType.padding_causal)

    class ContextParallelAttention(MegatronModule):
        """megatron-core's core-attention interface (``DotProductAttention``'s constructor and forward), causal, with
        context parallelism over ``pg_collection.cp`` in the load-balanced order (module docstring)."""

        def __init__(
            self,
            config,
            layer_number: int,
            attn_mask_type,
            attention_type: str,
            attention_dropout: float | None = None,
            softmax_scale: float | None = None,
            cp_comm_type: str | None = None,
            pg_collection=None,
        ) -> None:
            super().__init__(config=config)
            if attn_mask_type not in causal_types:
                raise ValueError(f"ContextParallelAttention is causal only; attn_mask_type={attn_mask_type}")
            if config.softmax_type != "vanilla" or config.apply_query_key_layer_scaling:
                raise ValueError(
                    "ContextParallelAttention computes the vanilla softmax: set softmax_type='vanilla' and "
                    "apply_query_key_layer_scaling=False"
                )
            if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
                raise ValueError("ContextParallelAttention has no sliding window: set window_size=None")
            if pg_collection is None or not hasattr(pg_collection, "cp"):
                pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
            self.cp_group = pg_collection.cp
            self.layer_number = max(1, layer_number)
            self.attn_mask_type = attn_mask_type
            head_dim = config.kv_channels
            self.softmax_scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
            p = config.attention_dropout if attention_dropout is None else attention_dropout
            self.attention_dropout = torch.nn.Dropout(p)

        def forward(
            self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
        ):
            if attention_bias is not None:
                raise ValueError("ContextParallelAttention takes no attention_bias")
            if attn_mask_type is not None and attn_mask_type not in causal_types:
                raise ValueError(f"ContextParallelAttention is causal only; attn_mask_type={attn_mask_type}")
            cp_size, cp_rank = self.cp_group.size(), self.cp_group.rank()
            packed = packed_seq_params is not None
            if packed:
                if packed_seq_params.qkv_format != "thd":
                    raise ValueError(f"packed sequences are THD here; qkv_format={packed_seq_params.qkv_format}")
                if attention_mask is not None:
                    raise ValueError("packed sequences take no attention_mask (their boundaries are the mask)")
                cu = packed_seq_params.cu_seqlens_q_padded
                if cu is None:
                    cu = packed_seq_params.cu_seqlens_q
                # [t, n, h] (Attention.forward squeezes THD's dummy batch): the batch dimension back, as in sbhd
                query, key, value = (x.unsqueeze(1) for x in (query, key, value))
            else:
                cu = torch.tensor([0, cp_size * query.shape[0]], device=query.device)
            local_tokens = query.shape[0]
            check_cp_boundaries(cu, cp_size, local_tokens)
            seq_q, pos_q = load_balanced_positions(cu, cp_rank, cp_size, local_tokens)
            keys = [load_balanced_positions(cu, r, cp_size, local_tokens) for r in range(cp_size)]
            seq_k, pos_k = (torch.cat(parts) for parts in zip(*keys, strict=True))  # gathered order: rank by rank
            if cp_size > 1:
                key = gather_from_sequence_parallel_region(key, tensor_parallel_output_grad=True, group=self.cp_group)
                value = gather_from_sequence_parallel_region(
                    value, tensor_parallel_output_grad=True, group=self.cp_group
                )
            groups = query.shape[2] // key.shape[2]
            if groups > 1:  # grouped-query attention: each key / value head serves `groups` query heads
                key = key.repeat_interleave(groups, dim=2)
                value = value.repeat_interleave(groups, dim=2)
            allowed = (seq_q[:, None] == seq_k[None, :]) & (pos_k[None, :] <= pos_q[:, None])  # [sq, sk]
            if attention_mask is not None:
                mask = attention_mask[..., pos_k]  # keys in global order -> the gathered order
                if mask.shape[-2] != local_tokens:  # the whole sequence's query rows: this rank's
                    mask = mask[..., pos_q, :]
                allowed = allowed & ~mask  # [b or 1, 1, sq, sk]
            scores = torch.einsum("sbnh,kbnh->bnsk", query, key) * self.softmax_scale
            # the dtype's lowest value, not -inf: a row with every key masked out (only an attention_mask can do that)
            # softmaxes to uniform weights, as megatron-core's -10000 fill (transformer/utils.py, attention_mask_func)
            scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
            low_precision = scores.dtype in (torch.float16, torch.bfloat16)
            probs = torch.softmax(scores.float() if low_precision else scores, dim=-1).to(query.dtype)
            if self.config.sequence_parallel:
                probs = self.attention_dropout(probs)
            else:
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    probs = self.attention_dropout(probs)
            context = torch.einsum("bnsk,kbnh->sbnh", probs, value)  # [sq, b, np, hn]
            context = context.reshape(local_tokens, query.shape[1], -1)
            return context.squeeze(1) if packed else context

    return ContextParallelAttention
