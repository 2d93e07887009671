"""npu_fused_infer_attention_score (and _v2) on CUDA tensors: decode calls run the CUDA decode
kernel (csrc/ops/attention/infer_attention_cuda.cu), every other call the portable composition.
The kernel's cases run on both its split passes (tensor cores where they apply, and CUDA cores),
the same call on CUDA copies and on the CPU (whose kernels test_infer_attention*.py check against
a float64 oracle), comparing outputs and softmax_lse. Skipped without a GPU."""
from __future__ import annotations

import math

import pytest
import torch

import opennpu  # noqa: F401
from test_infer_attention import make, rnd
from test_infer_attention_antiquant import factors, i8, paged_case

npu = torch.ops.npu
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# outputs: one rounding of fp32 values computed in another order (one ulp of the dtype apart at
# most, plus fp32 noise); lse: float32 either way
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}
LSE_TOL = dict(atol=1e-4, rtol=1e-5)
# int8 codes: the per-channel key factors are folded into q (q'_d = q_d s_d) here and on the CPU
# in another order; scores are sums of terms up to |q'| * 128 in fp32
INT8_LSE_TOL = dict(atol=1e-3, rtol=1e-4)


@pytest.fixture(params=["tensor_cores", "cuda_cores"])
def kernel(request, monkeypatch):
    """fp16 / bf16 caches of head size 64 or 128 on the tensor-core pass, or
    (OPENNPU_FIA_CUDA_MMA=0) on the CUDA-core pass that takes every other call."""
    if request.param == "cuda_cores":
        monkeypatch.setenv("OPENNPU_FIA_CUDA_MMA", "0")


def _cuda(x):
    return x.cuda() if isinstance(x, torch.Tensor) else x


def _compare(args, kw, dtype, v2=False, lse_tol=LSE_TOL):
    """The call on CUDA against the CPU; returns the CUDA outputs."""
    op = npu.npu_fused_infer_attention_score_v2 if v2 else npu.npu_fused_infer_attention_score
    got = op(*[_cuda(a) for a in args], **{k: _cuda(v) for k, v in kw.items()})
    expected = op(*args, **kw)
    out, lse = got
    assert out.device.type == "cuda" and out.dtype == expected[0].dtype
    torch.testing.assert_close(out.cpu(), expected[0], **TOL[dtype], equal_nan=True)
    torch.testing.assert_close(lse.cpu(), expected[1], **lse_tol, equal_nan=True)
    return got


def _ops_run(fn):
    """Names of the dispatcher ops a call ran (the profiler's CPU events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events()}


def test_routes(monkeypatch):
    q, k, v = (t.cuda() for t in make("BSH", 2, 4, 2, 1, 32, 16, torch.float16))
    kw = dict(num_heads=4, num_key_value_heads=2, input_layout="BSH")
    table = torch.tensor([[0], [1]], dtype=torch.int32, device="cuda")
    paged = dict(block_table=table, block_size=32, actual_seq_lengths_kv=[32, 20])

    def ran(q, k, v, **extra):
        return _ops_run(lambda: npu.npu_fused_infer_attention_score(q, k, v, **kw, **extra))

    assert "opennpu::_fia_decode" in ran(q, k, v, **paged)
    assert "opennpu::_fia_decode" in ran(q, k, v)
    q3 = torch.randn(2, 3, 64, dtype=torch.float16, device="cuda")  # three query rows: prefill
    assert "opennpu::_fia_portable" in ran(q3, k, v, **paged)
    assert "opennpu::_fia_portable" in ran(q, k, v, pse_shift=torch.zeros(1, 4, 1, 32, device="cuda",
                                                                        dtype=torch.float16))
    monkeypatch.setenv("OPENNPU_FIA_DECODE", "0")
    names = ran(q, k, v, **paged)
    assert "opennpu::_fia_portable" in names and "opennpu::_fia_decode" not in names


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD"])
@pytest.mark.parametrize("kvn", [8, 2, 1])
@pytest.mark.parametrize("D", [40, 64, 128])  # 40: element loads (not a whole 16-byte vector)
def test_decode_contiguous(layout, kvn, D, dtype, kernel):
    torch.manual_seed(0)
    q, k, v = make(layout, 3, 8, kvn, 1, 77, D, dtype)
    kw = dict(num_heads=8, num_key_value_heads=kvn, input_layout=layout, scale=0.3,
              actual_seq_lengths_kv=[77, 5, 0], softmax_lse_flag=True)
    _compare((q, k, v), kw, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache", ["BnBsH", "BnNBsD"])
@pytest.mark.parametrize("bs,lens", [(16, [160, 1, 33, 97]), (128, [1000, 3, 129, 640])])
def test_decode_paged(cache, bs, lens, dtype, kernel):
    torch.manual_seed(1)
    B, N, KVN, D = 4, 8, 2, 64
    nb = B * ((max(lens) + bs - 1) // bs) + 3
    cols = (max(lens) + bs - 1) // bs
    layout = "BSH" if cache == "BnBsH" else "BNSD"
    q = rnd(B, 1, N * D, dtype=dtype) if layout == "BSH" else rnd(B, N, 1, D, dtype=dtype)
    shape = (nb, bs, KVN * D) if cache == "BnBsH" else (nb, KVN, bs, D)
    k, v = rnd(*shape, dtype=dtype), rnd(*shape, dtype=dtype)
    table = torch.randperm(nb, dtype=torch.int32)[:B * cols].view(B, cols)
    kw = dict(num_heads=N, num_key_value_heads=KVN, input_layout=layout, scale=0.125,
              block_table=table, block_size=bs, actual_seq_lengths_kv=lens, softmax_lse_flag=True)
    _compare((q, k, v), kw, dtype)


# Query groups of 1, 3 (a 4-head tile, one head idle), 8 and 16 (two 8-head tiles), long
# contexts (context splits merged by the second launch) and odd lengths.
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("n,kvn", [(4, 4), (6, 2), (16, 2), (16, 1)])
@pytest.mark.parametrize("S", [1, 33, 3001])
def test_decode_groups_and_context_splits(n, kvn, S, dtype, kernel):
    torch.manual_seed(2)
    q, k, v = make("BNSD", 2, n, kvn, 1, S, 64, dtype)
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout="BNSD", scale=0.2,
              softmax_lse_flag=True, actual_seq_lengths_kv=[S, max(S - 2, 1)])
    _compare((q, k, v), kw, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_head", [False, True])
def test_decode_masks_and_fully_masked_rows(per_head, dtype, kernel):
    torch.manual_seed(4)
    q, k, v = make("BSND", 2, 4, 2, 1, 50, 16, dtype)
    mask = torch.rand(2, 4, 1, 50) < 0.3 if per_head else torch.rand(2, 50) < 0.3
    mask[1] = True  # batch 1 sees nothing: zeros and lse -inf
    kw = dict(num_heads=4, num_key_value_heads=2, input_layout="BSND", scale=0.5,
              atten_mask=mask, softmax_lse_flag=True)
    out, lse = _compare((q, k, v), kw, dtype)
    assert (out[1] == 0).all() and torch.isinf(lse[1]).all()


@pytest.mark.parametrize("S", [50, 3001])
def test_decode_nan_query_head_gives_nan(S, kernel):
    torch.manual_seed(3)
    q, k, v = make("BNSD", 1, 4, 1, 1, S, 32, torch.bfloat16)
    q[0, 1, 0, 3] = float("nan")
    out, _ = _compare((q, k, v), dict(num_heads=4, num_key_value_heads=1, input_layout="BNSD"),
                      torch.bfloat16)
    assert out[0, 1].isnan().all() and not out[0, [0, 2, 3]].isnan().any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("D,Dr,n", [(64, 16, 8), (512, 64, 16)])  # DeepSeek's latent width
def test_mla_rope(paged, D, Dr, n, dtype, kernel):
    torch.manual_seed(5)
    B, S = 2, 40
    q, qr = rnd(B, n, 1, D, dtype=dtype), rnd(B, n, 1, Dr, dtype=dtype)
    if paged:
        k, kr = rnd(8, 16, D, dtype=dtype), rnd(8, 16, Dr, dtype=dtype)
        table = torch.tensor([[0, 2, 4], [7, 1, 3]], dtype=torch.int32)
        extra = dict(block_table=table, block_size=16, actual_seq_lengths_kv=[S, 17])
        layout = "BSH"
        q, qr = q.transpose(1, 2).flatten(2), qr.transpose(1, 2).flatten(2)
    else:
        k, kr = rnd(B, 1, S, D, dtype=dtype), rnd(B, 1, S, Dr, dtype=dtype)
        extra, layout = {}, "BNSD"
    kw = dict(query_rope=qr, key_rope=kr, num_heads=n, num_key_value_heads=1,
              input_layout=layout, scale=1 / math.sqrt(D + Dr), softmax_lse_flag=True, **extra)
    _compare((q, k, k), kw, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_tnd_paged_vllm_style(dtype, kernel):
    torch.manual_seed(3)
    N, KVN, D, bs = 4, 2, 32, 8
    q = rnd(3, N, D, dtype=dtype)
    k, v = rnd(12, bs, KVN * D, dtype=dtype), rnd(12, bs, KVN * D, dtype=dtype)
    table = torch.tensor([[3, 1, 0, 0], [5, 6, 7, 8], [2, 0, 0, 0]], dtype=torch.int32)
    kw = dict(num_heads=N, num_key_value_heads=KVN, input_layout="TND", scale=0.17,
              block_table=table, block_size=bs, actual_seq_lengths=[1, 2, 3],
              actual_seq_lengths_kv=[11, 29, 3], softmax_lse_flag=True)
    _compare((q, k, v), kw, dtype)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
@pytest.mark.parametrize("mode,form", [(0, "nd"), (0, "tensor"), (1, "bs"), (2, None), (3, None)])
@pytest.mark.parametrize("with_offset", [False, True])
def test_decode_int8_cache(mode, form, with_offset, dtype, kernel):
    torch.manual_seed(mode)
    B, N, KVN, S, D = 3, 8, 2, 70, 64
    q = rnd(B, N, 1, D, dtype=dtype)
    k8, v8 = i8(B, KVN, S, D), i8(B, KVN, S, D)
    ks, ko, _ = factors(mode, form, B, KVN, S, D, with_offset, dtype)
    vs, vo, _ = factors(mode, form, B, KVN, S, D, with_offset, dtype)
    kw = dict(key_antiquant_scale=ks, value_antiquant_scale=vs, key_antiquant_offset=ko,
              value_antiquant_offset=vo, key_antiquant_mode=mode, value_antiquant_mode=mode,
              num_heads=N, num_key_value_heads=KVN, input_layout="BNSD", scale=0.3,
              actual_seq_lengths_kv=[70, 9, 1], softmax_lse_flag=True)
    _compare((q, k8, v8), kw, dtype, lse_tol=INT8_LSE_TOL)


@pytest.mark.parametrize("cache", ["BnBsH", "BnNBsD"])
@pytest.mark.parametrize("mode", [0, 1, 4, 5])
def test_decode_int8_paged_cache(cache, mode, kernel):
    torch.manual_seed(mode)
    q, k8, v8, _, _, kw, quant = paged_case(cache, mode, True, torch.bfloat16)
    layout = "BSH" if cache == "BnBsH" else "BNSD"
    if layout == "BNSD":
        q = q.view(q.shape[0], 1, kw["num_heads"], -1).transpose(1, 2)
    _compare((q, k8, v8), dict(input_layout=layout, **kw, **quant), torch.bfloat16,
             lse_tol=INT8_LSE_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
def test_v2_with_learnable_sink(dtype, kernel):
    torch.manual_seed(6)
    q, k, v = make("BNSD", 2, 8, 2, 1, 300, 64, dtype)
    sink = torch.randn(8) * 2
    sink[3] = float("-inf")
    kw = dict(num_query_heads=8, num_key_value_heads=2, input_layout="BNSD", softmax_scale=0.2,
              learnable_sink=sink, actual_seq_kvlen=[300, 0], return_softmax_lse=True)
    _compare((q, k, v), kw, dtype, v2=True)


def test_non_contiguous_query_and_cache(kernel):
    torch.manual_seed(7)
    q = rnd(3, 8, 2, 32)[:, :, :1]  # BNSD with a strided sequence dim
    k = rnd(3, 2, 64, 48)[..., :32]  # rows of 48 read 32 wide
    v = rnd(3, 2, 64, 32)
    _compare((q, k, v), dict(num_heads=8, num_key_value_heads=2, input_layout="BNSD",
                             softmax_lse_flag=True), torch.float32)


def test_empty_batch_and_bad_inputs():
    q, k, v = make("BSH", 0, 4, 2, 1, 8, 16, torch.float16)
    out, _ = npu.npu_fused_infer_attention_score(q.cuda(), k.cuda(), v.cuda(), num_heads=4,
                                                 num_key_value_heads=2)
    assert out.shape == (0, 1, 64) and out.is_cuda
    q, k, v = (t.cuda() for t in make("BSH", 2, 4, 2, 1, 8, 16, torch.float16))
    with pytest.raises(RuntimeError, match="npu_fused_infer_attention_score.*num_key_value_heads"):
        npu.npu_fused_infer_attention_score(q, k, v, num_heads=4, num_key_value_heads=3)
    with pytest.raises(RuntimeError, match="npu_fused_infer_attention_score.*block_table.*row per batch"):
        npu.npu_fused_infer_attention_score(  # the cache [2 blocks, 8, 32] of a batch of two
            q, k, v, num_heads=4, num_key_value_heads=2, block_size=8, actual_seq_lengths_kv=[8, 8],
            block_table=torch.zeros(1, 1, dtype=torch.int32, device="cuda"))
