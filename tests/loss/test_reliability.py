"""Bad inputs to the loss fail clearly (an error naming the tensor / key and the expected shape or dtype) or stay
finite where NeMo-RL has a handling; see ``nemo_is_plugin/loss/input_validation.py`` for the rules."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_is_plugin import build_loss_fn
from nemo_is_plugin.loss.input_validation import MissingInputError, validate_loss_inputs
from nemo_is_plugin.loss.is_weights import MAX_LOG_WEIGHT

torch.set_num_threads(1)

B, S = 4, 10
LOGPROB_KEYS = ("prev_logprobs", "generation_logprobs", "reference_policy_logprobs")
NEEDS_ALL = dict(needs_prev=True, needs_generation=True, needs_reference=True, needs_rewards=True)


def batch(dtype: torch.dtype = torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lp = lambda: (-torch.rand(B, S, generator=g) * 2 - 1e-3).to(dtype)  # noqa: E731
    tm = torch.ones(B, S)
    tm[:, 0] = 0
    tm[1, 7:] = 0
    data = {
        "token_mask": tm,
        "sample_mask": torch.ones(B),
        "advantages": torch.randn(B, S, generator=g),
        "prev_logprobs": lp(),
        "generation_logprobs": lp(),
        "reference_policy_logprobs": lp(),
        "rewards": torch.tensor([1.0, 0.0, 1.0, 0.0]),
    }
    x = (-torch.rand(B, S - 1, generator=g) * 2 - 1e-3).to(dtype)
    return x, data


def call(cfg: dict, x: torch.Tensor, data: dict, n_seq=None, n_tok=None):
    """The loss with NeMo-RL's global counts (or given ones; 1 when the batch is too broken to count)."""
    try:
        n_seq = data["sample_mask"].sum() if n_seq is None else n_seq
        n_tok = (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum() if n_tok is None else n_tok
    except (KeyError, RuntimeError, IndexError, TypeError):
        n_seq, n_tok = 1.0, 1.0
    return build_loss_fn(cfg)(next_token_logprobs=x, data=data, global_valid_seqs=n_seq, global_valid_toks=n_tok)


# KL on (needs reference), VAPO NLL on (needs rewards): every key is read
FULL = dict(reference_policy_kl_penalty=0.01, positive_example_nll_weight=0.1, use_importance_sampling_correction=True)
# ... with the strict input checks (non-finite generation log-probs, positive log-probs, missing rewards refused)
STRICT = dict(FULL, strict_input_checks=True)


# ------------------------------------------------------------------------------------------------ shapes
def test_shape_error_message_names_key_and_expected_shape():
    x, data = batch()
    data["prev_logprobs"] = data["prev_logprobs"][:, 1:]  # already sliced: a classic mistake
    with pytest.raises(ValueError) as err:
        call(FULL, x, data)
    assert str(err.value) == (
        "data['prev_logprobs'] has shape [4, 9], expected [B, S] = [4, 10] (next_token_logprobs is [B, S-1] = [4, 9])"
    )


@pytest.mark.parametrize("key", ["token_mask", "advantages", *LOGPROB_KEYS])
@pytest.mark.parametrize("shape", [(B, S - 1), (B, S + 1), (B + 1, S), (B, S, 1), (B * S,)])
def test_wrong_token_tensor_shape(key, shape):
    x, data = batch()
    data[key] = torch.zeros(shape) - (0.5 if key in LOGPROB_KEYS else 0.0)
    with pytest.raises(ValueError, match=rf"data\['{key}'\] has shape \[.*\], expected \[B, S\] = \[4, 10\]"):
        call(FULL, x, data)


@pytest.mark.parametrize("key", ["sample_mask", "rewards"])
@pytest.mark.parametrize("shape", [(B, 1), (B + 1,), ()])
def test_wrong_per_sequence_shape(key, shape):
    x, data = batch()
    data[key] = torch.ones(shape)
    with pytest.raises(ValueError, match=rf"data\['{key}'\] has shape \[.*\], expected \[B\] = \[4\]"):
        call(FULL, x, data)


@pytest.mark.parametrize("shape", [(B * (S - 1),), (B, S - 1, 1)])
def test_next_token_logprobs_must_be_2d(shape):
    x, data = batch()
    with pytest.raises(ValueError, match=r"next_token_logprobs has shape .*, expected 2-D \[B, S-1\]"):
        call(FULL, x.reshape(shape), data)


# ------------------------------------------------------------------------------------------------ dtypes
@pytest.mark.parametrize("key", ["next_token_logprobs", "advantages", *LOGPROB_KEYS])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_logprobs_are_rejected(key, dtype):
    x, data = batch()
    if key == "next_token_logprobs":
        x = x.to(dtype)
    else:
        data[key] = data[key].to(dtype)
    name = key if key == "next_token_logprobs" else f"data['{key}']"
    with pytest.raises(
        TypeError,
        match=rf"{__import__('re').escape(name)} has dtype {dtype}, expected float16, "
        "bfloat16, float32 or float64",
    ):
        call(FULL, x, data)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_every_float_dtype_is_accepted(dtype):
    x, data = batch(dtype)
    loss, metrics = call(FULL, x, data)
    assert loss.dtype in (torch.float32, torch.float64) and torch.isfinite(loss)
    # same batch in float64 as the reference: half-precision log-probs change the loss only by their rounding
    ref, _ = call(FULL, x.double(), {k: v.double() if v.is_floating_point() else v for k, v in data.items()})
    tol = {torch.float16: 2e-2, torch.bfloat16: 1e-1, torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
    assert loss.item() == pytest.approx(ref.item(), rel=tol, abs=tol)


@pytest.mark.parametrize("mask_dtype", [torch.int64, torch.int32, torch.uint8, torch.bool, torch.float64])
def test_integer_and_bool_masks_give_the_float_mask_loss(mask_dtype):
    x, data = batch()
    want, _ = call(FULL, x, data)
    data = dict(data, token_mask=data["token_mask"].to(mask_dtype), sample_mask=data["sample_mask"].to(mask_dtype))
    got, _ = call(FULL, x, data)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)


@pytest.mark.parametrize("key", ["token_mask", "sample_mask"])
@pytest.mark.parametrize("value", [2.0, 0.5, -1.0, float("nan")])
def test_masks_must_be_zero_or_one(key, value):
    x, data = batch()
    data[key] = data[key].clone()
    data[key].view(-1)[-1] = value
    with pytest.raises(ValueError, match=rf"data\['{key}'\] must hold only 0 and 1; 1 bad element"):
        call(FULL, x, data)


def test_non_tensor_values_and_data_are_rejected():
    x, data = batch()
    with pytest.raises(TypeError, match=r"data\['advantages'\] must be a torch.Tensor, got list"):
        call(FULL, x, dict(data, advantages=data["advantages"].tolist()))
    with pytest.raises(TypeError, match=r"next_token_logprobs must be a torch.Tensor \[B, S-1\], got list"):
        call(FULL, x.tolist(), data)
    with pytest.raises(TypeError, match=r"data must be a mapping of tensors"):
        validate_loss_inputs(x, [data], 1, 1, **NEEDS_ALL)


def test_device_mismatch_is_named():
    x, data = batch()
    data["generation_logprobs"] = data["generation_logprobs"].to("meta")
    with pytest.raises(ValueError, match=r"data\['generation_logprobs'\] is on meta but next_token_logprobs is on cpu"):
        call(FULL, x, data)


# ------------------------------------------------------------------------------------------------ missing keys
@pytest.mark.parametrize("key", ["token_mask", "sample_mask", "advantages", *LOGPROB_KEYS, "rewards"])
def test_missing_key_is_named(key):
    x, data = batch()
    del data[key]
    with pytest.raises(KeyError) as err:
        call(STRICT, x, data)
    assert isinstance(err.value, MissingInputError)
    assert str(err.value).startswith(f"data is missing key(s) '{key}' (needed by ")


@pytest.mark.parametrize(
    ("cfg", "unneeded"),
    [
        (dict(force_on_policy_ratio=True, reference_policy_kl_penalty=0.0), "prev_logprobs"),
        (dict(reference_policy_kl_penalty=0.0), "reference_policy_logprobs"),
        (dict(use_kl_in_reward=True), "reference_policy_logprobs"),
        (dict(), "rewards"),
    ],
)
def test_keys_the_config_does_not_read_are_optional(cfg, unneeded):
    x, data = batch()
    want, _ = call(cfg, x, data)
    del data[unneeded]
    got, _ = call(cfg, x, data)
    assert got.item() == want.item()


# ------------------------------------------------------------------------------------------------ bad values
@pytest.mark.parametrize("key", ["next_token_logprobs", *LOGPROB_KEYS])
def test_positive_logprobs_are_named(key):
    x, data = batch()
    if key == "next_token_logprobs":
        x[2, 3] = 0.5
        where = "[2, 3]"
    else:
        data[key][2, 4] = 0.5
        where = "[2, 4]"
    name = key if key == "next_token_logprobs" else f"data['{key}']"
    with pytest.raises(ValueError) as err:
        call(STRICT, x, data)
    msg = str(err.value)
    assert msg.startswith(f"{name} holds positive log-probs (max 0.5 > tolerance 0.0001 for torch.float32)")
    assert f"1 bad element(s), first at {where} = 0.5" in msg


@pytest.mark.parametrize(
    ("dtype", "ok", "bad"), [(torch.float32, 5e-5, 2e-4), (torch.float16, 5e-3, 2e-2), (torch.bfloat16, 0.0625, 0.25)]
)
def test_positive_logprob_tolerance_follows_the_dtype(dtype, ok, bad):
    x, data = batch(dtype)
    x[0, 0] = ok
    call(STRICT, x, data)  # rounding of a near-certain token: accepted
    x[0, 0] = bad
    with pytest.raises(ValueError, match="next_token_logprobs holds positive log-probs"):
        call(STRICT, x, data)


@pytest.mark.parametrize("key", ["next_token_logprobs", "advantages", *LOGPROB_KEYS, "rewards"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_inputs_are_named(key, value):
    x, data = batch()
    if key == "next_token_logprobs":
        x[1, 8] = value  # a masked position of sequence 1: NaN * 0 would still poison the sums
    elif key == "rewards":
        data[key][3] = value
    else:
        data[key][1, 9] = value
    name = key if key == "next_token_logprobs" else f"data['{key}']"
    with pytest.raises(ValueError, match=rf"{__import__('re').escape(name)} contains NaN or inf; 1 bad element"):
        call(STRICT, x, data)
    if key not in ("generation_logprobs", "rewards"):  # NeMo-RL's loss would be NaN / inf: refused by default too
        with pytest.raises(ValueError, match=rf"{__import__('re').escape(name)} contains NaN or inf"):
            call(FULL, x, data)


def test_column_zero_is_not_read():
    """NeMo-RL slices [:, 1:]; junk (even NaN / positive) in column 0 neither errors nor changes the loss."""
    x, data = batch()
    want, _ = call(FULL, x, data)
    for key in ("advantages", *LOGPROB_KEYS):
        data[key][:, 0] = float("nan")
    data["prev_logprobs"][:, 0] = 3.0
    got, _ = call(FULL, x, data)
    assert got.item() == want.item()


@pytest.mark.parametrize("level", [None, "token", "sequence", "sequence_mean", "cumulative"])
def test_overflowing_finite_inputs_are_not_an_error(level):
    """p - g = 200 per token: exp overflows float32. NeMo-RL's exact path zeroes such weights as NeMo-RL does; the
    explicit levels saturate log w at MAX_LOG_WEIGHT and stay finite."""
    x, data = batch()
    data["generation_logprobs"] = data["prev_logprobs"] - 200.0
    cfg = dict(use_importance_sampling_correction=True, is_correction_level=level, reference_policy_kl_penalty=0.0)
    loss, metrics = call(cfg, x, data)
    assert torch.isfinite(loss)
    if level is None:  # exp(200) overflows -> zeroed, as NeMo-RL does
        assert metrics["sampling_importance_ratio"] == 0.0
        assert loss.item() == 0.0  # every IS weight is 0 and there is no KL term
    else:
        assert metrics["is_weight_max"] == pytest.approx(math.exp(MAX_LOG_WEIGHT), rel=1e-6)


@pytest.mark.parametrize(
    ("name", "value", "exc", "pattern"),
    [
        ("global_valid_toks", -1.0, ValueError, "global_valid_toks = -1.0 is negative"),
        ("global_valid_seqs", float("nan"), ValueError, "global_valid_seqs = nan is not finite"),
        ("global_valid_toks", torch.tensor(float("inf")), ValueError, "global_valid_toks = inf is not finite"),
        ("global_valid_seqs", torch.ones(2), ValueError, r"global_valid_seqs must be a scalar .* got shape \[2\]"),
        ("global_valid_toks", True, TypeError, "global_valid_toks must be a number or a 0-d tensor, got bool"),
        ("global_valid_seqs", "4", TypeError, "global_valid_seqs must be a number or a 0-d tensor, got str"),
    ],
)
def test_bad_global_counts(name, value, exc, pattern):
    x, data = batch()
    kw = {"n_seq": 4.0, "n_tok": 30.0}
    kw["n_seq" if name == "global_valid_seqs" else "n_tok"] = value
    with pytest.raises(exc, match=pattern):
        call(FULL, x, data, **kw)


# ------------------------------------------------------------------------------------------------ all masked
@pytest.mark.parametrize(
    "cfg",
    [
        {},
        FULL,
        dict(
            use_importance_sampling_correction=True,
            is_correction_level="cumulative",
            truncated_importance_sampling_type="tis",
            truncated_importance_sampling_ratio=2.0,
        ),
        dict(sequence_level_importance_ratios=True, token_level_loss=False, use_importance_sampling_correction=True),
    ],
)
@pytest.mark.parametrize("which", ["token_mask", "sample_mask"])
def test_all_masked_batch(cfg, which):
    x, data = batch()
    data[which] = torch.zeros_like(data[which])
    xg = x.clone().requires_grad_(True)
    loss, metrics = call(cfg, xg, data, n_seq=torch.tensor(0.0), n_tok=torch.tensor(0.0))
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(xg.grad, torch.zeros_like(x))
    for k, v in metrics.items():
        if k.endswith(("_min", "_max")):  # NeMo-RL: min/max over no token are +inf/-inf (the reduction identities)
            assert v == (math.inf if k.endswith("_min") else -math.inf), k
        else:
            assert math.isfinite(v), (k, v)


def test_one_all_masked_sample_does_not_change_the_others():
    x, data = batch()
    want, _ = call(
        FULL,
        x[[0, 2, 3]],
        {k: v[[0, 2, 3]] for k, v in data.items()},
        n_seq=torch.tensor(3.0),
        n_tok=(data["token_mask"][[0, 2, 3], 1:]).sum(),
    )
    data["sample_mask"][1] = 0
    x[1] = -3.0  # whatever the masked sample holds
    got, _ = call(FULL, x, data)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)


# ------------------------------------------------------------------------------------------------ cost
def test_validation_synchronises_once(monkeypatch):
    """A valid batch costs one device->host transfer (one tolist), never a per-sequence .item()."""
    x, data = batch()
    calls = {"tolist": 0, "item": 0}
    orig_tolist, orig_item = torch.Tensor.tolist, torch.Tensor.item

    def tolist(self):
        calls["tolist"] += 1
        return orig_tolist(self)

    def item(self):
        calls["item"] += 1
        return orig_item(self)

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    monkeypatch.setattr(torch.Tensor, "item", item)
    validate_loss_inputs(x, data, data["sample_mask"].sum(), torch.tensor(30.0), **NEEDS_ALL)
    assert calls == {"tolist": 1, "item": 0}
