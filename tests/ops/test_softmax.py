"""Scaled masked softmax: npu_scaled_masked_softmax (+ npu_scaled_masked_softmax_backward).

Contract: shared/spec/torch_npu_api.md section 1.9; seed 000 section
torch_npu.npu_scaled_masked_softmax.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from op_helpers import (
    GRAD_DTYPES,
    LOW_DTYPES,
    SETTINGS,
    assert_not_worse_than_native,
    check_compiled_matches_eager,
    dtype_id,
    grads_of,
    leaf_copies,
    opcheck,
    randn,
)

import opennpu
from opennpu.testing import reference as R
from opennpu.testing.tolerances import assert_close

F32, F64 = torch.float32, torch.float64
FWD, BWD = "npu_scaled_masked_softmax", "npu_scaled_masked_softmax_backward"


def make_mask(*shape, p=0.3, dtype=torch.bool):
    mask = torch.rand(shape) < p
    return mask if dtype == torch.bool else mask.to(dtype) * 3  # uint8: nonzero (3) = masked


def check_forward(x, mask, scale=1.0, fixed_triu_mask=False):
    y = opennpu.npu_scaled_masked_softmax(x, mask, scale, fixed_triu_mask)
    assert y.dtype == x.dtype and y.shape == x.shape and y.is_contiguous()
    ref = R.scaled_masked_softmax(x, mask, scale, fixed_triu_mask)
    assert_close(y, ref)
    return y, ref


def check_backward(x, mask, scale=1.0, fixed_triu_mask=False):
    """The backward op on our forward output against the closed form on the same y."""
    y = opennpu.npu_scaled_masked_softmax(x, mask, scale, fixed_triu_mask)
    dy = torch.randn_like(y)
    dx = opennpu.npu_scaled_masked_softmax_backward(dy, y, mask, scale, fixed_triu_mask)
    assert dx.dtype == dy.dtype and dx.shape == x.shape
    assert_close(dx, R.scaled_masked_softmax_backward(dy, y, mask, scale, fixed_triu_mask))
    return dx


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("shape", [(2, 3, 8, 32), (4, 83), (2, 2, 5, 256)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("scale", [1, 0.125, -2.5])
def test_forward_matches_reference(dtype, shape, scale):
    check_forward(randn(*shape, dtype=dtype), make_mask(*shape), scale)


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("fixed_triu_mask", [False, True], ids=["mask", "triu"])
def test_low_precision_not_worse_than_native(dtype, fixed_triu_mask):
    x, mask = randn(4, 8, 16, 256, dtype=dtype), make_mask(1, 1, 16, 256)
    if fixed_triu_mask:
        mask = R.triu_mask(x)
    y, ref = check_forward(x, mask, 0.8)
    assert_not_worse_than_native(y, R.native_scaled_masked_softmax_golden(x, mask, 0.8), ref)
    assert_not_worse_than_native(y, R.native_scaled_masked_softmax(x, mask, 0.8), ref)


def test_backward_op_matches_reference(dtype):
    for shape, mask_shape, triu in [((2, 3, 8, 40), (1, 3, 8, 40), False),
                                    ((3, 83), (83,), False), ((2, 7, 9), None, True)]:
        x = randn(*shape, dtype=dtype)
        check_backward(x, make_mask(*(mask_shape or (1,))), 1.7, triu)


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("fixed_triu_mask", [False, True], ids=["mask", "triu"])
def test_autograd_matches_reference_autograd(dtype, fixed_triu_mask):
    x = randn(2, 3, 6, 40, dtype=dtype, requires_grad=True)
    mask = make_mask(2, 1, 6, 40)
    dy = torch.randn(2, 3, 6, 40, dtype=dtype)
    (ours,) = grads_of(lambda a: opennpu.npu_scaled_masked_softmax(a, mask, 0.6, fixed_triu_mask),
                       [x], dy)
    (ref,) = grads_of(lambda a: R.scaled_masked_softmax(a, mask, 0.6, fixed_triu_mask),
                      leaf_copies([x]), dy)
    assert ours.dtype == dtype and ours.shape == x.shape
    assert_close(ours, ref)
    masked = R.triu_mask(x).expand_as(x) if fixed_triu_mask else mask.expand_as(x)
    assert (ours[masked] == 0).all(), "masked positions must get exactly zero gradient"


def test_autograd_gives_the_mask_no_gradient():
    x = randn(3, 16, requires_grad=True)
    mask = make_mask(3, 16)
    y = opennpu.npu_scaled_masked_softmax(x, mask, 2.0)
    assert y.requires_grad and y.grad_fn is not None
    (gx,) = torch.autograd.grad((y * torch.randn_like(y)).sum(), [x])
    assert gx.shape == x.shape and not mask.requires_grad
    y = opennpu.npu_scaled_masked_softmax(x.detach(), mask)
    assert not y.requires_grad


@pytest.mark.parametrize("y_dtype,dy_dtype", [(F32, torch.bfloat16), (torch.float16, F32)],
                         ids=["fp32y-bf16dy", "fp16y-fp32dy"])
def test_backward_output_has_y_grad_dtype(y_dtype, dy_dtype):
    y = opennpu.npu_scaled_masked_softmax(randn(3, 5, 24, dtype=y_dtype), make_mask(5, 24))
    dy = randn(3, 5, 24, dtype=dy_dtype)
    mask = make_mask(5, 24)
    dx = opennpu.npu_scaled_masked_softmax_backward(dy, y, mask, 0.5, False)
    assert dx.dtype == dy_dtype
    assert_close(dx, R.scaled_masked_softmax_backward(dy, y, mask, 0.5))


# ----------------------------------------------------------------------------- sizes & layouts


@pytest.mark.parametrize("w", [1, 7, 31, 32, 33, 83, 769, 5125])
def test_last_dim_sizes(dtype, w):
    x, mask = randn(2, 3, w, dtype=dtype), make_mask(3, w)
    check_forward(x, mask, 0.5)
    check_forward(x, mask, 0.5, fixed_triu_mask=True)
    check_backward(x, mask, 0.5)


@pytest.mark.parametrize("shape", [(0,), (0, 8), (3, 0), (2, 0, 4, 8), (2, 3, 4, 0)],
                         ids=lambda s: "x".join(map(str, s)))
def test_empty(shape):
    x = randn(*shape)
    for triu in (False, True) if x.dim() >= 2 else (False,):
        y = opennpu.npu_scaled_masked_softmax(x, make_mask(*shape[-1:]), 2.0, triu)
        assert y.shape == x.shape and y.dtype == x.dtype
        dx = opennpu.npu_scaled_masked_softmax_backward(y, y, make_mask(*shape[-1:]), 2.0, triu)
        assert dx.shape == x.shape


@pytest.mark.parametrize("mask_shape", [(37,), (1,), ()], ids=["W", "1", "scalar"])
def test_one_dim_x(mask_shape):
    x = randn(37)
    check_forward(x, make_mask(*mask_shape, p=0.5), 1.5)
    check_backward(x, make_mask(*mask_shape, p=0.5), 1.5)


def test_single_element_rows_are_one():
    x = randn(5, 1)
    assert (opennpu.npu_scaled_masked_softmax(x, make_mask(5, 1, p=0.5)) == 1).all()


@pytest.mark.parametrize("mask_shape", [(2, 3, 5, 40), (1, 3, 5, 40), (2, 1, 5, 40),
                                        (1, 1, 5, 40), (5, 40), (40,), (2, 3, 5, 1), (1, 1, 5, 1),
                                        (2, 1, 1, 40), ()],
                         ids=["BNSW", "1NSW", "B1SW", "11SW", "SW", "W", "BNS1", "11S1", "B11W",
                              "scalar"])
def test_mask_broadcast_shapes(mask_shape):
    for dtype in (F32, torch.bfloat16):
        x = randn(2, 3, 5, 40, dtype=dtype)
        mask = make_mask(*mask_shape, p=0.4)
        check_forward(x, mask, 0.7)
        check_backward(x, mask, 0.7)


def test_uint8_mask_nonzero_is_masked():
    x = randn(2, 4, 48)
    mask = torch.randint(0, 4, (4, 48), dtype=torch.uint8)  # 1, 2, 3 all mean "masked"
    y, _ = check_forward(x, mask, 1.5)
    assert_close(y, opennpu.npu_scaled_masked_softmax(x, mask != 0, 1.5))
    check_backward(x, mask, 1.5)


def non_contiguous(shape, layout, dtype=F32):
    if layout == "transposed":
        return randn(*reversed(shape), dtype=dtype).permute(*reversed(range(len(shape))))
    return randn(*shape[:-1], 2 * shape[-1], dtype=dtype)[..., ::2]


@pytest.mark.parametrize("layout", ["transposed", "sliced"])
def test_non_contiguous_inputs(layout):
    x = non_contiguous((3, 5, 40), layout)
    mask = make_mask(*reversed((3, 5, 40))).permute(2, 1, 0) if layout == "transposed" else \
        make_mask(5, 80)[:, ::2]
    assert not x.is_contiguous() and not mask.is_contiguous()
    y, _ = check_forward(x, mask, 0.9)
    dy = non_contiguous((3, 5, 40), layout)
    y_nc = non_contiguous((3, 5, 40), layout)
    y_nc.copy_(y)
    dx = opennpu.npu_scaled_masked_softmax_backward(dy, y_nc, mask, 0.9, False)
    assert_close(dx, R.scaled_masked_softmax_backward(dy, y, mask, 0.9))


@pytest.mark.parametrize("b,w", [(4, 272), (1, 1000)], ids=["whole-lines", "partial-lines"])
def test_large_outputs(b, w):
    # Outputs of 16 MB and more whose rows are whole cache lines (w=272 in fp32, whose last step
    # is partial with 512-bit vectors) are written with non-temporal stores; w=1000 is not.
    # Every 7th row is checked against the reference, to keep the test quick.
    x, mask, dy = randn(b, 4, 1056, w), make_mask(1, 1, 1056, w), randn(b, 4, 1056, w)
    assert x.nbytes >= 16 << 20
    rows = slice(None, None, 7)
    for m, triu in [(mask, False), (R.triu_mask(x), True)]:
        y = opennpu.npu_scaled_masked_softmax(x, mask, 0.3, triu)
        assert_close(y[..., rows, :], R.scaled_masked_softmax(x[..., rows, :], m[..., rows, :], 0.3))
        dx = opennpu.npu_scaled_masked_softmax_backward(dy, y, mask, 0.3, triu)
        assert_close(dx[..., rows, :], R.scaled_masked_softmax_backward(
            dy[..., rows, :], y[..., rows, :], m[..., rows, :], 0.3))


# ----------------------------------------------------------------------------- mask semantics


@pytest.mark.parametrize("s,w", [(6, 6), (4, 9), (9, 4), (3, 83)], ids=lambda v: str(v))
def test_fixed_triu_mask_masks_columns_after_the_row(dtype, s, w):
    x = randn(2, 3, s, w, dtype=dtype)
    ignored = torch.zeros(7, dtype=F32)  # the mask argument is not read: any tensor will do
    y, _ = check_forward(x, ignored, 1.3, fixed_triu_mask=True)
    masked = R.triu_mask(x).expand_as(y)
    # exp(-10000 - max) underflows: masked columns get exactly 0 whenever the row has a value
    assert (y[masked] == 0).all()
    assert_close(y, R.scaled_masked_softmax(x, R.triu_mask(x), 1.3))
    dy = torch.randn_like(y)
    dx = opennpu.npu_scaled_masked_softmax_backward(dy, y, ignored, 1.3, True)
    assert_close(dx, R.scaled_masked_softmax_backward(dy, y, R.triu_mask(x), 1.3))


@pytest.mark.parametrize("mask_shape", [(2, 3, 4, 24), (2, 3, 4, 1)], ids=["per-column", "per-row"])
def test_fully_masked_rows_are_uniform(dtype, mask_shape):
    x = randn(2, 3, 4, 24, dtype=dtype) * 10
    mask = make_mask(*mask_shape, p=0.3)
    mask[0, 1, 2] = True  # one fully masked row
    mask[1] = True  # and a whole batch
    y, _ = check_forward(x, mask, 0.5)
    uniform = torch.full((24,), 1 / 24, dtype=dtype)
    torch.testing.assert_close(y[0, 1, 2], uniform, rtol=0, atol=0)
    torch.testing.assert_close(y[1], uniform.expand(3, 4, 24), rtol=0, atol=0)
    # the fully masked rows get no gradient at all
    dx = check_backward(x, mask, 0.5)
    assert (dx[1] == 0).all() and (dx[0, 1, 2] == 0).all()


@pytest.mark.parametrize("dtype", [F32, F64], ids=dtype_id)
@pytest.mark.parametrize("fixed_triu_mask", [False, True], ids=["mask", "triu"])
def test_masked_positions_with_probability_get_zero_gradient(dtype, fixed_triu_mask):
    # With x * scale near -10000 the masked positions hold a real share of the probability (they
    # are not 0 as usual); their gradient must still be exactly 0.
    x = -10000 + 3 * randn(2, 3, 9, 40, dtype=dtype)
    mask = make_mask(1, 3, 9, 40, p=0.4)
    y = opennpu.npu_scaled_masked_softmax(x, mask, 1.0, fixed_triu_mask)
    masked = (R.triu_mask(x) if fixed_triu_mask else mask).expand_as(x)
    assert (y[masked] > 1e-3).any()
    dy = torch.randn_like(y)
    dx = opennpu.npu_scaled_masked_softmax_backward(dy, y, mask, 1.0, fixed_triu_mask)
    assert (dx[masked] == 0).all()
    assert_close(dx, R.scaled_masked_softmax_backward(dy, y, masked, 1.0))


def test_unmasked_values_below_the_fill_lose_to_masked_ones():
    # -10000 is a value, not -inf: where x * scale < -10000 the masked columns win.
    x = torch.tensor([[-30000.0, -20000.0, 0.0, 5.0]])
    mask = torch.tensor([[False, False, True, True]])
    y, _ = check_forward(x, mask, 1.0)
    torch.testing.assert_close(y, torch.tensor([[0.0, 0.0, 0.5, 0.5]]))


@pytest.mark.parametrize("w", [5, 83])
def test_large_negative_rows_and_tails(dtype, w):
    # The max must ignore the padding of partial vectors: with a row of values near -1000 a
    # padding lane read as 0 would make every exp underflow.
    x = (-1000 - torch.rand(3, w)).to(dtype)
    check_forward(x, make_mask(3, w, p=0.0))
    check_forward(x, make_mask(3, w, p=0.5))


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16, torch.float16], ids=dtype_id)
def test_nan_and_inf_propagate_like_torch_softmax(dtype):
    x = randn(5, 40, dtype=dtype)
    mask = torch.zeros(5, 40, dtype=torch.bool)
    x[0, 3] = float("nan")  # unmasked NaN: NaN row
    x[1, 5] = float("inf")  # unmasked +inf: NaN row (inf - inf)
    x[2, 7], mask[2, 7] = float("nan"), True  # masked NaN: replaced by -10000
    x[3] = float("-inf")  # all -inf, nothing masked: NaN row
    x[4, :20], x[4, 20:], mask[4, 20:] = float("-inf"), 1.0, True  # -inf and masked: finite
    y = opennpu.npu_scaled_masked_softmax(x, mask)
    ref = R.scaled_masked_softmax(x, mask)
    assert_close(y, ref)  # equal_nan: NaN exactly where the reference has NaN
    assert torch.isnan(y[:2]).all() and torch.isnan(y[3]).all()
    assert torch.isfinite(y[2]).all() and torch.isfinite(y[4]).all()


# ----------------------------------------------------------------------------- seed 000


def test_seed_example():
    # Seed 000: x [64, 8, 128, 256], mask [1, 1, 128, 256] = randn >= 1, scale 0.8, native code
    # torch.softmax((x * scale).masked_fill(mask, -inf)). With ~16% of each 256-wide row masked no
    # row is fully masked, so -inf and torch_npu's -10000 give the same result.
    x = torch.randn([64, 8, 128, 256])
    mask = torch.randn([1, 1, 128, 256]) >= 1
    scale = 0.8
    assert not mask.all(dim=-1).any()
    output = opennpu.npu_scaled_masked_softmax(x, mask, scale)
    assert output.shape == (64, 8, 128, 256) and output.dtype == F32
    native = R.native_scaled_masked_softmax(x, mask, scale)
    assert_close(output, native)
    assert (output[mask.expand_as(output)] == 0).all()
    import torch_npu  # the seed's own spelling, through opennpu's compatibility import

    torch.testing.assert_close(torch_npu.npu_scaled_masked_softmax(x[:2], mask, scale),
                               output[:2], rtol=0, atol=0)


def test_seed_native_differs_only_on_fully_masked_rows():
    x, mask = randn(2, 4, 8, 64), make_mask(1, 1, 8, 64, p=0.2)
    mask[..., 3, :] = True  # row 3 of every head fully masked
    ours = opennpu.npu_scaled_masked_softmax(x, mask, 0.8)
    native = R.native_scaled_masked_softmax(x, mask, 0.8)  # -inf: 0/0 = NaN on that row
    assert torch.isnan(native[..., 3, :]).all()
    assert_close(ours[..., 3, :], torch.full_like(ours[..., 3, :], 1 / 64))
    keep = torch.ones(8, dtype=torch.bool)
    keep[3] = False
    assert_close(ours[..., keep, :], native[..., keep, :])


# ----------------------------------------------------------------------------- gradcheck, opcheck


@pytest.mark.parametrize("case", ["mask", "broadcast-uint8", "row-mask", "triu", "odd"])
def test_gradcheck_float64(case):
    x = randn(2, 3, 4, 6, dtype=F64, requires_grad=True)
    mask, triu = {
        "mask": (make_mask(2, 3, 4, 6), False),
        "broadcast-uint8": (make_mask(1, 4, 6, dtype=torch.uint8), False),
        "row-mask": (make_mask(2, 1, 4, 1, p=0.5), False),
        "triu": (torch.empty(0), True),
        "odd": (make_mask(6), False),
    }[case]
    if case == "odd":
        x = randn(5, 6, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a: opennpu.npu_scaled_masked_softmax(a, mask, 0.7, triu), [x])


def test_opcheck_forward():
    samples = []
    for shape, mask, scale, triu, rg in [
        ((2, 3, 4, 8), make_mask(1, 1, 4, 8), 0.5, False, True),
        ((3, 40), make_mask(40, dtype=torch.uint8), 2, False, False),
        ((2, 5, 7), make_mask(2, 5, 1), 1.0, False, True),
        ((2, 5, 7), torch.empty(0, dtype=torch.bool), -1.5, True, True),
        ((0, 8), make_mask(8), 1.0, False, True),
    ]:
        samples.append(((randn(*shape, requires_grad=rg), mask),
                        {"scale": scale, "fixed_triu_mask": triu}))
    x = randn(8, 6).t().requires_grad_()  # non-contiguous
    samples.append(((x, make_mask(6, 1)), {}))
    opcheck(torch.ops.npu.npu_scaled_masked_softmax.default, samples)


def test_opcheck_backward():
    samples = []
    for shape, mask, triu, dy_dtype in [((2, 3, 4, 8), make_mask(1, 1, 4, 8), False, F32),
                                        ((3, 40), make_mask(40), False, torch.bfloat16),
                                        ((2, 5, 7), torch.empty(0, dtype=torch.bool), True, F32)]:
        y = opennpu.npu_scaled_masked_softmax(randn(*shape), mask, 0.5, triu)
        samples.append(((randn(*shape, dtype=dy_dtype), y, mask, 0.5, triu), {}))
    opcheck(torch.ops.npu.npu_scaled_masked_softmax_backward.default, samples)


# ----------------------------------------------------------------------------- hypothesis


@settings(**SETTINGS)
@given(
    lead=st.lists(st.integers(1, 4), min_size=0, max_size=3),
    s=st.integers(1, 9),
    w=st.integers(1, 300),
    keep=st.lists(st.booleans(), min_size=5, max_size=5),
    drop=st.integers(0, 2),
    p=st.sampled_from([0.0, 0.3, 0.9]),
    scale=st.sampled_from([1.0, 0.088, -3.0]),
    triu=st.booleans(),
    dtype=st.sampled_from([F32, torch.bfloat16]),
)
def test_hypothesis_shape_sweep(lead, s, w, keep, drop, p, scale, triu, dtype):
    shape = (*lead, s, w)
    # the mask keeps or broadcasts (size 1) each dim, and may drop leading dims
    mask_shape = [n if k else 1 for n, k in zip(shape, keep[-len(shape):])][min(drop, len(lead)):]
    x, mask = randn(*shape, dtype=dtype), make_mask(*mask_shape, p=p)
    check_forward(x, mask, scale, triu)
    check_backward(x, mask, scale, triu)


# ----------------------------------------------------------------------------- torch.compile


def test_compile_fullgraph_dynamic_matches_eager():
    def block(x, mask):
        y = opennpu.npu_scaled_masked_softmax(x * 2, mask, 0.5)
        z = opennpu.npu_scaled_masked_softmax(y + x, mask, scale=3.0, fixed_triu_mask=True)
        return y, z

    def make(shape):
        return [randn(*shape, requires_grad=True), make_mask(1, 1, *shape[-2:])]

    check_compiled_matches_eager(block, make, [(2, 3, 4, 8), (3, 2, 5, 16)])


@pytest.mark.slow
def test_compile_inductor_matches_eager():
    def block(x, mask):
        return (opennpu.npu_scaled_masked_softmax(x * 0.5 + 1, mask, 0.8),)

    def make(shape):
        return [randn(*shape, requires_grad=True), make_mask(1, *shape[-2:])]

    check_compiled_matches_eager(block, make, [(2, 4, 8), (3, 5, 16)], backend="inductor",
                                 tol=1e-5)


# ----------------------------------------------------------------------------- bad input


def _raises(fn, *pieces):
    """fn raises RuntimeError whose message contains every piece, in order."""
    with pytest.raises(RuntimeError, match=".*".join(map(re.escape, pieces))):
        fn()


def test_rejects_bad_x():
    mask = make_mask(8)
    _raises(lambda: opennpu.npu_scaled_masked_softmax(torch.ones(3, 8, dtype=torch.int32), mask),
            f"{FWD}: argument 'x'", "but got Int")
    _raises(lambda: opennpu.npu_scaled_masked_softmax(torch.tensor(1.0), mask),
            f"{FWD}: argument 'x' must have at least 1 dim")
    _raises(lambda: opennpu.npu_scaled_masked_softmax(randn(8), mask, 1.0, True),
            f"{FWD}: argument 'x' must have at least 2 dims with fixed_triu_mask=True")


def test_rejects_bad_mask():
    x = randn(2, 3, 8)
    _raises(lambda: opennpu.npu_scaled_masked_softmax(x, torch.zeros(3, 8)),
            f"{FWD}: argument 'mask' must be bool or uint8", "but got Float")
    _raises(lambda: opennpu.npu_scaled_masked_softmax(x, make_mask(4, 8)),
            f"{FWD}: argument 'mask' must broadcast to the shape of 'x' [2, 3, 8], but got [4, 8]")
    _raises(lambda: opennpu.npu_scaled_masked_softmax(x, make_mask(1, 2, 3, 8)),
            f"{FWD}: argument 'mask' must broadcast", "but got [1, 2, 3, 8]")
    _raises(lambda: opennpu.npu_scaled_masked_softmax(x, make_mask(3, 7)),
            f"{FWD}: argument 'mask' must broadcast", "but got [3, 7]")


def test_rejects_complex_scale():
    _raises(lambda: opennpu.npu_scaled_masked_softmax(randn(3, 8), make_mask(8), 1 + 2j),
            f"{FWD}: argument 'scale' must be a real number")


def test_backward_rejects_bad_arguments():
    y, dy, mask = randn(3, 8), randn(3, 8), make_mask(8)
    _raises(lambda: opennpu.npu_scaled_masked_softmax_backward(randn(3, 7), y, mask, 1.0, False),
            f"{BWD}: argument 'y' must have the shape of 'y_grad' [3, 7], but got [3, 8]")
    _raises(lambda: opennpu.npu_scaled_masked_softmax_backward(
        torch.ones(3, 8, dtype=torch.int64), y, mask, 1.0, False), f"{BWD}: argument 'y_grad'",
        "but got Long")
    _raises(lambda: opennpu.npu_scaled_masked_softmax_backward(dy, y, make_mask(2, 8), 1.0, False),
            f"{BWD}: argument 'mask' must broadcast to the shape of 'y_grad'")
    _raises(lambda: opennpu.npu_scaled_masked_softmax_backward(dy, y, mask.float(), 1.0, False),
            f"{BWD}: argument 'mask' must be bool or uint8")


def test_double_backward_is_a_clear_error():
    x = randn(3, 8, requires_grad=True)
    y = opennpu.npu_scaled_masked_softmax(x, make_mask(8), 2.0)
    (gx,) = torch.autograd.grad((y * torch.randn_like(y)).sum(), [x], create_graph=True)
    _raises(lambda: gx.sum().backward(), BWD, "double backward")


# ----------------------------------------------------------------------------- strict mode


STRICT_OK = dict(x=(2, 2, 32, 64), mask=(1, 1, 32, 64))


@pytest.mark.parametrize("case,arg", [
    ("3-D x", "x"), ("W=16", "x"), ("W=48", "x"), ("W=8224", "x"), ("fp64 x", "x"),
    ("uint8 mask", "mask"), ("mask last dim 1", "mask"), ("2-D mask", "mask"),
    ("fixed_triu_mask", "fixed_triu_mask"),
])
def test_strict_mode_rejects_ascend_unsupported(case, arg):
    x_shape, mask_shape = STRICT_OK["x"], STRICT_OK["mask"]
    dtype, mask_dtype, triu = F32, torch.bool, False
    if case == "3-D x":
        x_shape, mask_shape = (2, 32, 64), (32, 64)
    elif case.startswith("W="):
        w = int(case[2:])
        x_shape, mask_shape = (1, 1, 2, w), (1, 1, 2, w)
    elif case == "fp64 x":
        dtype = F64
    elif case == "uint8 mask":
        mask_dtype = torch.uint8
    elif case == "mask last dim 1":
        mask_shape = (1, 1, 32, 1)
    elif case == "2-D mask":
        mask_shape = (32, 64)
    else:
        triu = True
    x, mask = randn(*x_shape, dtype=dtype), make_mask(*mask_shape, dtype=mask_dtype)

    def call():
        return opennpu.npu_scaled_masked_softmax(x, mask, 0.5, triu)

    call()  # accepted by default
    with opennpu.strict(True):
        _raises(call, f"{FWD}: argument '{arg}'", "(strict mode: Ascend constraint)")
    call()  # and accepted again once strict mode is left


def test_strict_mode_backward():
    y, dy, mask = randn(2, 2, 32, 64), randn(2, 2, 32, 64), make_mask(1, 1, 32, 64)
    with opennpu.strict(True):
        opennpu.npu_scaled_masked_softmax_backward(dy, y, mask, 0.5, False)
        _raises(lambda: opennpu.npu_scaled_masked_softmax_backward(
            dy.bfloat16(), y, mask, 0.5, False), f"{BWD}: argument 'y' must have the dtype",
            "strict mode")
        _raises(lambda: opennpu.npu_scaled_masked_softmax_backward(
            dy[..., :48], y[..., :48], mask[..., :48], 0.5, False), f"{BWD}: argument 'y_grad'",
            "multiple of 32", "strict mode")


def test_strict_mode_accepts_the_documented_shapes():
    with opennpu.strict(True):
        for dtype in (F32, torch.float16, torch.bfloat16):
            for w in (32, 256, 8192):
                x = randn(1, 2, 2, w, dtype=dtype)
                for mask_shape in [(1, 1, 2, w), (1, 2, 2, w), (1, 1, 1, w)]:
                    check_forward(x, make_mask(*mask_shape), 0.8)
