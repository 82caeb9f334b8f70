"""How much of the fused single pass the per-token loss gradient ``g = dL/dc`` costs: ``python -m
nemo_is_plugin.apps.bench.loss_gradient_timing [--device cpu|cuda] [--tokens N] [--hidden H] [--vocab V] [--chunk C]``.

Per config it times (best round on CPU, median on CUDA, as :class:`~nemo_is_plugin.apps.bench.device.BenchDevice`):

- ``fused``: one :func:`~nemo_is_plugin.distributed.entry_points.fused_linear_loss.fused_linear_pg_loss` forward +
  backward (the single pass when the config allows it: 3 ``[tokens x vocab]`` GEMMs, the two elementwise passes, g per
  chunk);
- ``build``: :meth:`TokenLossGradient.build` (the batch constants, once per call);
- ``grad``: g of every chunk, :class:`~nemo_is_plugin.loss.separable.TokenLossGradient` as the fused path calls it;
- ``func_vjp``: the same chunk terms differentiated by ``torch.func.vjp`` instead of ``torch.autograd.grad``.

``grad`` is whatever the checkout's TokenLossGradient does, so running this module against two checkouts compares
two implementations of g on the same problem. The GSPO config (sequence ratio) takes the two-pass schedule, where g
is the loss's own autograd on the ``[tokens]`` log-probs: it has no ``build`` / ``grad`` rows.
"""

from __future__ import annotations

import argparse
import json

import torch

from nemo_is_plugin import build_loss_fn
from nemo_is_plugin.apps.bench.device import BenchDevice
from nemo_is_plugin.apps.bench.problem import HeadProblem, make_problem
from nemo_is_plugin.distributed.entry_points.fused_linear_loss import fused_linear_pg_loss
from nemo_is_plugin.loss.separable import PrefixCarry, TokenLossGradient, single_pass_blocker

CONFIGS = {
    "token_tis_k3": dict(
        ratio_level="token",
        use_importance_sampling_correction=True,
        is_correction_level="token",
        truncated_importance_sampling_type="tis",
        truncated_importance_sampling_ratio=2.0,
        reference_policy_kl_penalty=0.01,
        reference_policy_kl_type="k3",
    ),
    "cumulative_ctpo_clip": dict(
        ratio_level="cumulative_mean",
        log_ratio_clip_low=0.01,
        log_ratio_clip_high=0.015,
        clip_position_power=0.5,
        use_importance_sampling_correction=True,
        is_correction_level="cumulative",
    ),
    "gspo_sequence": dict(ratio_level="sequence", loss_aggregation="seq-mean-token-mean", token_level_loss=False),
}


def time_config(bench: BenchDevice, p: HeadProblem, config: dict, chunk: int, rounds: int) -> dict[str, float]:
    """Seconds per call of each measured step (see the module docstring) for one config."""
    loss_fn = build_loss_fn(config)
    h, w = p.hidden.clone().requires_grad_(True), p.weight.clone().requires_grad_(True)

    def fused() -> None:
        h.grad = w.grad = None
        loss, _ = fused_linear_pg_loss(
            loss_fn, h, w, p.target, p.data, p.global_valid_seqs, p.global_valid_toks, chunk_size=chunk
        )
        loss.backward()

    out = {"fused": _best(bench, fused, rounds)}
    placeholder = p.data["prev_logprobs"][:, 1:].to(torch.float32)
    inputs, layout = loss_fn.prepare(placeholder, p.data, p.global_valid_seqs, p.global_valid_toks)
    if single_pass_blocker(loss_fn.config, layout) is not None:
        return out
    out["build"] = _best(bench, lambda: TokenLossGradient.build(loss_fn, inputs, layout), rounds)
    tg = TokenLossGradient.build(loss_fn, inputs, layout)
    c = placeholder.reshape(-1)
    slices = [slice(s, min(s + chunk, c.numel())) for s in range(0, c.numel(), chunk)]

    def each_chunk(step) -> torch.Tensor:
        if tg.prefix is not None:
            tg.prefix = PrefixCarry(loss_fn.config, layout)  # a fresh running sum per pass over the chunks
        return torch.cat([step(sl, c[sl]) for sl in slices])

    out["grad"] = _best(bench, lambda: each_chunk(tg), rounds)
    if hasattr(tg, "chunk_terms"):  # checkouts whose g is autograd over the loss's own per-token terms

        def func_vjp(sl: slice, c_chunk: torch.Tensor) -> torch.Tensor:
            pull = torch.func.vjp(lambda x: tg.chunk_terms(sl, x), c_chunk.to(tg.agg_weight.dtype))[1]
            return pull(tg.agg_weight[sl])[0]

        # the two compute the same g on the tokens that count (no NLL term in these configs)
        counted = tg.agg_weight != 0
        torch.testing.assert_close(each_chunk(func_vjp)[counted], each_chunk(tg)[counted], rtol=1e-6, atol=1e-9)
        out["func_vjp"] = _best(bench, lambda: each_chunk(func_vjp), rounds)
    return out


def _best(bench: BenchDevice, fn, rounds: int) -> float:
    fn()  # warm-up
    return bench.summarise([bench.time_call(fn) for _ in range(rounds)])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=2048, help="batch 4 x tokens/4 next-token positions")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--chunk", type=int, default=2048, help="tokens per chunk")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    bench = BenchDevice.resolve(args.device, "float32")
    p = make_problem(4, args.tokens // 4 + 1, args.hidden, args.vocab, device=bench.device, base_logprobs="model")
    result = dict(bench.describe(), threads=torch.get_num_threads(), **{k: v for k, v in vars(args).items()})
    for name, config in CONFIGS.items():
        result[name] = time_config(bench, p, config, args.chunk, args.rounds)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
