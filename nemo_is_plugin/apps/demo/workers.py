"""Ray actors: the policy worker group (one actor per Megatron TP rank) and the rollout worker.

The driver talks to the policy group as one object (:class:`PolicyGroup`): every call goes to all TP ranks at once
(their collectives need it) and rank 0's answer is returned. Ray is imported inside functions only.
"""

from __future__ import annotations

import os
import socket
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch

from nemo_is_plugin.apps.demo.model import ModelShape

if TYPE_CHECKING:
    from nemo_is_plugin.apps.demo.policy import MegatronPolicy


class PolicyActor:
    """One TP rank of the Megatron policy. Heavy imports happen in :meth:`setup`, inside the actor process."""

    def __init__(self, rank: int, world_size: int, shape: dict, policy_kwargs: dict) -> None:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        self.rank, self.world_size = rank, world_size
        self.shape, self.kwargs = ModelShape(**shape), policy_kwargs
        self.policy: MegatronPolicy | None = None  # built by setup(), in the actor process
        self.loss_fns: dict[str, Any] = {}

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port: the gloo rendezvous of the group (asked of rank 0)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, master_addr: str, master_port: int) -> None:
        from nemo_is_plugin.apps.demo.policy import MegatronPolicy

        self.policy = MegatronPolicy(
            self.rank, self.world_size, self.shape, master_addr=master_addr, master_port=master_port, **self.kwargs
        )

    def _setup_policy(self) -> MegatronPolicy:
        if self.policy is None:
            raise RuntimeError("PolicyActor: call setup() before using the policy")
        return self.policy

    def call(self, method: str, *args, **kwargs):
        return getattr(self._setup_policy(), method)(*args, **kwargs)

    def train(self, data: dict[str, torch.Tensor], setting: str, loss_config: dict, minibatches: int):
        if setting not in self.loss_fns:  # built once per setting; the config was validated by the driver
            from nemo_is_plugin import build_loss_fn

            self.loss_fns[setting] = build_loss_fn(loss_config)
        return self._setup_policy().train(data, self.loss_fns[setting], minibatches)


class RolloutActor:
    """Holds a rollout backend (``backends.make_backend``) and serves generate() calls."""

    def __init__(
        self, shape: dict, backend: str, precision: str, temperature: float, seed: int, top_k: int = 0
    ) -> None:
        torch.set_num_threads(1)
        from nemo_is_plugin.apps.demo.backends import make_backend

        self.backend = make_backend(backend, ModelShape(**shape), precision, temperature, seed, top_k)

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        self.backend.load_weights(state)

    def generate(self, prompts: torch.Tensor, max_new_tokens: int, ignore_eos: bool, seed: int):
        out = self.backend.generate(prompts, max_new_tokens, ignore_eos=ignore_eos, seed=seed)
        return out.tokens, out.logprobs, out.mask, out.topk_ids, out.topk_logprobs


class PolicyGroup:
    """The TP ranks of the policy as one handle. Methods block and return rank 0's result."""

    def __init__(self, shape: ModelShape, tp: int, policy_kwargs: dict, num_cpus: float) -> None:
        import ray

        actor = ray.remote(num_cpus=num_cpus)(PolicyActor)
        self.actors = [actor.remote(r, tp, asdict(shape), policy_kwargs) for r in range(tp)]
        addr, port = ray.get(self.actors[0].address.remote())
        ray.get([a.setup.remote(addr, port) for a in self.actors])

    def _all(self, refs: list) -> Any:
        import ray

        return ray.get(refs)[0]

    def call(self, method: str, *args, **kwargs) -> Any:
        import ray

        shipped = [ray.put(a) if isinstance(a, (torch.Tensor, dict)) else a for a in args]  # once, not per rank
        return self._all([a.call.remote(method, *shipped, **kwargs) for a in self.actors])

    def train(self, data: dict[str, torch.Tensor], setting: str, loss_config: dict, minibatches: int) -> list[dict]:
        import ray

        ref = ray.put(data)
        return self._all([a.train.remote(ref, setting, loss_config, minibatches) for a in self.actors])


def start_ray(address: str | None, num_cpus: int = 2) -> bool:
    """Connect to ``address`` or start an embedded local Ray; returns True if this call started Ray."""
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # local embedded cluster: no token auth
    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    return True


def rollout_actor(
    shape: ModelShape,
    backend: str,
    precision: str,
    temperature: float,
    seed: int,
    num_cpus: float,
    num_gpus: float = 0.0,
    top_k: int = 0,
):
    import ray

    actor = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(RolloutActor)
    return actor.remote(asdict(shape), backend, precision, temperature, seed, top_k)
