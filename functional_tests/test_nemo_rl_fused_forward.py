"""NeMo-RL's fused log-prob path on a real megatron-core GPTModel, and the plugin's head inside it.

``return_logprobs_for_linear_ce_fusion`` is no argument of any megatron-core ``GPTModel.forward``: NeMo-RL's Megatron
set-up (nemo_rl/models/megatron/setup.py:1862-1865 @7ea279ab, with ``use_fused_linear_logprobs``) calls
``patch_gpt_model_forward_for_linear_ce_fusion`` (nemo_rl/distributed/model_utils.py:2319), which replaces
``GPTModel.forward`` by NeMo-RL's ``_gpt_forward_with_linear_ce_fusion``; that forward takes the argument and runs
megatron-core's ``_preprocess``, ``decoder`` and output weight itself, then NeMo-RL's
``from_parallel_hidden_states_to_logprobs`` -- the function the plugin's head switch replaces. Here, in a fresh
interpreter at world size 1 (gloo, CPU; the tiny MoE GPT of the demo, megatron-core's local layer spec), with NeMo-RL's
own ``model_utils`` from the pinned source:

- NeMo-RL's patched forward, called as NeMo-RL's train step calls it (nemo_rl/models/megatron/train.py:177-180:
  ``labels=input_ids``, ``return_logprobs_for_linear_ce_fusion=True``), returns the next-token log-probs of the
  model's own logits (float64 log-softmax of the unpatched forward's logits, 1e-5);
- after the plugin's patch (what the start-up hook applies with ``NEMO_IS_NEMO_RL_HEAD=1``) the same call runs on the
  plugin's head (counted) and gives NeMo-RL's head's log-probs and every parameter gradient of a loss on them (fp32,
  1e-5 relative).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.worker_result import result_json
from host_shims.nemo_rl import SKIP_REASON, nemo_rl_path

pytestmark = pytest.mark.skipif(nemo_rl_path() is None, reason=SKIP_REASON)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = textwrap.dedent("""
    import json, socket, sys
    sys.path[:0] = sys.argv[1:]
    import torch
    from megatron.core.models.gpt import GPTModel
    from nemo_rl.distributed import model_utils
    from nemo_is_plugin.adapters.nemo_rl import head
    from nemo_is_plugin.apps.demo.model import ModelShape, build_gpt, init_distributed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    init_distributed(0, 1, 1, "127.0.0.1", port)
    torch.manual_seed(0)
    model = build_gpt(ModelShape(vocab_size=37, hidden=32, layers=2, heads=4, experts=4, topk=2, expert_ffn=48), 1, 3)
    b, s = 2, 9
    ids = torch.randint(0, 37, (b, s))
    pos = torch.arange(s).expand(b, s)
    mask = torch.tril(torch.ones(s, s, dtype=torch.bool)).logical_not()[None, None]
    logits = model(input_ids=ids, position_ids=pos, attention_mask=mask)  # megatron-core's own forward: [B, S, V]
    want = torch.log_softmax(logits.double(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    accepts = "return_logprobs_for_linear_ce_fusion" in GPTModel.forward.__code__.co_varnames
    model_utils.patch_gpt_model_forward_for_linear_ce_fusion(chunk_size=4)
    coef = torch.randn(b, s - 1)

    def fused():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, position_ids=pos, attention_mask=mask, labels=ids,
                    return_logprobs_for_linear_ce_fusion=True)
        (out * coef).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    nemo_rl_out, nemo_rl_grads = fused()
    calls = [0]
    plugin_head = head.from_parallel_hidden_states_to_logprobs
    def counted(*a, **k):
        calls[0] += 1
        return plugin_head(*a, **k)
    head.patch_nemo_rl(model_utils)
    model_utils.from_parallel_hidden_states_to_logprobs = counted  # the plugin's head, counted
    plugin_out, plugin_grads = fused()
    rel = lambda a, b: float((a.double() - b.double()).abs().max() / b.double().abs().max())
    print("RESULT " + json.dumps({
        "megatron_core_forward_takes_the_argument": accepts,
        "shape": list(nemo_rl_out.shape),
        "nemo_rl_vs_logits": rel(nemo_rl_out, want),
        "plugin_calls": calls[0],
        "plugin_vs_nemo_rl": rel(plugin_out, nemo_rl_out),
        "grads": sorted(nemo_rl_grads) == sorted(plugin_grads) and len(plugin_grads),
        "grad_rel": max(rel(plugin_grads[n], nemo_rl_grads[n]) for n in nemo_rl_grads),
    }))
""")


def test_nemo_rl_fused_forward_runs_on_megatron_core_and_on_the_plugins_head(tmp_path):
    paths = [str(ROOT), str(nemo_rl_path())]
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, *paths], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    out = result_json(proc)
    assert out["megatron_core_forward_takes_the_argument"] is False  # NeMo-RL's own forward brings it
    assert out["shape"] == [2, 8]
    assert out["nemo_rl_vs_logits"] < 1e-5  # NeMo-RL's fused path: the model's next-token log-probs
    assert out["plugin_calls"] == 1 and out["plugin_vs_nemo_rl"] < 1e-5
    assert out["grads"] > 10 and out["grad_rel"] < 1e-5, json.dumps(out)
