"""verl 0.9.1's training step on a CPU: its platform, a tiny local model, and its engine's GPU-only defaults.

Written against verl 0.9.1 (https://github.com/verl-project/verl, tag v0.9.1; paths below are inside the package).
What each piece works around:

- ``register_cpu_platform``: verl resolves its device through its platform registry
  (``verl/plugin/platform/platform_manager.py``, ``_detect_platform_name``, which falls back to ``nvidia`` when no
  accelerator is found, and ``PlatformRegistry.register``, the documented hook for new hardware). A ``cpu`` platform
  registered there, selected with ``VERL_PLATFORM=cpu``, makes ``verl.utils.device.get_device_name()`` ``"cpu"`` and
  its ``get_torch_device()`` a module with the memory calls verl makes after each step
  (``verl/workers/engine_workers.py``, ``TrainingWorker._postprocess_output``: ``max_memory_allocated`` /
  ``max_memory_reserved``) and in its engines (``empty_cache``, ``synchronize``, ``set_per_process_memory_fraction``).
- gloo first: ``TrainingWorker.__init__`` calls ``initialize_global_process_group_ray``
  (``verl/utils/distributed.py``, line 83), whose default backend is ``cpu:gloo,<device>:<nccl>``; it initialises
  nothing when a group exists, and the tests' spawn harness (``tests/distributed/_spawn.py``) initialises gloo before
  any verl code runs.
- ``megatron_fp32``: fp32 on the Megatron engine (its docstring).
- ``tiny_model_dir``: ``HFModelConfig`` (``verl/workers/config/model.py``, ``__post_init__``) reads a model from a
  path; a tiny random Qwen2 and a word-level tokenizer saved locally (no hub download), with
  ``override_config.attn_implementation=sdpa`` (verl's default, ``flash_attention_2``, line 185, needs CUDA).
"""

from __future__ import annotations

import os
import types
from pathlib import Path

import torch


def _cpu_device_module() -> types.ModuleType:
    """``torch.cpu`` plus the CUDA memory calls verl makes on ``get_torch_device()`` (all no-ops or 0 on a CPU)."""
    module = types.ModuleType("verl_cpu_device")
    for name in ("current_device", "device_count", "is_available", "synchronize", "Stream", "stream"):
        setattr(module, name, getattr(torch.cpu, name))
    for name in ("max_memory_allocated", "max_memory_reserved", "memory_allocated", "memory_reserved"):
        setattr(module, name, lambda *args, **kwargs: 0)
    for name in ("empty_cache", "set_per_process_memory_fraction", "reset_peak_memory_stats", "set_device"):
        setattr(module, name, lambda *args, **kwargs: None)
    module.manual_seed = torch.manual_seed
    module.manual_seed_all = torch.manual_seed
    module.mem_get_info = lambda *args, **kwargs: (0, 0)
    # ``verl/utils/flops_counter.py`` line 80 (``get_device_flops``) names the device to look up its peak FLOPs
    module.get_device_name = lambda *args, **kwargs: "CPU"
    return module


def register_cpu_platform() -> None:
    """Register and select verl's ``cpu`` platform (before anything calls ``verl.plugin.platform.get_platform``)."""
    from verl.plugin.platform import PlatformBase, PlatformRegistry, set_platform

    cpu_module = _cpu_device_module()

    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformBase):
        device_name = "cpu"  # type: ignore[assignment]
        vendor_name = "cpu"  # type: ignore[assignment]
        device_module = cpu_module  # type: ignore[assignment]

        def is_available(self) -> bool:
            return True

        def current_device(self) -> torch.device:  # type: ignore[override]
            # verl uses it as a device (``get_device_id()`` in ``.to(...)``, ``to_empty(device=...)``): an int would
            # mean cuda:<int>
            return torch.device("cpu")

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: int | None = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        def nvtx_range(self, msg: str):  # type: ignore[override]
            import contextlib

            return contextlib.nullcontext()

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> None:
            return None

    os.environ["VERL_PLATFORM"] = "cpu"
    # verl registers its engines for device "cuda" / "npu" only (``verl/workers/engine/fsdp/transformer_impl.py``
    # line 1143, ``verl/workers/engine/megatron/transformer_impl.py`` line 1171); ``EngineRegistry.get_engine_cls``
    # (``verl/workers/engine/base.py`` line 404) takes the device and vendor to look up from these variables.
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"
    os.environ["VERL_ENGINE_VENDOR"] = "nvidia"
    set_platform(PlatformCPU())


def tiny_model_dir(
    path: Path, *, vocab_size: int = 256, hidden: int = 64, layers: int = 2, seed: int = 0, tied: bool = False
) -> Path:
    """A random 2-layer Qwen2 (4 heads, 2 KV heads; the LM head tied to the embedding with ``tied``) saved with
    ``save_pretrained``: verl loads it as a checkpoint."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        torch_dtype="float32",
        architectures=["Qwen2ForCausalLM"],
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.save_pretrained(path)
    # verl's Megatron engine reads the tokenizer's pad id in its forward step
    # (``verl/workers/engine/megatron/transformer_impl.py`` line 1405): a word-level tokenizer over the same ids
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>").save_pretrained(path)
    return path


def megatron_fp32(engine_config) -> None:
    """fp32 training on verl's Megatron engine: ``McoreEngineConfig.__post_init__`` (``verl/workers/config/engine.py``
    line 218) admits only ``bfloat16`` / ``float16``, while the engine itself derives Megatron's ``params_dtype`` /
    ``bf16`` / ``fp16`` from the value (``verl/workers/engine/megatron/transformer_impl.py``, ``_build_tf_config``,
    lines 292 and 334) and runs fp32 with ``float32``. Set after validation, so that the steps compare at fp32."""
    object.__setattr__(engine_config, "dtype", "float32")
