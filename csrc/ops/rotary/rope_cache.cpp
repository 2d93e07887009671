// Entry points of npu_kv_rmsnorm_rope_cache (and _v2, _v2_functional): Ascend's KvRmsNormRopeCache
// of DeepSeek's MLA. Per token: RMSNorm and rope rows (rotary.h, kv_rope_rows_cpu, on the norm
// family's row kernel and the rotary family's de-interleave row), then the rows are written into
// the caches by the kvcache family's row-copy kernel (kvcache.h) with a plan of byte offsets built
// here from `index` and the cache mode:
//   'Norm'                 cache [B, 1, L, W], index [B, S]: token (b, s) -> cache[b, 0, index[b, s]]
//   'PA' / 'PA_BNSD'       cache [blocks, bs, 1, W], index [B * S]: token t -> row index[t]
//   'PA_NZ'                the same rows in the NZ layout: chunk c (d0 = 32 bytes / element) of a
//                          row at [block, c, offset, :] of the bytes viewed [blocks, W / d0, bs, d0]
//   'PA_BLK_BNSD' / '_NZ'  index [B * pages]: index[b * pages + s / bs] is the first row of the
//                          page of token (b, s), which goes to row (that / bs) * bs + s % bs
// Negative index values skip the token. Repeated targets are written in token order (last wins).
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "common/checks.h"
#include "common/dtype.h"
#include "ops/kvcache/kvcache.h"
#include "ops/rotary/rotary.h"

namespace opennpu::rotary {
namespace {

enum class CacheMode { kNorm, kPa, kPaNz, kBlk, kBlkNz };

CacheMode parse_cache_mode(const char* op, c10::string_view mode) {
  if (mode == "Norm") return CacheMode::kNorm;
  if (mode == "PA" || mode == "PA_BNSD") return CacheMode::kPa;
  if (mode == "PA_NZ") return CacheMode::kPaNz;
  if (mode == "PA_BLK_BNSD") return CacheMode::kBlk;
  if (mode == "PA_BLK_NZ") return CacheMode::kBlkNz;
  OPENNPU_CHECK_ARG(false, op, "cache_mode",
                    "must be 'Norm', 'PA', 'PA_BNSD', 'PA_NZ', 'PA_BLK_BNSD' or 'PA_BLK_NZ', but "
                    "got '", mode, "'");
  return CacheMode::kNorm;
}

// A [T, W] row source written into one cache.
struct CacheWrite {
  const char* name;
  at::Tensor cache;  // the caller's tensor (written in place)
  at::Tensor rows;   // [T, W], the cache's dtype
  int64_t W;
};

// A validated plan: byte offsets of the rows that go into one cache.
struct CachePlan {
  kvcache::RowPlan plan;
  std::vector<int64_t> src, dst;
};

// Checks the cache's shape and the index values against it; fills the plan's offsets (the rows
// are not read yet, so both caches are checked before either is written).
CachePlan plan_cache(const char* op, const CacheWrite& w, CacheMode mode, const at::Tensor& index,
                     int64_t B, int64_t S) {
  const at::Tensor& cache = w.cache;
  OPENNPU_CHECK_ARG(cache.dim() == 4, op, w.name, "must be 4-D, but got shape ",
                    shape_str(cache.sizes()));
  const int64_t el = cache.element_size();
  const int64_t T = B * S;
  const int64_t* idx = index.const_data_ptr<int64_t>();
  CachePlan out;
  std::vector<int64_t>& src = out.src;
  std::vector<int64_t>& dst = out.dst;
  src.reserve(T);
  dst.reserve(T);
  kvcache::RowPlan& plan = out.plan;
  plan.chunk_bytes = w.W * el;
  if (mode == CacheMode::kNorm) {
    OPENNPU_CHECK_ARG(cache.size(0) == B && cache.size(-1) == w.W, op, w.name,
                      "must be [B, 1, cache_length, ", w.W, "] with B = ", B,
                      " for cache_mode 'Norm', but got shape ", shape_str(cache.sizes()));
    const int64_t L = B == 0 ? 0 : cache.numel() / (B * w.W);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t i = idx[t];
      if (i < 0) continue;
      OPENNPU_CHECK_ARG(i < L, op, "index", "values must be < cache_length ", L, " of '", w.name,
                        "', but got ", i, " at token ", t);
      src.push_back(t * w.W * el);
      dst.push_back(((t / S) * L + i) * w.W * el);
    }
  } else {
    const bool nz = mode == CacheMode::kPaNz || mode == CacheMode::kBlkNz;
    OPENNPU_CHECK_ARG(cache.size(2) * cache.size(3) == w.W, op, w.name,
                      "must be [block_num, block_size, 1, ", w.W, "], but got shape ",
                      shape_str(cache.sizes()));
    const int64_t blocks = cache.size(0), bs = cache.size(1);
    const int64_t d0 = std::max<int64_t>(1, 32 / el);
    if (nz) {
      OPENNPU_CHECK_ARG(w.W % d0 == 0, op, w.name, "must have a row of whole ", d0,
                        "-element NZ chunks (32 bytes) for cache_mode 'PA_NZ' / 'PA_BLK_NZ', but "
                        "its row has ", w.W, " elements");
      plan.chunks = w.W / d0;
      plan.chunk_bytes = d0 * el;
      plan.src_chunk_stride = d0 * el;
      plan.dst_chunk_stride = bs * d0 * el;
    }
    const bool blk = mode == CacheMode::kBlk || mode == CacheMode::kBlkNz;
    const int64_t pages = (bs == 0 || B == 0) ? 0 : index.numel() / B;
    if (blk && T > 0) {
      OPENNPU_CHECK_ARG(bs > 0 && pages * B == index.numel() && pages >= (S + bs - 1) / bs, op,
                        "index", "must hold B * ceil(S / block_size) = ", B, " * ",
                        bs > 0 ? (S + bs - 1) / bs : 0, " page offsets, but got ", index.numel());
    }
    for (int64_t t = 0; t < T; ++t) {
      const int64_t s = t % S;
      int64_t row = -1;
      if (blk) {
        const int64_t page = idx[(t / S) * pages + s / bs];
        if (page < 0) continue;
        row = (page / bs) * bs + s % bs;
      } else {
        row = idx[t];
        if (row < 0) continue;
      }
      OPENNPU_CHECK_ARG(row < blocks * bs, op, "index",
                        "must address rows below block_num * block_size = ", blocks * bs, " of '",
                        w.name, "', but token ", t, " goes to row ", row);
      src.push_back(t * w.W * el);
      dst.push_back(nz ? ((row / bs) * w.W * bs + (row % bs) * d0) * el : row * w.W * el);
    }
  }
  std::vector<int64_t> sorted = dst;
  std::sort(sorted.begin(), sorted.end());
  plan.ordered = std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end();
  return out;
}

// Copies the rows into `w.cache` (through a contiguous copy when the cache is not contiguous).
void write_cache(const char* op, const CacheWrite& w, CachePlan& p) {
  if (p.src.empty()) return;
  const at::Tensor& cache = w.cache;
  kvcache::RowPlan& plan = p.plan;
  const at::Tensor target = cache.is_contiguous() ? cache : cache.contiguous();
  plan.src = static_cast<const char*>(w.rows.const_data_ptr());
  plan.dst = static_cast<char*>(target.mutable_data_ptr());
  plan.rows = static_cast<int64_t>(p.src.size());
  plan.src_off = p.src.data();
  plan.dst_off = p.dst.data();
  kvcache::row_copy.get(op, target)(plan);
  if (!target.is_same(cache)) cache.copy_(target);
}

// Validates, computes the rows, writes k_cache / ckv_cache in place; returns (k_rope, c_kv).
std::tuple<at::Tensor, at::Tensor> kv_rmsnorm_rope_cache_impl(
    const char* op, const at::Tensor& kv, const at::Tensor& gamma, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& index, const at::Tensor& k_cache,
    const at::Tensor& ckv_cache, const std::optional<at::Tensor>& k_rope_scale,
    const std::optional<at::Tensor>& c_kv_scale, const std::optional<at::Tensor>& k_rope_offset,
    const std::optional<at::Tensor>& c_kv_offset, const std::optional<at::Tensor>& v,
    double epsilon, c10::string_view cache_mode) {
  const CacheMode mode = parse_cache_mode(op, cache_mode);
  check_floating(op, "kv", kv);
  OPENNPU_CHECK_ARG(kv.dim() == 4 && kv.size(1) == 1, op, "kv",
                    "must be 4-D [batch_size, 1, seq_len, hidden_size], but got shape ",
                    shape_str(kv.sizes()));
  check_strict_dtype(op, "kv", kv, {at::kHalf, at::kBFloat16});
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"gamma", gamma},
                                {"cos", cos}, {"sin", sin}, {"index", index},
                                {"k_cache", k_cache}, {"ckv_cache", ckv_cache}}) {
    check_same_device(op, name, t, "kv", kv);
  }
  OPENNPU_CHECK_ARG(!(k_rope_offset.has_value() && k_rope_offset->defined()) &&
                        !(c_kv_offset.has_value() && c_kv_offset->defined()),
                    op, "k_rope_offset", "and 'c_kv_offset' (asymmetric quantisation) are not "
                    "supported (as on Ascend); pass None");
  const int64_t B = kv.size(0), S = kv.size(2), D = kv.size(3), T = B * S;
  check_floating(op, "gamma", gamma);
  OPENNPU_CHECK_ARG(gamma.dim() == 1, op, "gamma", "must be 1-D, but got shape ",
                    shape_str(gamma.sizes()));
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"cos", cos},
                                {"sin", sin}}) {
    OPENNPU_CHECK_ARG(t.scalar_type() == kv.scalar_type(), op, name, "must have the dtype of 'kv' (",
                      kv.scalar_type(), "), but got ", t.scalar_type());
    OPENNPU_CHECK_ARG(t.dim() == 4 && t.size(1) == 1 && (t.size(0) == B || t.size(0) == 1) &&
                          (t.size(2) == S || t.size(2) == 1) && t.size(3) == cos.size(-1) &&
                          t.size(3) % 2 == 0,
                      op, name, "must be [batch_size, 1, seq_len, rope_size] = [", B, ", 1, ", S,
                      ", even] (or 1 in batch_size / seq_len), of the shape of 'cos', but got ",
                      shape_str(t.sizes()));
  }
  const int64_t Dr = cos.size(3);
  const bool with_v = v.has_value() && v->defined();
  int64_t Dc = 0, Wk = 0, Wc = 0;
  at::Tensor vr;
  if (with_v) {
    OPENNPU_CHECK_ARG(v->scalar_type() == kv.scalar_type(), op, "v", "must have the dtype of 'kv' (",
                      kv.scalar_type(), "), but got ", v->scalar_type());
    check_same_device(op, "v", *v, "kv", kv);
    OPENNPU_CHECK_ARG(v->dim() == 4 && v->size(0) == B && v->size(1) == 1 && v->size(2) == S, op,
                      "v", "must be [", B, ", 1, ", S, ", Dv] like 'kv', but got shape ",
                      shape_str(v->sizes()));
    OPENNPU_CHECK_ARG(gamma.size(0) == D && Dr <= D, op, "gamma",
                      "must have kv's hidden size ", D, " (with v, the whole kv row is normalised "
                      "and its first rope_size = ", Dr, " elements rotated), but got shape ",
                      shape_str(gamma.sizes()));
    Wk = D;
    Wc = v->size(3);
    vr = v->reshape({T, Wc});
    if (Wc > 0 && vr.stride(1) != 1) vr = vr.contiguous();
  } else {
    Dc = gamma.size(0);
    OPENNPU_CHECK_ARG(D == Dc + Dr, op, "kv",
                      "must have hidden_size = rms_size + rope_size = ", Dc, " + ", Dr,
                      " (gamma's and cos's sizes), but got shape ", shape_str(kv.sizes()));
    Wk = Dr;
    Wc = Dc;
  }
  OPENNPU_CHECK_ARG(index.scalar_type() == at::kLong || index.scalar_type() == at::kInt, op, "index",
                    "must be int64 (or int32), but got ", index.scalar_type());
  const at::Tensor idx = index.to(at::kLong).contiguous();
  if (mode == CacheMode::kNorm || mode == CacheMode::kPa || mode == CacheMode::kPaNz) {
    OPENNPU_CHECK_ARG(idx.numel() == T, op, "index",
                      "must hold one offset per token (", T, mode == CacheMode::kNorm
                          ? " as [batch_size, seq_len]" : " as [batch_size * seq_len]",
                      "), but got shape ", shape_str(index.sizes()));
  }

  // Quantisation: a scale (W floats) turns its cache into int8 codes.
  const auto prepare_scale = [&](const char* name, const std::optional<at::Tensor>& scale,
                                 const at::Tensor& cache, const char* cache_name,
                                 int64_t W) -> at::Tensor {
    if (!(scale.has_value() && scale->defined())) {
      OPENNPU_CHECK_ARG(cache.scalar_type() == kv.scalar_type(), op, cache_name,
                        "must have the dtype of 'kv' (", kv.scalar_type(), ") without '", name,
                        "', but got ", cache.scalar_type());
      return at::Tensor();
    }
    check_floating(op, name, *scale);
    check_same_device(op, name, *scale, "kv", kv);
    OPENNPU_CHECK_ARG(scale->numel() == W, op, name, "must hold ", W,
                      " values (one per element of the cache row), but got shape ",
                      shape_str(scale->sizes()));
    OPENNPU_CHECK_ARG(cache.scalar_type() == at::kChar, op, cache_name, "must be int8 with '", name,
                      "' (quantised cache), but got ", cache.scalar_type());
    return scale->reshape({W}).to(acc_dtype(kv)).contiguous();
  };
  const at::Tensor ks = prepare_scale("k_rope_scale", k_rope_scale, k_cache, "k_cache", Wk);
  const at::Tensor cs = prepare_scale("c_kv_scale", c_kv_scale, ckv_cache, "ckv_cache", Wc);

  const auto opts = kv.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor k_rope = at::empty({B, 1, S, Wk}, opts);
  at::Tensor c_kv = at::empty({B, 1, S, Wc}, opts);
  at::Tensor k_stage = ks.defined() ? at::empty({T, Wk}, opts.dtype(at::kChar)) : k_rope.view({T, Wk});
  at::Tensor c_stage = cs.defined() ? at::empty({T, Wc}, opts.dtype(at::kChar)) : c_kv.view({T, Wc});
  const CacheWrite k_write{"k_cache", k_cache, k_stage, Wk};
  const CacheWrite c_write{"ckv_cache", ckv_cache, c_stage, Wc};
  CachePlan k_plan = plan_cache(op, k_write, mode, idx, B, S);
  CachePlan c_plan = plan_cache(op, c_write, mode, idx, B, S);
  if (T == 0) return {k_rope, c_kv};

  at::Tensor kvr = kv.reshape({T, D});
  if (kvr.stride(1) != 1) kvr = kvr.contiguous();
  const at::Tensor g = gamma.to(acc_dtype(kv)).contiguous();
  const at::Tensor cb = (cos.stride(3) == 1 ? cos : cos.contiguous()).expand({B, 1, S, Dr});
  const at::Tensor sb = (sin.stride(3) == 1 ? sin : sin.contiguous()).expand({B, 1, S, Dr});
  std::vector<int64_t> cos_off(T), sin_off(T);
  for (int64_t t = 0; t < T; ++t) {
    cos_off[t] = (t / S) * cb.stride(0) + (t % S) * cb.stride(2);
    sin_off[t] = (t / S) * sb.stride(0) + (t % S) * sb.stride(2);
  }

  KvRopeRows rows;
  rows.dtype = kv.scalar_type();
  rows.T = T;
  rows.Dc = Dc;
  rows.Dr = Dr;
  rows.Wk = Wk;
  rows.Wc = Wc;
  rows.kv = kvr.const_data_ptr();
  rows.kv_stride = kvr.stride(0);
  if (with_v) {
    rows.v = vr.const_data_ptr();
    rows.v_stride = vr.stride(0);
  }
  rows.cos = cb.const_data_ptr();
  rows.sin = sb.const_data_ptr();
  rows.cos_off = cos_off.data();
  rows.sin_off = sin_off.data();
  rows.gamma = g.const_data_ptr();
  rows.eps = epsilon;
  rows.k_out = k_rope.mutable_data_ptr();
  rows.c_out = c_kv.mutable_data_ptr();
  if (ks.defined()) {
    rows.k_stage = k_stage.mutable_data_ptr();
    rows.k_scale = ks.const_data_ptr();
  }
  if (cs.defined()) {
    rows.c_stage = c_stage.mutable_data_ptr();
    rows.c_scale = cs.const_data_ptr();
  }
  kv_rope_rows.get(op, c_kv)(rows);

  write_cache(op, k_write, k_plan);
  write_cache(op, c_write, c_plan);
  return {k_rope, c_kv};
}

void check_no_cache_dtype(const char* op, std::optional<int64_t> k_cache_dtype,
                          std::optional<int64_t> ckv_cache_dtype) {
  OPENNPU_CHECK_ARG(!k_cache_dtype.has_value() && !ckv_cache_dtype.has_value(), op,
                    "k_cache_dtype", "and 'ckv_cache_dtype' (reinterpreting a cache as fp8 / "
                    "hifloat8) are not implemented by opennpu; pass None");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> npu_kv_rmsnorm_rope_cache(
    const at::Tensor& kv, const at::Tensor& gamma, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& index, const at::Tensor& k_cache, const at::Tensor& ckv_cache,
    const std::optional<at::Tensor>& k_rope_scale, const std::optional<at::Tensor>& c_kv_scale,
    const std::optional<at::Tensor>& k_rope_offset, const std::optional<at::Tensor>& c_kv_offset,
    const std::optional<at::Tensor>& v, double epsilon, c10::string_view cache_mode,
    bool /*is_output_kv: k_rope / c_kv are always filled*/) {
  auto [k_rope, c_kv] = kv_rmsnorm_rope_cache_impl(
      "npu_kv_rmsnorm_rope_cache", kv, gamma, cos, sin, index, k_cache, ckv_cache, k_rope_scale,
      c_kv_scale, k_rope_offset, c_kv_offset, v, epsilon, cache_mode);
  // torch_npu writes the caches in place and returns them.
  return {k_cache, ckv_cache, k_rope, c_kv};
}

std::tuple<at::Tensor, at::Tensor> npu_kv_rmsnorm_rope_cache_v2(
    const at::Tensor& kv, const at::Tensor& gamma, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& index, at::Tensor& k_cache, at::Tensor& ckv_cache,
    const std::optional<at::Tensor>& k_rope_scale, const std::optional<at::Tensor>& c_kv_scale,
    const std::optional<at::Tensor>& k_rope_offset, const std::optional<at::Tensor>& c_kv_offset,
    const std::optional<at::Tensor>& v, double epsilon, c10::string_view cache_mode,
    bool /*is_output_kv*/, std::optional<int64_t> k_cache_dtype,
    std::optional<int64_t> ckv_cache_dtype) {
  constexpr const char* op = "npu_kv_rmsnorm_rope_cache_v2";
  check_no_cache_dtype(op, k_cache_dtype, ckv_cache_dtype);
  return kv_rmsnorm_rope_cache_impl(op, kv, gamma, cos, sin, index, k_cache, ckv_cache,
                                    k_rope_scale, c_kv_scale, k_rope_offset, c_kv_offset, v,
                                    epsilon, cache_mode);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> npu_kv_rmsnorm_rope_cache_v2_functional(
    const at::Tensor& kv, const at::Tensor& gamma, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& index, const at::Tensor& k_cache, const at::Tensor& ckv_cache,
    const std::optional<at::Tensor>& k_rope_scale, const std::optional<at::Tensor>& c_kv_scale,
    const std::optional<at::Tensor>& k_rope_offset, const std::optional<at::Tensor>& c_kv_offset,
    const std::optional<at::Tensor>& v, double epsilon, c10::string_view cache_mode,
    bool /*is_output_kv*/, std::optional<int64_t> k_cache_dtype,
    std::optional<int64_t> ckv_cache_dtype) {
  constexpr const char* op = "npu_kv_rmsnorm_rope_cache_v2_functional";
  check_no_cache_dtype(op, k_cache_dtype, ckv_cache_dtype);
  at::Tensor k = k_cache.clone(at::MemoryFormat::Contiguous);
  at::Tensor c = ckv_cache.clone(at::MemoryFormat::Contiguous);
  auto [k_rope, c_kv] = kv_rmsnorm_rope_cache_impl(op, kv, gamma, cos, sin, index, k, c,
                                                   k_rope_scale, c_kv_scale, k_rope_offset,
                                                   c_kv_offset, v, epsilon, cache_mode);
  return {k_rope, c_kv, k, c};
}

TORCH_LIBRARY_IMPL(npu, CPU, m) {
  m.impl("npu_kv_rmsnorm_rope_cache", &npu_kv_rmsnorm_rope_cache);
  m.impl("npu_kv_rmsnorm_rope_cache_v2", &npu_kv_rmsnorm_rope_cache_v2);
  m.impl("npu_kv_rmsnorm_rope_cache_v2_functional", &npu_kv_rmsnorm_rope_cache_v2_functional);
}

}  // namespace opennpu::rotary
