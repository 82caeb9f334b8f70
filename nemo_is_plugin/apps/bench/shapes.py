"""Benchmark shapes (hidden_size, vocab_size of each model's Hugging Face config.json) and the run configuration.

On CPU the token counts are scaled to a 2-core machine: at H=2048, V=151936 one fp32 LM-head GEMM over 256 tokens is
~160 GFLOP (about 1.5 s there). On CUDA the default is the GPU targets' setting: bf16, 16,384 tokens = 8 x 2,048.
Results are reported as ratios to the bare GEMM measured in the same run; CPU ratios do not carry over to GPUs (on a
GPU the [N, V] memory traffic costs as much as the GEMMs, on a CPU it is a fraction of them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    from typing_extensions import Unpack


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    vocab: int

    def flops_per_token(self) -> int:
        """Forward LM-head FLOPs per token, 2 H V."""
        return 2 * self.hidden * self.vocab


MODEL_SHAPES = (
    ModelShape("Qwen3-30B-A3B", 2048, 151936),
    ModelShape("Qwen3.5-35B-A3B", 2048, 248320),
    ModelShape("DeepSeek-V3", 7168, 129280),
    ModelShape("gpt-oss-20b", 2880, 201088),
)
QUICK_SHAPES = (ModelShape("tiny-a", 64, 4096), ModelShape("tiny-b", 96, 6144))

PATHS = ("naive", "from_logits", "fused_linear", "fused_2pass", "fused_triton", "fused_2pass_triton", "liger", "cce")
CPU_PATHS = ("naive", "from_logits", "fused_linear", "fused_2pass", "liger")  # no Triton / CCE kernels on a CPU
GPU_TARGET_TOKENS, GPU_TARGET_DTYPE = 16384, "bfloat16"  # the setting of the GPU targets (8 sequences x 2,048)


class BenchOverrides(TypedDict, total=False):
    """Any subset of :class:`BenchConfig`'s fields but ``device``, typed: the keyword overrides of its constructors
    (which take the device by name)."""

    shapes: tuple[ModelShape, ...]
    tokens: int
    batch: int
    tp: int
    chunk_size: int | None
    repeats: int
    paths: tuple[str, ...]
    ref_tokens: int
    memory_tokens: tuple[int, ...]
    memory_shape: tuple[int, int]
    extrapolate_tokens: int
    direct_memory_paths: tuple[str, ...]
    threads: int
    dtype: str | None
    warmup: int
    quick_run: bool


@dataclass
class BenchConfig:
    """What one ``nemo-is bench`` run measures.

    Attributes:
        shapes: model shapes of the main table.
        tokens: tokens per measurement (split over ``batch`` sequences).
        batch: sequences (rows of the RL batch; Liger loops over them).
        tp: vocab shards; the benchmark runs one rank's local work, V/tp rows of the head (collectives on [N]
            vectors only, negligible next to the GEMMs, not included).
        chunk_size: tokens per chunk of the chunked paths; None = their defaults (256 MiB of fp32 logits per chunk
            for fused_linear, 1024 tokens for from_logits).
        repeats: timing rounds after the memory-tracked warm-up (each round times every job once); best reported.
        paths: which paths to run (``PATHS``; default ``CPU_PATHS`` on CPU, all on CUDA); the bare matmul always runs.
        ref_tokens: tokens of the float64 reference used for the error columns.
        memory_tokens: token counts of the memory-scaling sweep (empty: no sweep). The two largest feed the linear
            extrapolation, so they must lie past the naive path's regime change: below ~H/2 tokens its peak is one
            [N, V] buffer + dW (V x H), above it three [N, V] buffers (scatter, log-softmax output and its gradient).
        memory_shape: (H, V) of the sweep.
        extrapolate_tokens: the token count of the memory target (8192): the sweep's linear fit is extrapolated to
            it, and the paths of ``direct_memory_paths`` are measured there directly (one run each).
        direct_memory_paths: paths measured at ``extrapolate_tokens`` (empty: none; they must be in ``paths``).
        threads: torch intra-op threads.
        device: "cpu" or "cuda" (see :class:`~nemo_is_plugin.apps.bench.device.BenchDevice`).
        dtype: dtype of the hidden states and the head; None = float32 on CPU, bfloat16 on CUDA.
        warmup: untimed calls of every job before its memory-tracked call (which is itself a warm-up on CPU).
        quick_run: tiny shapes for a smoke run (``BenchConfig.quick``); recorded so that reports say the numbers are
            not meaningful.
    """

    shapes: tuple[ModelShape, ...] = MODEL_SHAPES
    tokens: int = 256
    batch: int = 2
    tp: int = 1
    chunk_size: int | None = None
    repeats: int = 3
    paths: tuple[str, ...] = CPU_PATHS
    ref_tokens: int = 16
    memory_tokens: tuple[int, ...] = (512, 1024, 2048, 3072)
    memory_shape: tuple[int, int] = (2048, 151936)
    extrapolate_tokens: int = 8192
    direct_memory_paths: tuple[str, ...] = ("naive", "fused_linear")
    threads: int = 1
    device: str = "cpu"
    dtype: str | None = None
    warmup: int = 0
    quick_run: bool = False

    def __post_init__(self) -> None:
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda' (or cuda:N), got {self.device!r}")
        unknown = [p for p in self.paths if p not in PATHS]
        if unknown:
            raise ValueError(f"unknown path(s) {unknown}; choose from {list(PATHS)}")
        if self.extrapolate_tokens % self.batch:
            raise ValueError(f"extrapolate_tokens must be a multiple of batch={self.batch}")
        if self.tokens % self.batch or any(n % self.batch for n in self.memory_tokens):
            raise ValueError(f"token counts must be multiples of batch={self.batch}")
        if self.ref_tokens > self.tokens:
            raise ValueError(f"ref_tokens={self.ref_tokens} exceeds tokens={self.tokens}")

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @classmethod
    def quick(cls, *, device: str = "cpu", **overrides: Unpack[BenchOverrides]) -> BenchConfig:
        """Seconds-long run on tiny shapes (smoke tests, CI)."""
        base = BenchOverrides(
            shapes=QUICK_SHAPES,
            tokens=64,
            chunk_size=16,
            memory_tokens=(32, 64, 128),
            memory_shape=(64, 4096),
            extrapolate_tokens=1024,
            ref_tokens=8,
            quick_run=True,
        )
        if device.startswith("cuda"):
            base.update(_CUDA_DEFAULTS)
            base.update({"tokens": 64, "batch": 2, "memory_tokens": ()})
        base.update(overrides)
        return cls(device=device, **base)

    @classmethod
    def for_device(cls, device: str = "cpu", quick: bool = False, **overrides: Unpack[BenchOverrides]) -> BenchConfig:
        """The default run on ``device``: the CPU's scaled one, or on CUDA the GPU targets' setting (bf16, 16,384
        tokens in 8 sequences, every path, a median of 5 rounds after 2 warm-up calls, no CPU-style memory sweep:
        each row's peak is measured at the full token count)."""
        if quick:
            return cls.quick(device=device, **overrides)
        base = _CUDA_DEFAULTS.copy() if device.startswith("cuda") else BenchOverrides()
        base.update(overrides)
        return cls(device=device, **base)


_CUDA_DEFAULTS: BenchOverrides = BenchOverrides(
    tokens=GPU_TARGET_TOKENS,
    batch=8,
    repeats=5,
    warmup=2,
    paths=PATHS,
    memory_tokens=(),
    direct_memory_paths=(),
    ref_tokens=64,
)


__all__ = [
    "BenchConfig",
    "CPU_PATHS",
    "GPU_TARGET_DTYPE",
    "GPU_TARGET_TOKENS",
    "MODEL_SHAPES",
    "ModelShape",
    "PATHS",
    "QUICK_SHAPES",
]
