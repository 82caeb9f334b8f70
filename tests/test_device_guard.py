"""The CPU guard against device bugs (helpers/device_guard.py): it catches what it must, and every golden case of every
suite under tests/data/golden runs under it with results identical to the unguarded run.

On CUDA a tensor created without ``device=`` lands on the CPU and crashes the first ``stack`` / ``cat`` with a CUDA
tensor (the kl_penalty metric did, for every config with KL weight 0). On a CPU nothing shows; under the guard it
raises. The guard does not change any value, so the guarded results must equal the plain ones exactly.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers.device_guard import DeviceLessTensorError, count_host_syncs, device_guard
from helpers.golden_calls import case_format, golden_calls, load_suite, raises, suites
from helpers.golden_outcome import assert_same_outcome, no_guard
from torch.utils._python_dispatch import TorchDispatchMode

from nemo_is_plugin import build_loss_fn
from nemo_is_plugin.loss.denominator import Denominator
from nemo_is_plugin.loss.metrics import MetricBook

CALLS = golden_calls()


# ---------------------------------------------------------------------------------------------------- the guard itself
@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(3),
        lambda: torch.zeros((), dtype=torch.float64),
        lambda: torch.ones(2, 2),
        lambda: torch.empty(4),
        lambda: torch.full((2,), 1.0),
        lambda: torch.tensor(2.0),
        lambda: torch.as_tensor([1.0, 2.0]),
        lambda: torch.as_tensor(3.0, dtype=torch.float32),
        lambda: torch.arange(5),
        lambda: torch.linspace(0, 1, 3),
        lambda: torch.eye(2),
        lambda: torch.rand(2),
        lambda: torch.randn(2),
    ],
    ids=[
        "zeros",
        "zeros_0d",
        "ones",
        "empty",
        "full",
        "tensor",
        "as_tensor_list",
        "as_tensor_float",
        "arange",
        "linspace",
        "eye",
        "rand",
        "randn",
    ],
)
def test_guard_rejects_a_factory_without_device(make):
    with device_guard(), pytest.raises(DeviceLessTensorError, match=r"without device=.*test_device_guard\.py"):
        make()


def test_guard_lets_device_aware_code_through_with_real_values():
    x = torch.arange(4.0)
    with device_guard():
        out = [
            torch.zeros(2, device=x.device),
            torch.tensor(2.0, device=x.device),
            torch.as_tensor(x),
            torch.as_tensor(x, dtype=torch.float64),
            torch.zeros_like(x),
            x.new_zeros(2),
            torch.full_like(x, 3.0),
            torch.where(x > 1, x, 0.0),
            x * 2.0 + 1,
        ]
    assert all(t.device == x.device for t in out)
    torch.testing.assert_close(out[8], torch.tensor([1.0, 3.0, 5.0, 7.0]))
    assert torch.zeros(1).device.type == "cpu"  # the default device is restored


def test_guard_catches_the_kl_penalty_metric_bug(monkeypatch):
    """The first GPU run's crash: a 0-d metric tensor created without device= (the kl_penalty of KL weight 0)."""
    real = MetricBook.clip_fractions

    def buggy(self, sur):
        real(self, sur)
        self.add_sum("device_less", torch.zeros((), dtype=torch.float64), Denominator.NONE)

    call = next(c for c in CALLS if c.suite == "nemo_rl")
    call.run("cpu", None, device_guard)  # clean
    monkeypatch.setattr(MetricBook, "clip_fractions", buggy)
    call.run("cpu", None, no_guard)  # the bug is invisible without the guard
    with pytest.raises(DeviceLessTensorError, match="torch.zeros"):
        call.run("cpu", None, device_guard)


def test_guard_catches_a_python_count_turned_into_a_host_tensor(monkeypatch):
    """The other bug it found: ``torch.as_tensor(global_valid_toks)`` of a Python number makes a CPU tensor."""
    import nemo_is_plugin.loss.terms as loss_module

    monkeypatch.setattr(loss_module, "_as_scalar", lambda x, dtype, device: torch.as_tensor(x).to(dtype))
    call = next(c for c in CALLS if c.suite == "ctpo")  # CTPO and verl calls pass the counts as Python floats
    with pytest.raises(DeviceLessTensorError, match="torch.as_tensor"):
        call.run("cpu", None, device_guard)


# ---------------------------------------------------------------------------------------------------- the sync counter
def _assign_through_a_boolean_mask(x: torch.Tensor) -> None:
    y = x.clone()
    y[x < 0] = torch.tensor([5.0])  # a value tensor: aten.index_put_ with a boolean index (nonzero inside)


# Each kind of host read with the op names a torch release may report for it: the op a Python expression lowers to
# is torch's choice and changes between releases; that the read is recorded, under one of its names, is the property.
HOST_READS = {
    ".item()": (lambda x: x.sum().item(), {"aten._local_scalar_dense", "aten.item"}),
    "bool(t)": (lambda x: bool(x.sum() > 0), {"aten._local_scalar_dense", "aten.is_nonzero", "aten.item"}),
    "float(t)": (lambda x: float(x[0]), {"aten._local_scalar_dense", "aten.item"}),
    "int(t)": (lambda x: int(x[0]), {"aten._local_scalar_dense", "aten.item"}),
    ".tolist()": (lambda x: x.tolist(), {"Tensor.tolist"}),
    ".cpu()": (lambda x: x.cpu(), {"Tensor.cpu"}),
    ".numpy()": (lambda x: x.numpy(), {"Tensor.numpy"}),
    "nonzero": (lambda x: x.nonzero(), {"aten.nonzero"}),
    "argwhere": (lambda x: torch.argwhere(x), {"aten.nonzero", "aten.argwhere"}),
    "masked_select": (lambda x: x.masked_select(x > 0), {"aten.masked_select", "aten.nonzero"}),
    "unique": (lambda x: torch.unique(x), {"aten._unique2", "aten._unique", "aten.unique", "aten.unique_dim"}),
    "boolean index": (lambda x: x[x > 0], {"aten.index", "aten.masked_select", "aten.nonzero"}),
    "boolean index assignment": (
        _assign_through_a_boolean_mask,
        {"aten.index_put_", "aten.index_put", "aten._index_put_impl_", "aten.nonzero"},
    ),
    "repeat_interleave": (
        lambda x: torch.repeat_interleave(torch.arange(3), torch.tensor([1, 2, 1])),
        {"aten.repeat_interleave"},
    ),
    "torch.equal": (lambda x: torch.equal(x, x.clone()), {"aten.equal"}),
    "torch.allclose": (lambda x: torch.allclose(x, x), {"aten.allclose", "aten._local_scalar_dense"}),
}


@pytest.mark.parametrize("kind", HOST_READS)
def test_sync_counter_sees_every_kind_of_host_read(kind):
    read, names = HOST_READS[kind]
    x = torch.tensor([1.0, -2.0, 3.0])
    with count_host_syncs() as syncs:
        read(x)
    ops = [r.op for r in syncs.records]
    assert ops and set(ops) <= names, ops
    assert all("test_device_guard.py" in r.where for r in syncs.records)


class _AtenOps(TorchDispatchMode):
    """The aten ops a piece of code lowers to."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_scalar_fill_through_a_boolean_mask_is_counted_as_torch_lowers_it():
    """``y[mask] = 0.0`` lowers to a boolean ``index_put_`` (a host read: nonzero inside) up to torch 2.13 and to
    ``masked_fill_`` (elementwise, no host read) in torch 2.15: the counter records it exactly when it syncs."""
    x = torch.tensor([1.0, -2.0, 3.0])
    y = x.clone()
    with count_host_syncs() as syncs, _AtenOps() as lowered:
        y[x < 0] = 0.0
    assert y.tolist() == [1.0, 0.0, 3.0]
    syncing = [n for n in lowered.names if n in ("index_put_", "index_put", "_index_put_impl_")]
    assert syncing or "masked_fill_" in lowered.names, lowered.names
    assert [r.op for r in syncs.records] == [f"aten.{n}" for n in syncing]


def test_sync_counter_ignores_device_side_work():
    x = torch.tensor([1.0, -2.0, 3.0])
    with count_host_syncs() as syncs:
        y = torch.where(x > 0, x, 0.0).cumsum(0)
        y[torch.tensor([0, 2])] = 1.0  # integer indexing: no sync
        torch.repeat_interleave(torch.arange(3), torch.tensor([1, 2, 1]), output_size=4)
        (x > 0).any()
        x.max()
    assert len(syncs) == 0, str(syncs)


# ---------------------------------------------------------------------------------------------------- golden suites
def test_every_golden_suite_is_run_under_the_guard():
    """Suites are found by directory (at any depth: slime's parts), so new ones are picked up; every case has a known
    format, and every case that does not raise is run."""
    found = suites()
    assert {"nemo_rl", "nemo_rl_compat", "ctpo", "verl_rollout_corr", "slime/policy", "slime/tis"} <= set(found)
    for suite in found:
        cases = load_suite(suite)
        for case in cases:
            case_format(case)
        valid = {c["id"] for c in cases if not raises(c)}
        assert valid <= {call.label.split("/")[0] for call in CALLS if call.suite == suite}, suite


@pytest.mark.parametrize("call", CALLS, ids=[c.id for c in CALLS])
def test_golden_case_under_the_guard(call):
    want = call.run("cpu", None, no_guard)
    got = call.run("cpu", None, device_guard)
    assert_same_outcome(got, want)


# ---------------------------------------------------------------------------------------------------- the source
# Loss-path code: everything but the host-side tools (CLI, demo, benchmarks, the evidence and diagnose reports).
_HOST_SIDE = ("cli", "demo", "bench", "evidence", "diagnose")  # apps/<app>; compat is checked as the loss path
_HOST_DEVICE = re.compile(r"""\.cpu\(\)|\.numpy\(\)|device\s*=\s*["']cpu["']|torch\.device\(\s*["']cpu["']""")
# (file, line) pairs that name the host on purpose, with the reason.
_HOST_BY_DESIGN = {
    ("distributed/parallel/groups.py", 'return torch.device("cpu")'): "gloo / MPI collectives reduce host tensors",
    (
        "adapters/rollout_dump.py",
        'host = torch.cat(parts).to("cpu", torch.float64).numpy()  # the one device -> host transfer',
    ): "the opt-in rollout dump writes a file on the host: one copy per training step",
    (
        "adapters/head_check.py",
        'return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")',
    ): "the user's head check builds its own random problem: on CUDA where there is one, else on the CPU",
}


def test_loss_path_code_names_no_host_device():
    """What the guard cannot see: an explicit CPU device looks like the inputs' device in a CPU run."""
    root = Path(__file__).resolve().parents[1] / "nemo_is_plugin"
    hits = [
        f"{path.relative_to(root)}:{n}: {line.strip()}"
        for path in sorted(root.rglob("*.py"))
        if path.relative_to(root).parts[:2] not in {("apps", app) for app in _HOST_SIDE}
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if _HOST_DEVICE.search(line) and (str(path.relative_to(root)), line.strip()) not in _HOST_BY_DESIGN
    ]
    assert not hits, "\n".join(hits)


def test_build_loss_fn_reads_no_tensor():
    """Building the loss creates no tensor at all (configs are validated on the host)."""
    with device_guard(), count_host_syncs() as syncs:
        build_loss_fn(
            {
                "is_correction_level": "sequence_mean",
                "use_importance_sampling_correction": True,
                "sequence_level_importance_ratios": True,
                "token_level_loss": False,
            }
        )
    assert len(syncs) == 0
