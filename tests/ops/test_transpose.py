"""Confusion transpose: npu_confusion_transpose (+ npu_confusion_transpose_backward).

Contract: shared/spec/torch_npu_api.md section 1.11; seed 000 section
torch_npu.npu_confusion_transpose (examples one and two). Pure data movement, so every comparison
is exact (torch.equal), in every dtype.
"""

from __future__ import annotations

import itertools
import math
import random
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from op_helpers import SETTINGS, dtype_id, grads_of, leaf_copies, opcheck

import opennpu
from opennpu.testing import reference as R

F32, F64 = torch.float32, torch.float64
FWD, BWD = opennpu.npu_confusion_transpose, opennpu.npu_confusion_transpose_backward
ALL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8,
              torch.uint8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64,
              torch.uint64, torch.bool, torch.complex64, torch.complex128)
MODES = pytest.mark.parametrize("transpose_first", [True, False], ids=["tf", "vf"])


def make(shape, dtype=F32, requires_grad=False):
    """Distinct values in every dtype (bools alternate), so a misplaced element shows."""
    n = math.prod(shape)
    if dtype == torch.bool:
        x = torch.randint(0, 2, (n,), dtype=torch.int64).bool()
    elif dtype.is_complex:
        x = torch.randn(n, dtype=dtype)
    elif dtype.is_floating_point:
        x = torch.randn(n).to(dtype)
    else:
        hi = {torch.int8: 127, torch.uint8: 255}.get(dtype, 30000)
        lo = 0 if dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64) else -hi
        x = torch.randint(lo, hi, (n,), dtype=torch.int64).to(dtype)
    return x.reshape(shape).requires_grad_(requires_grad)


def regroup(sizes, rng):
    """A random shape with the same numel: adjacent sizes merged at random cut points."""
    out = []
    for s in sizes:
        if out and rng.random() < 0.4:
            out[-1] *= s
        else:
            out.append(s)
    return out or [1]


def case(shape, perm, transpose_first, rng=None):
    """(x_shape, perm, shape) of a valid call: for transpose_first the target shape regroups the
    permuted shape; otherwise x is a regrouping of `shape`, which perm permutes."""
    rng = rng or random.Random(0)
    if transpose_first:
        return list(shape), list(perm), regroup([shape[p] for p in perm], rng)
    return regroup(list(shape), rng), list(perm), list(shape)


def check(x, perm, shape, transpose_first):
    out = FWD(x, perm, shape, transpose_first)
    expected = R.confusion_transpose(x, perm, shape, transpose_first)
    assert out.shape == expected.shape and out.dtype == x.dtype
    assert out.is_contiguous()
    assert torch.equal(out, expected), (tuple(x.shape), x.stride(), perm, shape, transpose_first)
    return out


def _raises(fn, *pieces):
    """fn raises RuntimeError whose message contains every piece, in order."""
    with pytest.raises(RuntimeError, match=".*".join(map(re.escape, pieces))):
        fn()


# ----------------------------------------------------------------------------- seed 000


def test_seed_example_one_permute_then_reshape():
    data = torch.rand(64, 3, 64, 128)
    batch, channel, height, width = data.shape
    result = opennpu.npu_confusion_transpose(data, (0, 2, 1, 3), (height, batch, channel * width),
                                             transpose_first=True)
    expected = R.native_confusion_transpose_1(data)
    assert result.shape == (64, 64, 3 * 128)
    assert torch.equal(result, expected)


def test_seed_example_two_view_then_transpose():
    data = torch.rand(64, 3, 64, 128)
    batch, channel, height, width = data.shape
    result = opennpu.npu_confusion_transpose(data, (1, 0), (batch, height * channel * width),
                                             transpose_first=False)
    expected = R.native_confusion_transpose_2(data)
    assert result.shape == (64 * 3 * 128, 64) and result.is_contiguous()
    assert torch.equal(result, expected)


def test_seed_examples_through_torch_npu_import():
    import torch_npu

    data = torch.rand(8, 3, 16, 32, dtype=torch.bfloat16)
    batch, channel, height, width = data.shape
    one = torch_npu.npu_confusion_transpose(data, (0, 2, 1, 3), (height, batch, channel * width),
                                            transpose_first=True)
    two = torch_npu.npu_confusion_transpose(data, (1, 0), (batch, height * channel * width),
                                            transpose_first=False)
    assert torch.equal(one, R.native_confusion_transpose_1(data))
    assert torch.equal(two, R.native_confusion_transpose_2(data))


def test_contract_doc_examples():
    x = torch.rand(2, 3, 4, 6)
    assert FWD(x, (0, 2, 1, 3), (2, 4, 18), True).shape == (2, 4, 18)
    assert FWD(x, (0, 2, 1), (2, 12, 6), False).shape == (2, 6, 12)
    check(x, [0, 2, 1, 3], [2, 4, 18], True)
    check(x, [0, 2, 1], [2, 12, 6], False)


# ----------------------------------------------------------------------------- dtypes & shapes


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape,perm", [((5, 37, 19), (2, 0, 1)), ((6, 9, 2, 33), (0, 2, 1, 3)),
                                        ((67, 130), (1, 0))], ids=["3d", "bsnd", "2d"])
@MODES
def test_every_dtype_exact(dtype, shape, perm, transpose_first):
    x_shape, perm, target = case(shape, perm, transpose_first)
    check(make(x_shape, dtype), perm, target, transpose_first)


@pytest.mark.parametrize("rank", [1, 2, 3, 4, 5])
@MODES
def test_ranks_with_random_permutations(rank, transpose_first):
    rng = random.Random(rank)
    for _ in range(12):
        shape = [rng.choice([1, 2, 3, 5, 8, 17]) for _ in range(rank)]
        perm = list(range(rank))
        rng.shuffle(perm)
        x_shape, perm, target = case(shape, perm, transpose_first, rng)
        for dtype in (F32, torch.bfloat16, torch.int8, F64):
            check(make(x_shape, dtype), perm, target, transpose_first)


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (7, 1), (3, 83), (83, 3), (769, 5), (5125, 3),
                                   (65, 129), (257, 1031)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16, F32, F64], ids=dtype_id)
def test_odd_sizes_2d_transpose(shape, dtype):
    # Tile edges (64 fp32 / 128 bf16 per side), SIMD block edges (4-16 units) and the parallel
    # path (257 x 1031 moves about 1 MB of fp32).
    check(make(shape, dtype), [1, 0], list(reversed(shape)), True)
    check(make(shape, dtype), [1, 0], list(shape), False)


@pytest.mark.parametrize("shape,perm", [
    ((2, 64, 8, 128), (0, 2, 1, 3)),    # BSND -> BNSD: short contiguous runs, tiled
    ((3, 5, 7, 2), (0, 2, 1, 3)),       # runs of 2 elements become one wider unit
    ((3, 5, 7, 3), (0, 2, 1, 3)),       # runs of 3 elements (memcpy per run)
    ((4, 3, 9000), (1, 0, 2)),          # runs of 36 KB: the long-run path
    ((70000,), (0,)),                   # identity: a plain parallel copy
    ((2, 3, 4, 5, 6), (4, 3, 2, 1, 0)),  # full reversal
    ((16, 1, 33, 1), (3, 2, 1, 0)),     # size-1 dims dropped
], ids=["bsnd", "run2", "run3", "longrun", "identity", "reverse5d", "ones"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16, F32, torch.complex128],
                         ids=dtype_id)
def test_copy_paths(shape, perm, dtype):
    x_shape, perm, target = case(shape, perm, True)
    check(make(x_shape, dtype), perm, target, True)


@pytest.mark.slow
@pytest.mark.parametrize("shape,perm,dtype", [
    ((4096, 4096), (1, 0), torch.uint8), ((2048, 4096), (1, 0), torch.bfloat16),
    ((2048, 2048), (1, 0), F32), ((1024, 2048), (1, 0), F64),
    ((4, 1024, 32, 64), (0, 2, 1, 3), torch.int16), ((4, 1024, 360, 3), (0, 2, 1, 3), F32),
    ((16, 1024, 1024), (0, 1, 2), F32),
    ((2049, 2047), (1, 0), F32), ((2049, 4099), (1, 0), torch.bfloat16),
    ((4099, 4097), (1, 0), torch.uint8),
], ids=["u8-2d", "bf16-2d", "f32-2d", "f64-2d", "runs", "runs12B", "identity", "f32-odd",
        "bf16-odd", "u8-odd"])
def test_large_outputs(shape, perm, dtype, stream_threshold):
    # Outputs of stream_min_bytes and more (16 MiB here; by default the last-level cache) are
    # written with streaming stores for whole lines (straight from the SIMD blocks, or through a
    # staging buffer); odd sizes give output rows that are not line-aligned, whose partial lines
    # are stored normally.
    stream_threshold(16 << 20)
    x = make(shape, dtype)
    check(x, list(perm), [shape[p] for p in perm], True)


@pytest.mark.parametrize("shape,perm,target", [
    ((0, 3), (1, 0), (3, 0)), ((2, 0, 4), (2, 0, 1), (4, 0)), ((0,), (0,), (0, 5)),
], ids=["0x3", "2x0x4", "0"])
@MODES
def test_empty(shape, perm, target, transpose_first):
    if transpose_first:
        x = make(shape)
        out = FWD(x, perm, list(target), True)
        assert out.shape == tuple(target) and out.numel() == 0
    else:
        x = make(target)
        out = FWD(x, perm if len(perm) == len(shape) else (0,), list(shape), False)
        assert out.numel() == 0


def test_scalar_tensor():
    x = torch.tensor(3.5)
    assert torch.equal(FWD(x, [], [], True), x)
    assert torch.equal(FWD(x, [0], [1], False), x.view(1))


def non_contiguous_inputs(shape):
    """Layouts of a tensor of `shape`: dims reversed in memory, every other element of the last
    dim, a storage offset, and a broadcast (stride-0) dim."""
    rev = make(list(reversed(shape))).permute(*reversed(range(len(shape))))
    sliced = make([*shape[:-1], 2 * shape[-1]])[..., ::2]
    offset = make([shape[0] + 1, *shape[1:]])[1:]
    expanded = make([1, *shape[1:]]).expand(shape)
    return {"reversed": rev, "sliced": sliced, "offset": offset, "expanded": expanded}


@pytest.mark.parametrize("layout", ["reversed", "sliced", "offset", "expanded"])
@MODES
def test_non_contiguous_input(layout, transpose_first):
    shape, perm = (4, 6, 10), (2, 0, 1)
    x = non_contiguous_inputs(shape)[layout]
    assert x.shape == shape
    if transpose_first:
        check(x, list(perm), [10, 24], True)
    else:  # view(shape) then permute; a layout that cannot be viewed is read in logical order
        check(x, [1, 0, 2], [4, 6, 10], False)
        check(x, [1, 0], [24, 10], False)


def test_output_is_a_new_tensor_even_for_the_identity():
    x = make((3, 4))
    out = FWD(x, [0, 1], [3, 4], True)
    assert out.data_ptr() != x.data_ptr()
    out.fill_(0)
    assert x.abs().sum() > 0


def test_bits_move_unchanged():
    # NaN payloads and negative zero survive the SIMD shuffles (checked through the bit pattern).
    bits = torch.randint(-(2**31), 2**31 - 1, (33, 70), dtype=torch.int64).to(torch.int32)
    bits[::3] = 0x7FC01234  # quiet NaN with a payload
    bits[1::5] = -(2**31)  # -0.0
    x = bits.view(F32)
    out = FWD(x, [1, 0], [70, 33], True)
    assert torch.equal(out.view(torch.int32), bits.t().contiguous())


# ----------------------------------------------------------------------------- backward


def native_composition(transpose_first, perm, shape):
    """The composition the op stands for, as a differentiable function of x."""
    if transpose_first:
        return lambda x: x.permute(perm).reshape(shape)
    return lambda x: x.reshape(shape).permute(perm)


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16, F64], ids=dtype_id)
@pytest.mark.parametrize("shape,perm", [((64, 3, 8, 16), (0, 2, 1, 3)), ((6, 35), (1, 0)),
                                        ((2, 3, 4, 5), (3, 1, 0, 2))],
                         ids=["seed1", "seed2", "4d"])
@MODES
def test_autograd_matches_native_autograd(dtype, shape, perm, transpose_first):
    x_shape, perm, target = case(shape, perm, transpose_first, random.Random(1))
    x = make(x_shape, dtype, requires_grad=True)
    native = native_composition(transpose_first, perm, target)
    grad_out = torch.randn(native(x.detach()).shape).to(dtype)
    (ours,) = grads_of(lambda t: FWD(t, perm, target, transpose_first), [x], grad_out)
    (expected,) = grads_of(native, leaf_copies([x]), grad_out)
    assert ours.shape == x.shape and ours.dtype == dtype
    assert torch.equal(ours, expected)


@pytest.mark.parametrize("dtype", [F32, torch.int32, torch.float16], ids=dtype_id)
@MODES
def test_backward_op_matches_contract(dtype, transpose_first):
    # Called as autograd calls it: (grad, perm, self.shape, not transpose_first).
    for shape, perm in [((4, 6, 10), (2, 0, 1)), ((5, 7), (-1, 0)), ((2, 1, 3, 4), (3, 2, 0, 1))]:
        x_shape, perm, target = case(shape, perm, transpose_first, random.Random(2))
        out = FWD(make(x_shape, dtype), perm, target, transpose_first)
        grad = make(list(out.shape), dtype)
        dx = opennpu.npu_confusion_transpose_backward(grad, perm, x_shape, not transpose_first)
        assert dx.shape == tuple(x_shape) and dx.is_contiguous()
        assert torch.equal(dx, R.confusion_transpose_backward(grad, perm, x_shape,
                                                              not transpose_first))


@MODES
def test_backward_inverts_forward(transpose_first):
    for shape, perm in [((4, 6, 10), (2, 0, 1)), ((3, 8, 5, 2), (1, 3, 0, 2))]:
        x_shape, perm, target = case(shape, perm, transpose_first, random.Random(3))
        x = make(x_shape, torch.int16)
        out = FWD(x, perm, target, transpose_first)
        assert torch.equal(BWD(out, perm, x_shape, not transpose_first), x)


def test_autograd_of_non_contiguous_input():
    base = make((10, 4, 6), requires_grad=True)
    x = base.transpose(0, 2)  # (6, 4, 10)
    out = FWD(x, [1, 0, 2], [4, 60], True)
    g = torch.randn(4, 60)
    (ours,) = torch.autograd.grad(out, base, g)
    (expected,) = torch.autograd.grad(x.permute(1, 0, 2).reshape(4, 60), base, g)
    assert torch.equal(ours, expected)


@MODES
def test_gradcheck_float64(transpose_first):
    x_shape, perm, target = case((2, 3, 4), (2, 0, 1), transpose_first, random.Random(4))
    x = make(x_shape, F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: FWD(t, perm, target, transpose_first), [x])


def test_double_backward_is_a_clear_error():
    x = make((3, 4), F64, requires_grad=True)
    out = FWD(x, [1, 0], [4, 3], True)
    (gx,) = torch.autograd.grad(out, x, torch.ones(4, 3, dtype=F64, requires_grad=True),
                                create_graph=True)
    _raises(lambda: gx.sum().backward(), "npu_confusion_transpose_backward", "double backward")


# ----------------------------------------------------------------------------- opcheck


def test_opcheck_forward():
    samples = []
    for tf, rg in itertools.product((True, False), (False, True)):
        for shape, perm in [((2, 3, 4, 5), (0, 2, 1, 3)), ((6, 7), (1, 0)), ((0, 3), (1, 0))]:
            x_shape, perm, target = case(shape, perm, tf, random.Random(5))
            samples.append(((make(x_shape, requires_grad=rg), perm, target, tf), {}))
    x = make((5, 8)).t().requires_grad_()  # non-contiguous
    samples.append(((x, [1, 0], [5, 8], True), {}))
    samples.append(((x, [1, 0], [2, 20], False), {}))
    samples.append(((make((4, 6), torch.int64), [-1, 0], [6, 4], True), {}))
    opcheck(torch.ops.npu.npu_confusion_transpose.default, samples)


def test_opcheck_backward():
    samples = []
    for tf in (True, False):
        for shape, perm in [((2, 3, 4, 5), (0, 2, 1, 3)), ((6, 7), (1, 0))]:
            x_shape, perm, target = case(shape, perm, tf, random.Random(6))
            out = FWD(make(x_shape), perm, target, tf)
            samples.append(((torch.randn(out.shape), perm, x_shape, not tf), {}))
    samples.append(((torch.randn(7, 6).t(), [1, 0], [7, 6], True), {}))
    opcheck(torch.ops.npu.npu_confusion_transpose_backward.default, samples)


# ----------------------------------------------------------------------------- hypothesis


@settings(**SETTINGS)
@given(
    shape=st.lists(st.integers(0, 6), min_size=1, max_size=5),
    data=st.data(),
    transpose_first=st.booleans(),
    dtype=st.sampled_from([F32, torch.bfloat16, torch.uint8, F64]),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_sweep(shape, data, transpose_first, dtype, seed):
    perm = data.draw(st.permutations(range(len(shape))))
    perm = [p - len(shape) if data.draw(st.booleans()) else p for p in perm]  # negative dims
    x_shape, perm, target = case(shape, perm, transpose_first, random.Random(seed))
    x = make(x_shape, dtype)
    if data.draw(st.booleans()) and x.dim() > 1:  # non-contiguous source
        x = make(list(reversed(x_shape)), dtype).permute(*reversed(range(x.dim())))
    out = check(x, perm, target, transpose_first)
    back = BWD(out, perm, x_shape, not transpose_first)
    assert torch.equal(back, x)


# ----------------------------------------------------------------------------- torch.compile


def test_compile_fullgraph_dynamic_matches_eager():
    # `perm` and `shape` are int[] in the torch_npu schema, so sizes that flow into them are
    # specialised (a new shape compiles again); the graph itself must not break, and forward and
    # gradients equal eager. The backward op takes SymInt[] and stays symbolic.
    def block(x):
        b, c, h, w = x.shape
        one = FWD(x * 2, (0, 2, 1, 3), (h, b, c * w), True)
        two = FWD(x, (1, 0), (b, h * c * w), False)
        return one + 1, two.sum(0)

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, dynamic=True, backend="aot_eager")
    for shape in [(2, 3, 4, 5), (3, 2, 5, 4)]:
        x = make(shape, requires_grad=True)
        eager, comp = block(x), compiled(x)
        for e, c in zip(eager, comp):
            assert torch.equal(c, e)
        grads = [torch.randn_like(e) for e in eager]
        assert torch.equal(grads_of(compiled, [x], grads)[0], grads_of(block, [x], grads)[0])
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- bad input


def test_compile_reports_a_bad_perm_clearly():
    def fn(x):  # the fake kernel indexes shape by perm: it checks perm first
        return FWD(x, (0, 5), (3, 4), False)

    torch._dynamo.reset()
    with pytest.raises(Exception, match=re.escape("npu_confusion_transpose: argument 'perm'")):
        torch.compile(fn, fullgraph=True, backend="aot_eager")(make((4, 3)))
    torch._dynamo.reset()


def test_rejects_perm_that_is_not_a_permutation():
    x = make((2, 3, 4))
    _raises(lambda: FWD(x, [0, 0, 1], [2, 12], True), "npu_confusion_transpose: argument 'perm'",
            "permutation", "but got [0, 0, 1]", "dim 0 repeated")
    _raises(lambda: FWD(x, [0, 3, 1], [2, 12], True), "argument 'perm'", "dims in [-3, 2]",
            "but got [0, 3, 1]")
    _raises(lambda: FWD(x, [1, -1], [4, 6], False), "argument 'perm'", "dim 1 repeated")


def test_rejects_perm_of_wrong_length():
    x = make((2, 3, 4))
    _raises(lambda: FWD(x, [1, 0], [6, 4], True), "npu_confusion_transpose: argument 'perm'",
            "must have 3 entries (one per dim of 'self' (shape [2, 3, 4]))", "but got 2")
    _raises(lambda: FWD(x, [1, 0, 2], [6, 4], False), "argument 'perm' must have 2 entries",
            "'shape' [6, 4]", "but got 3")


def test_rejects_shape_with_wrong_numel():
    x = make((2, 3, 4))
    _raises(lambda: FWD(x, [0, 2, 1], [2, 13], True), "npu_confusion_transpose: argument 'shape'",
            "as many elements as 'self' (shape [2, 3, 4]) (24)", "but got [2, 13] (26 elements)")
    _raises(lambda: FWD(x, [1, 0], [5, 5], False), "argument 'shape'", "but got [5, 5]")
    _raises(lambda: FWD(x, [1, 0], [2**62, 2**62], False), "argument 'shape'", "overflow")


def test_rejects_inferred_size():
    _raises(lambda: FWD(make((2, 3, 4)), [1, 0], [-1, 4], False),
            "npu_confusion_transpose: argument 'shape' must hold sizes >= 0",
            "-1 is not inferred", "but got [-1, 4]")


def test_backward_rejects_bad_arguments():
    g = make((4, 6))
    _raises(lambda: BWD(g, [1, 0], [5, 5], False),
            "npu_confusion_transpose_backward: argument 'grad'", "'shape' [5, 5] (25)",
            "but got shape [4, 6] (24 elements)")
    _raises(lambda: BWD(g, [1, 0, 2], [6, 4], True),
            "npu_confusion_transpose_backward: argument 'perm'", "must have 2 entries")
    _raises(lambda: BWD(g, [1, 1], [6, 4], False),
            "npu_confusion_transpose_backward: argument 'perm'", "dim 1 repeated")
    _raises(lambda: BWD(g, [1, 0], [-1, 4], False),
            "npu_confusion_transpose_backward: argument 'shape' must hold sizes >= 0")



# ----------------------------------------------------------------------------- _stream_copy_
# The benchmark harness's streaming-store copy (its second memory roof): every byte arrives, at
# any alignment of either side, whole lines streamed and partial ones stored normally.

STREAM_COPY = torch.ops.opennpu._stream_copy_


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, F32, F64], ids=dtype_id)
@pytest.mark.parametrize("numel", [1, 7, 63, 64, 65, 1000, 100_003, 1 << 20])
def test_stream_copy_every_size(numel, dtype):
    src = make((numel,), dtype)
    dst = torch.full_like(src, 3)
    assert STREAM_COPY(dst, src) is dst
    assert torch.equal(dst, src)


@pytest.mark.parametrize("src_offset,dst_offset", [(0, 1), (1, 0), (3, 5), (17, 17)])
def test_stream_copy_unaligned(src_offset, dst_offset):
    n = 70_001
    src_base, dst_base = make((n + 64,), torch.uint8), torch.zeros(n + 64, dtype=torch.uint8)
    src, dst = src_base[src_offset:src_offset + n], dst_base[dst_offset:dst_offset + n]
    STREAM_COPY(dst, src)
    assert torch.equal(dst, src)
    # nothing written outside dst
    assert not dst_base[:dst_offset].any() and not dst_base[dst_offset + n:].any()


def test_stream_copy_empty_and_multidim():
    STREAM_COPY(torch.empty(0), torch.empty(0))
    src = make((3, 5, 7), F32)
    dst = torch.empty_like(src)
    STREAM_COPY(dst, src)
    assert torch.equal(dst, src)


def test_stream_copy_rejects_bad_arguments():
    a = make((4, 6), F32)
    _raises(lambda: STREAM_COPY(torch.empty(6, 4).t(), a), "_stream_copy_: argument 'self'",
            "must be contiguous")
    _raises(lambda: STREAM_COPY(torch.empty(4, 6), make((6, 4), F32).t()),
            "_stream_copy_: argument 'src'", "must be contiguous")
    _raises(lambda: STREAM_COPY(torch.empty(4, 6, dtype=F64), a), "argument 'src'",
            "dtype of 'self' (Double)", "but got Float")
    _raises(lambda: STREAM_COPY(torch.empty(24), a), "argument 'src'",
            "shape of 'self' ([24])", "but got [4, 6]")
