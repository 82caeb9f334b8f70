"""Numerical checks of the demo's two engines, each run in fresh processes (they initialise torch.distributed).

- :func:`decoder_parity`: the rollout decoder against Megatron (TP=1) on the same sampled tokens. In fp32 the two
  implementations agree to ~1e-6, so the bf16 / fp8 / int4 differences are the engines' numerics, not a bug.
- :func:`tp_parity`: Megatron MoE at TP=2 with sequence parallelism against TP=1: log-probs, gradient norm and the
  gathered weights.
"""

from __future__ import annotations

import multiprocessing as mp
import socket

import torch

from helpers import gloo  # noqa: F401  # the workers below init gloo (MegatronPolicy): see helpers/gloo.py


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _megatron_logprobs(policy, tokens: torch.Tensor) -> torch.Tensor:
    return policy.score(tokens)[:, 1:]


def _decoder_worker(precisions, port, queue) -> None:
    from nemo_is_plugin.apps.demo import task
    from nemo_is_plugin.apps.demo.decoder import KVCachedDecoder
    from nemo_is_plugin.apps.demo.model import ModelShape
    from nemo_is_plugin.apps.demo.policy import MegatronPolicy

    shape = ModelShape(max_seq_len=96)
    policy = MegatronPolicy(0, 1, shape, seed=3, lr=1e-3, max_grad_norm=1.0, micro_batch_tokens=4096, master_port=port)
    policy.warm_start(20, 16, 4, seed=0, lr=3e-3, tail=4)  # trained weights: sharper than the random init
    state = policy.full_state_dict()
    prompts = task.make_prompts(4, 4, torch.Generator().manual_seed(0))
    out = {}
    for precision in precisions:
        dec = KVCachedDecoder(shape, state, precision)
        toks, lps, _, _ = dec.sample(
            prompts, 48, eos_id=task.EOS, pad_id=task.PAD, ignore_eos=True, generator=torch.Generator().manual_seed(1)
        )
        ref = _megatron_logprobs(policy, torch.cat([prompts, toks], dim=1))[:, prompts.shape[1] - 1 :]
        out[precision] = float((ref - lps).abs().max())
    queue.put(out)


def decoder_parity(precisions=("fp32", "bf16")) -> dict[str, float]:
    """Max |Megatron fp32 log-prob - decoder log-prob| over 4 x 48 sampled tokens, per decoder precision."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_decoder_worker, args=(tuple(precisions), _free_port(), queue))
    proc.start()
    try:
        return queue.get(timeout=300)
    finally:
        proc.join(timeout=60)


def _tp_worker(rank, world, port, queue) -> None:
    from nemo_is_plugin.apps.demo.model import ModelShape, full_state_dict, grad_norm
    from nemo_is_plugin.apps.demo.policy import MegatronPolicy

    policy = MegatronPolicy(
        rank,
        world,
        ModelShape(max_seq_len=64),
        seed=3,
        lr=1e-3,
        max_grad_norm=0.0,
        micro_batch_tokens=4096,
        master_port=port,
    )
    tokens = torch.randint(0, 16, (3, 13), generator=torch.Generator().manual_seed(0))  # odd S: exercises padding
    policy.model.train()
    lp = policy.logprobs(tokens)
    (-(lp * torch.linspace(-1, 1, lp.shape[1])).mean()).backward()
    from nemo_is_plugin.apps.demo.model import allreduce_sequence_parallel_grads

    allreduce_sequence_parallel_grads(policy.model, policy.tp_group)
    norm = grad_norm(policy.model, policy.tp_group)
    state = full_state_dict(policy.model, policy.tp_group)
    if rank == 0:  # numpy crosses the process boundary without shared-memory file descriptors
        queue.put((lp.detach().numpy(), norm, {k: v.numpy() for k, v in state.items()}))


def tp_parity() -> dict[str, float]:
    """TP=2 (sequence parallel) vs TP=1: max |delta log-prob|, |delta grad norm|, max |delta weight|."""
    import numpy as np

    ctx = mp.get_context("spawn")
    results = {}
    for world in (1, 2):
        queue, port = ctx.Queue(), _free_port()
        procs = [ctx.Process(target=_tp_worker, args=(r, world, port, queue)) for r in range(world)]
        for p in procs:
            p.start()
        try:
            results[world] = queue.get(timeout=300)
        finally:
            for p in procs:
                p.join(timeout=60)
    (lp1, n1, s1), (lp2, n2, s2) = results[1], results[2]
    return {
        "logprob": float(np.abs(lp1 - lp2).max()),
        "grad_norm": abs(n1 - n2),
        "grad_norm_value": n1,
        "weights": max(float(np.abs(s1[k] - s2[k]).max()) for k in s1),
    }
