// CPU kernels of npu_quant_matmul and npu_convert_weight_to_int4pack (compiled once per ISA; see
// common/cpu_dispatch.h and quant_matmul.h): the exact int32 product, code conversion with its
// exactness bound, int4 packing and unpacking, int32 chunk accumulation, and the fused
// dequantise / requantise epilogue.
//
// How the int32 product is computed: ATen's int8 GEMM (at::_int_mm) is fast only where oneDNN
// has int8 dot-product instructions (AVX512-VNNI, AMX); elsewhere it is a scalar loop, many
// times slower than MKL's sgemm. There the codes are converted to fp32 and multiplied by MKL's
// sgemm (common/blas.h), which is exact: every product of two codes is an integer of at most
// 2^14 and every partial sum an integer no larger than sum_k |x1_ik| |x2_kj|; while that bound is
// <= 2^24 each partial sum is an exactly representable fp32, whatever order the GEMM adds in.
// Usually W is converted panel by panel in cache, 512 deep (so the bound always holds) and the
// panels summed in int32 (tiled_int_gemm_kernel); for many rows the whole operands are converted,
// the conversion measures the bound (per-row L1 norms and absolute maxima of the codes), and K is
// split into chunks that keep it, summed in int32.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/Utils.h>
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "common/blas.h"
#include "common/vec.h"
#include "common/vnni_gemm.h"
#include "common/fp_barrier.h"
#include "ops/quant/int_codes.h"
#include "ops/quant/quant_matmul.h"
#include "ops/transpose/transpose.h"

namespace opennpu::quant {
inline namespace CPU_CAPABILITY {
namespace {

using Vec = at::vec::Vectorized<float>;
using IVec = at::vec::Vectorized<int32_t>;
using FloatIO = VecPair<float>;

// Largest integer magnitude below which every fp32 integer sum is exact.
constexpr int64_t kExactFloatInt = int64_t{1} << 24;

// Statistics of converted codes: the largest |code| and the largest row L1 norm (sum of |code|
// over the contiguous last dim of the source).
struct CodeStats {
  int64_t absmax = 0;
  int64_t row_l1_max = 0;
};

// Per-thread maxima, combined after the parallel loop.
struct StatsByThread {
  std::vector<CodeStats> slots{static_cast<size_t>(std::max(at::get_num_threads(), 1))};

  CodeStats& mine() { return slots[std::min<size_t>(at::get_thread_num(), slots.size() - 1)]; }
  CodeStats combined() const {
    CodeStats all;
    for (const CodeStats& s : slots) {
      all.absmax = std::max(all.absmax, s.absmax);
      all.row_l1_max = std::max(all.row_l1_max, s.row_l1_max);
    }
    return all;
  }
};

// The int8 / int4 conversions (int8_to_float, int4_to_float, nibble): ops/quant/int_codes.h.

// int8 [rows, n] (contiguous) -> fp32 [rows, n]; int32 words [rows, n / 8] holding eight int4
// codes each (lowest bits first, sign-extended) -> fp32 [rows, n]. `dst` is contiguous.
CodeStats codes_to_float_kernel(const at::Tensor& src, bool int4, at::Tensor& dst) {
  const int64_t rows = dst.size(0);
  const int64_t n = dst.size(1);
  float* out = dst.mutable_data_ptr<float>();
  StatsByThread stats;
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    CodeStats& local = stats.mine();
    int32_t amax = 0;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t l1 =
          int4 ? int4_to_float(src.const_data_ptr<int32_t>() + r * (n / 8), out + r * n, n / 8,
                               amax)
               : int8_to_float(src.const_data_ptr<int8_t>() + r * n, out + r * n, n, amax);
      local.row_l1_max = std::max(local.row_l1_max, l1);
    }
    local.absmax = std::max<int64_t>(local.absmax, amax);
  });
  return stats.combined();
}

// acc [m, n] (int32, row-major) = A [m, k] (fp32 codes, lda = k) x W, W's codes read from
// int8 or int4 rows: [k, n] (w_trans false) or [n, k] (w_trans true). Column panels of W,
// kTileN wide and kTileK deep, are converted to fp32 in a per-thread buffer that stays in L2
// and multiplied by MKL's sgemm (one thread per panel): W's codes are read once from memory, at
// one byte (or half a byte) each, where a conversion of the whole W writes and reads it back as
// fp32. kTileK * 2^14 = 2^23 bounds every partial sum (|code| <= 128), so each panel product is
// exact in fp32 whatever the codes; the panels along K are summed in int32.
void tiled_int_gemm_kernel(const float* a, int64_t m, int64_t k, int64_t n, const void* w,
                           bool int4, bool w_trans, int32_t* acc) {
  constexpr int64_t kTileN = 128;
  constexpr int64_t kTileK = 512;
  static_assert(kTileK * 128 * 128 <= kExactFloatInt, "panel sums must stay exact in fp32");
  const int64_t tiles = (n + kTileN - 1) / kTileN;
  const auto* w8 = static_cast<const int8_t*>(w);
  const auto* w4 = static_cast<const int32_t*>(w);
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    blas::TileBuffer<float> panel(kTileK * kTileN), part(m * kTileN);
    int32_t amax = 0;  // unused: the tile bound holds for every code
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t j0 = t * kTileN;
      const int64_t tn = std::min(kTileN, n - j0);
      for (int64_t k0 = 0; k0 < k; k0 += kTileK) {
        const int64_t kc = std::min(kTileK, k - k0);
        float* p = panel.data();
        if (!w_trans) {  // rows k0.. of W [k, n], columns j0..j0 + tn: panel [kc, tn]
          for (int64_t r = 0; r < kc; ++r) {
            if (int4) {
              int4_to_float(w4 + (k0 + r) * (n / 8) + j0 / 8, p + r * tn, tn / 8, amax);
            } else {
              int8_to_float(w8 + (k0 + r) * n + j0, p + r * tn, tn, amax);
            }
          }
        } else {  // rows j0.. of W [n, k], columns k0..k0 + kc: panel [tn, kc]
          for (int64_t j = 0; j < tn; ++j) {
            if (int4) {
              int4_to_float(w4 + (j0 + j) * (k / 8) + k0 / 8, p + j * kc, kc / 8, amax);
            } else {
              int8_to_float(w8 + (j0 + j) * k + k0, p + j * kc, kc, amax);
            }
          }
        }
        blas::gemm<float, float>(false, w_trans, m, tn, kc, 1.f, a + k0, k, p,
                                 w_trans ? kc : tn, 0.f, part.data(), tn);
        for (int64_t i = 0; i < m; ++i) {
          int32_t* dst = acc + i * n + j0;
          const float* src = part.data() + i * tn;
          if (k0 == 0) {
            for (int64_t j = 0; j < tn; ++j) dst[j] = static_cast<int32_t>(src[j]);
          } else {
            for (int64_t j = 0; j < tn; ++j) dst[j] += static_cast<int32_t>(src[j]);
          }
        }
      }
    }
  });
}

// int4 words [rows, w] -> int8 codes [rows, 8 w].
void unpack_int4_kernel(const at::Tensor& src, at::Tensor& dst) {
  const int64_t rows = src.size(0);
  const int64_t w = src.size(1);
  const int32_t* in = src.const_data_ptr<int32_t>();
  int8_t* out = dst.mutable_data_ptr<int8_t>();
  at::parallel_for(0, rows, grain_rows(8 * w), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t i = 0; i < w; ++i) {
        for (int k = 0; k < 8; ++k) {
          out[(r * w + i) * 8 + k] = static_cast<int8_t>(nibble(in[r * w + i], k));
        }
      }
    }
  });
}

// acc (int32, contiguous) += int32(partial) (fp32 holding exact integers, same numel).
void accumulate_chunk_kernel(at::Tensor& acc, const at::Tensor& partial) {
  int32_t* a = acc.mutable_data_ptr<int32_t>();
  const float* p = partial.const_data_ptr<float>();
  at::parallel_for(0, acc.numel(), int64_t{1} << 16, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + IVec::size() <= end; i += IVec::size()) {
      const IVec sum = IVec::loadu(a + i) +
                       at::vec::convert_to_int_of_same_size<float>(Vec::loadu(p + i));
      sum.store(a + i);
    }
    for (; i < end; ++i) a[i] += static_cast<int32_t>(p[i]);
  });
}

// The first `len` lanes of v as int8: round half to even, saturate (NaN -> 0).
inline void store_int8(int8_t* out, const Vec& v, int64_t len) {
  const Vec q = at::vec::minimum(at::vec::maximum(v.round(), Vec(-128.f)), Vec(127.f));
  const Vec clean = Vec::blendv(q, Vec(0.f), q.isnan());
  float tmp[Vec::size()];
  clean.store(tmp);
  for (int64_t i = 0; i < len; ++i) out[i] = static_cast<int8_t>(tmp[i]);
}

// A length-n vector (or one broadcast element) as a per-column loader.
struct Column {
  const float* p = nullptr;
  bool broadcast = false;

  explicit Column(const at::Tensor& t) {
    if (t.defined()) {
      p = t.const_data_ptr<float>();
      broadcast = t.numel() == 1;
    }
  }
  bool on() const { return p != nullptr; }
  Vec load(int64_t j, int64_t len) const {
    return broadcast ? Vec(p[0]) : Vec::loadu(p + j, len);
  }
};

template <typename acc_t, typename out_t>
void epilogue_typed(const at::Tensor& acc, const QuantMatmulEpilogue& e, at::Tensor& out) {
  const int64_t n = out.size(-1);
  const int64_t rows = n == 0 ? 0 : out.numel() / n;
  const acc_t* pa = acc.const_data_ptr<acc_t>();
  out_t* po = out.mutable_data_ptr<out_t>();
  const int32_t* pbi = e.bias_int.defined() ? e.bias_int.const_data_ptr<int32_t>() : nullptr;
  const int64_t bias_int_batches = e.bias_int.defined() ? e.bias_int.size(0) : 1;
  const float* pbf = e.bias_float.defined() ? e.bias_float.const_data_ptr<float>() : nullptr;
  const int64_t bias_float_batches = e.bias_float.defined() ? e.bias_float.size(0) : 1;
  const float* ppt = e.pertoken.defined() ? e.pertoken.const_data_ptr<float>() : nullptr;
  constexpr bool kIntOut = std::is_same_v<out_t, int32_t>;
  const Column scale(kIntOut ? at::Tensor() : e.scale), offset(e.offset);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / e.m;
      const acc_t* a = pa + r * n;
      out_t* o = po + r * n;
      const int32_t* bi = pbi != nullptr ? pbi + (bias_int_batches == 1 ? 0 : b) * n : nullptr;
      const float* bf = pbf != nullptr ? pbf + (bias_float_batches == 1 ? 0 : b) * n : nullptr;
      const Vec token(ppt != nullptr ? ppt[r % e.m] : 1.f);
      for (int64_t j = 0; j < n; j += Vec::size()) {
        const int64_t len = std::min<int64_t>(Vec::size(), n - j);
        // v = acc (+ int32 bias), in int32 (float accumulators hold exact integers here, or
        // the fp32 product of float operands, which takes no int32 bias).
        IVec vi;
        Vec v;
        if constexpr (std::is_same_v<acc_t, int32_t>) {
          vi = IVec::loadu(a + j, len);
          if (bi != nullptr) vi = vi + IVec::loadu(bi + j, len);
          v = at::vec::convert_to_fp_of_same_size<float>(vi);
        } else {
          v = Vec::loadu(a + j, len);
          if (bi != nullptr) {
            vi = at::vec::convert_to_int_of_same_size<float>(v) + IVec::loadu(bi + j, len);
            v = at::vec::convert_to_fp_of_same_size<float>(vi);
          } else if constexpr (kIntOut) {
            vi = at::vec::convert_to_int_of_same_size<float>(v);
          }
        }
        if constexpr (kIntOut) {
          vi.store(o + j, len);
          continue;
        } else {
          Vec y = rounded(v * scale.load(j, len));
          if (ppt != nullptr) y = rounded(y * token);
          if (bf != nullptr) y = y + Vec::loadu(bf + j, len);
          if (offset.on()) y = y + offset.load(j, len);
          if constexpr (std::is_same_v<out_t, int8_t>) {
            store_int8(o + j, y, len);
          } else if constexpr (std::is_same_v<out_t, float>) {
            y.store(o + j, len);
          } else {
            at::vec::convert_from_float<out_t>(y, Vec(0.f)).store(o + j, len);
          }
        }
      }
    }
  });
}

void quant_matmul_epilogue_kernel(const at::Tensor& acc, const QuantMatmulEpilogue& e,
                                  at::Tensor& out) {
  auto with_acc = [&](auto out_tag) {
    using out_t = decltype(out_tag);
    if (acc.scalar_type() == at::kInt) {
      epilogue_typed<int32_t, out_t>(acc, e, out);
    } else {
      epilogue_typed<float, out_t>(acc, e, out);
    }
  };
  switch (out.scalar_type()) {
    case at::kChar: return with_acc(int8_t{});
    case at::kInt: return with_acc(int32_t{});
    case at::kHalf: return with_acc(c10::Half{});
    case at::kBFloat16: return with_acc(c10::BFloat16{});
    case at::kFloat: return with_acc(float{});
    default: TORCH_INTERNAL_ASSERT(false, "npu_quant_matmul: unexpected output dtype ",
                                   out.scalar_type());
  }
}

// Up to this many rows of x1 per batch, W is converted to fp32 panel by panel
// (tiled_int_gemm_kernel); above, once whole, and MKL's threads run one large GEMM. The bound is
// high because the whole path's exactness chunks along K cost more than the panels' re-reads of
// x1 up to thousands of rows (the measurements are in the commit that moved this here).
constexpr int64_t kTiledRows = 4096;

// How the int32 product is computed (see the top of this file): ATen's int8 GEMM where oneDNN
// has int8 dot-product instructions, else exact fp32 GEMMs: panel by panel for few rows
// (kTiledRows), whole otherwise. OPENNPU_QUANT_MATMUL_GEMM=int / tiled / whole forces one (tests
// run each).
enum class GemmPath { kInt, kTiled, kWhole };

GemmPath gemm_path(int64_t m) {
  const char* forced = std::getenv("OPENNPU_QUANT_MATMUL_GEMM");
  if (forced != nullptr && std::strcmp(forced, "int") == 0) return GemmPath::kInt;
  if (forced != nullptr && std::strcmp(forced, "tiled") == 0) return GemmPath::kTiled;
  if (forced != nullptr && std::strcmp(forced, "whole") == 0) return GemmPath::kWhole;
  static const bool fast_int8 = at::cpu::is_avx512_vnni_supported() || at::cpu::init_amx();
  if (fast_int8) return GemmPath::kInt;
  return m <= kTiledRows ? GemmPath::kTiled : GemmPath::kWhole;
}

// Index into an operand's (contiguous) batches of output batch b, with broadcasting.
int64_t batch_index(const std::vector<int64_t>& out_batch, c10::IntArrayRef batch, int64_t b) {
  int64_t index = 0, stride = 1;
  const int64_t skip = static_cast<int64_t>(out_batch.size()) - static_cast<int64_t>(batch.size());
  for (int64_t d = static_cast<int64_t>(out_batch.size()) - 1; d >= 0; --d) {
    const int64_t coord = b % out_batch[d];
    b /= out_batch[d];
    if (d < skip) continue;
    const int64_t size = batch[d - skip];
    if (size != 1) index += coord * stride;
    stride *= size;
  }
  return index;
}

// The int32 product of every output batch, as int32 [B * m, n] or fp32 holding exact integers.
at::Tensor int_product(const QuantMatmulArgs& op) {
  const bool int4 = op.int4;
  const std::vector<int64_t>& out_batch = op.out_batch;
  const c10::IntArrayRef a_batch = op.a_batch, w_batch = op.w_batch;
  const int64_t batches = c10::multiply_integers(out_batch);
  const int64_t m = op.m, k = op.k, n = op.n;
  const auto opts = op.a.options();
  const GemmPath path = gemm_path(m);
  if (path == GemmPath::kInt) {
    auto as_int8 = [&](const at::Tensor& t, int64_t cols) {
      if (!int4) return t;
      at::Tensor codes = at::empty({t.numel() / (cols / 8), cols}, opts.dtype(at::kChar));
      unpack_int4_kernel(t.reshape({-1, cols / 8}), codes);
      return codes;
    };
    const at::Tensor a = as_int8(op.a, k).view({-1, m, k});
    const at::Tensor w = as_int8(op.w, op.w_trans ? k : n).view({-1, op.w_trans ? n : k,
                                                                 op.w_trans ? k : n});
    at::Tensor acc = at::empty({batches * m, n}, opts.dtype(at::kInt));
    for (int64_t b = 0; b < batches; ++b) {
      at::Tensor out = acc.narrow(0, b * m, m);
      const at::Tensor wb = w[batch_index(out_batch, w_batch, b)];
      at::_int_mm_out(out, a[batch_index(out_batch, a_batch, b)], op.w_trans ? wb.t() : wb);
    }
    return acc;
  }
  // fp32 copies of x1's codes; W converted panel by panel (few rows: W's traffic dominates).
  const int64_t a_rows = op.a.numel() / (int4 ? k / 8 : k);
  if (path == GemmPath::kTiled) {
    at::Tensor af = at::empty({a_rows, k}, opts.dtype(at::kFloat));
    codes_to_float_kernel(op.a.reshape({a_rows, -1}), int4, af);
    at::Tensor acc = at::empty({batches * m, n}, opts.dtype(at::kInt));
    const int64_t w_batch_elems = op.w.numel() / std::max<int64_t>(c10::multiply_integers(w_batch), 1);
    const auto* w_bytes = static_cast<const char*>(op.w.const_data_ptr());
    for (int64_t b = 0; b < batches; ++b) {
      tiled_int_gemm_kernel(
          af.const_data_ptr<float>() + batch_index(out_batch, a_batch, b) * m * k, m, k, n,
          w_bytes + batch_index(out_batch, w_batch, b) * w_batch_elems * op.w.element_size(),
          int4, op.w_trans, acc.mutable_data_ptr<int32_t>() + b * m * n);
    }
    return acc;
  }
  // Whole fp32 copies of the codes and the exactness bound (see the top of this file).
  at::Tensor af = at::empty({op.a.numel() / (int4 ? k / 8 : k), k}, opts.dtype(at::kFloat));
  const CodeStats sa = codes_to_float_kernel(op.a.reshape({af.size(0), -1}), int4, af);
  const int64_t w_cols = op.w_trans ? k : n;
  at::Tensor wf = at::empty({op.w.numel() / (int4 ? w_cols / 8 : w_cols), w_cols},
                            opts.dtype(at::kFloat));
  const CodeStats sw = codes_to_float_kernel(op.w.reshape({wf.size(0), -1}), int4, wf);
  int64_t bound = sa.row_l1_max * sw.absmax;
  if (op.w_trans) bound = std::min(bound, sw.row_l1_max * sa.absmax);
  const int64_t chunk = bound <= kExactFloatInt
                            ? k
                            : std::max<int64_t>(1, kExactFloatInt / (sa.absmax * sw.absmax));
  const float* pa = af.const_data_ptr<float>();
  const float* pw = wf.const_data_ptr<float>();
  if (chunk >= k) {  // one exact GEMM per batch, straight into the accumulator
    at::Tensor acc = at::empty({batches * m, n}, opts.dtype(at::kFloat));
    for (int64_t b = 0; b < batches; ++b) {
      blas::gemm<float, float>(false, op.w_trans, m, n, k, 1.f,
                               pa + batch_index(out_batch, a_batch, b) * m * k, k,
                               pw + batch_index(out_batch, w_batch, b) * k * n, w_cols, 0.f,
                               acc.mutable_data_ptr<float>() + b * m * n, n);
    }
    return acc;
  }
  at::Tensor acc = at::zeros({batches * m, n}, opts.dtype(at::kInt));
  at::Tensor partial = at::empty({m, n}, opts.dtype(at::kFloat));
  for (int64_t b = 0; b < batches; ++b) {
    const float* ab = pa + batch_index(out_batch, a_batch, b) * m * k;
    const float* wb = pw + batch_index(out_batch, w_batch, b) * k * n;
    at::Tensor acc_b = acc.narrow(0, b * m, m);
    for (int64_t k0 = 0; k0 < k; k0 += chunk) {
      const int64_t kc = std::min(chunk, k - k0);
      blas::gemm<float, float>(false, op.w_trans, m, n, kc, 1.f, ab + k0, k,
                               wb + (op.w_trans ? k0 : k0 * n), w_cols, 0.f,
                               partial.mutable_data_ptr<float>(), n);
      accumulate_chunk_kernel(acc_b, partial);
    }
  }
  return acc;
}

void quant_matmul_kernel(const QuantMatmulArgs& args, at::Tensor& out) {
  if (args.k == 0) {  // an empty sum: the accumulator is 0
    const at::Tensor acc = at::zeros({c10::multiply_integers(args.out_batch) * args.m, args.n},
                                     args.a.options().dtype(at::kInt));
    return quant_matmul_epilogue_kernel(acc, args.epilogue, out);
  }
  quant_matmul_epilogue_kernel(int_product(args), args.epilogue, out);
}

// ----------------------------------------------------------------------------- float operands

// The exact fp32 value of a hifloat8 code (quant_matmul.h, FloatCode::kHif8).
float hifloat8_value(uint8_t c) {
  if (c == 0x80) return std::numeric_limits<float>::quiet_NaN();
  const float sign = (c & 0x80) ? -1.f : 1.f;
  if ((c & 0x7F) == 0x6F) return sign * std::numeric_limits<float>::infinity();
  const int dot = (c >> 3) & 15;
  int d, mbits;  // exponent and mantissa widths
  if (dot >= 12) {
    d = 4, mbits = 1;
  } else if (dot >= 8) {
    d = 3, mbits = 2;
  } else if (dot >= 4) {
    d = 2, mbits = 3;
  } else if (dot >= 2) {
    d = 1, mbits = 3;
  } else if (dot == 1) {
    d = 0, mbits = 3;
  } else {  // subnormal: 2^(M - 23), M = 0 the zero
    const int mant = c & 7;
    return mant == 0 ? sign * 0.f : sign * std::ldexp(1.f, mant - 23);
  }
  const int mant = c & ((1 << mbits) - 1);
  int e = 0;
  if (d > 0) {
    const int field = (c >> mbits) & ((1 << d) - 1);  // sign-magnitude, implicit leading 1
    const int magnitude = (1 << (d - 1)) | (field & ((1 << (d - 1)) - 1));
    e = (field >> (d - 1)) ? -magnitude : magnitude;
  }
  return sign * std::ldexp(1.f + static_cast<float>(mant) / static_cast<float>(1 << mbits), e);
}

// The exact fp32 value of every float8_e4m3fn / float8_e5m2 byte (c10's conversions), of every
// hifloat8 byte, and of every float4_e2m1 nibble (sign, 2 exponent bits with bias 1, 1 mantissa
// bit) and float4_e1m2 one (sign, 1 exponent bit with bias 1, 2 mantissa bits: multiples of
// 0.25 up to 1.75).
struct CodeTables {
  float e4m3[256], e5m2[256], hif8[256], e2m1[16], e1m2[16];
  CodeTables() {
    for (int c = 0; c < 256; ++c) {
      const auto bits = static_cast<uint8_t>(c);
      e4m3[c] = static_cast<float>(c10::Float8_e4m3fn(bits, c10::Float8_e4m3fn::from_bits()));
      e5m2[c] = static_cast<float>(c10::Float8_e5m2(bits, c10::Float8_e5m2::from_bits()));
      hif8[c] = hifloat8_value(bits);
    }
    constexpr float kMagnitude[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
    for (int c = 0; c < 16; ++c) {
      e2m1[c] = (c & 8) ? -kMagnitude[c & 7] : kMagnitude[c & 7];
      e1m2[c] = (c & 8) ? -0.25f * static_cast<float>(c & 7) : 0.25f * static_cast<float>(c & 7);
    }
  }
};

const CodeTables& code_tables() {
  static const CodeTables tables;
  return tables;
}

// The values of a format's codes (256 entries, or 16 for float4).
const float* code_table(FloatCode code) {
  const CodeTables& t = code_tables();
  return code == FloatCode::kE4m3   ? t.e4m3
         : code == FloatCode::kE5m2 ? t.e5m2
         : code == FloatCode::kHif8 ? t.hif8
         : code == FloatCode::kE2m1 ? t.e2m1
                                    : t.e1m2;
}

// n float8 codes (e4m3fn / e5m2) at s to their fp32 values at d, equal to `table`'s (c10's
// conversions), 16 (8 on AVX2) at a time through float16: e5m2 is the top byte of a float16; an
// e4m3 magnitude shifted into a float16's exponent and mantissa fields reads as 2^-8 times its
// value, subnormals included (float16's subnormals are e4m3's, scaled), so one vcvtph2ps and a
// power-of-two product give it exactly; its NaN codes (0x7F, 0xFF) are taken from the table.
void decode_float8(bool e4m3, const uint8_t* s, float* d, int64_t n, const float* table) {
  int64_t c = 0;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#if defined(CPU_CAPABILITY_AVX512)
  constexpr int kLanes = 16;
  using F = __m512;
  const auto load = [](const uint8_t* p) {
    return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  };
  const auto to_float = [](__m256i h) { return _mm512_cvtph_ps(h); };
  const auto mul = [](F a, float b) { return _mm512_mul_ps(a, _mm512_set1_ps(b)); };
  const auto store = [](float* p, F v) { _mm512_storeu_ps(p, v); };
  using I = __m256i;
  const auto and16 = [](I a, int v) { return _mm256_and_si256(a, _mm256_set1_epi16(static_cast<short>(v))); };
  const auto or16 = [](I a, I b) { return _mm256_or_si256(a, b); };
  const auto shl16 = [](I a, int bits) { return _mm256_sll_epi16(a, _mm_cvtsi32_si128(bits)); };
  constexpr int kNanShift = 0;  // bit i of nan_lanes is lane i
  const auto nan_lanes = [](I mag) {
    return static_cast<uint32_t>(_mm256_cmpeq_epi16_mask(mag, _mm256_set1_epi16(0x7F)));
  };
#else
  constexpr int kLanes = 8;
  using F = __m256;
  const auto load = [](const uint8_t* p) {
    return _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  };
  const auto to_float = [](__m128i h) { return _mm256_cvtph_ps(h); };
  const auto mul = [](F a, float b) { return _mm256_mul_ps(a, _mm256_set1_ps(b)); };
  const auto store = [](float* p, F v) { _mm256_storeu_ps(p, v); };
  using I = __m128i;
  const auto and16 = [](I a, int v) { return _mm_and_si128(a, _mm_set1_epi16(static_cast<short>(v))); };
  const auto or16 = [](I a, I b) { return _mm_or_si128(a, b); };
  const auto shl16 = [](I a, int bits) { return _mm_sll_epi16(a, _mm_cvtsi32_si128(bits)); };
  constexpr int kNanShift = 1;  // bit 2i of nan_lanes is lane i (a byte mask of 16-bit lanes)
  const auto nan_lanes = [](I mag) {
    const auto m = static_cast<uint32_t>(_mm_movemask_epi8(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7F))));
    return m & 0x5555u;
  };
#endif
  for (; c + kLanes <= n; c += kLanes) {
    const I x = load(s + c);
    if (e4m3) {
      const I mag = and16(x, 0x7F);
      const F f = to_float(or16(shl16(mag, 7), shl16(and16(x, 0x80), 8)));
      store(d + c, mul(f, 256.0f));
      for (uint32_t nan = nan_lanes(mag); nan != 0; nan &= nan - 1) {
        const int64_t i = c + (__builtin_ctz(nan) >> kNanShift);
        d[i] = table[s[i]];
      }
    } else {
      store(d + c, to_float(shl16(x, 8)));
    }
  }
#endif
  for (; c < n; ++c) d[c] = table[s[c]];
}

// Rows [r0, r1) x columns [c0, c1) of batch b of an operand (FloatOperand), decoded to fp32 dst
// (row stride ld) and multiplied by their block scales; `k_cols`: K runs along the columns
// (x1 [m, k], x2 [n, k]). float4: c0 and c1 even (whole bytes).
void decode_rect(const FloatOperand& op, int64_t b, bool k_cols, int64_t r0, int64_t r1,
                 int64_t c0, int64_t c1, float* dst, int64_t ld) {
  constexpr int64_t kBlock = 32;
  const int64_t rows = op.rows, cols = op.cols;
  const bool fp4 = is_fp4(op.code);
  const int64_t row_bytes = fp4 ? cols / 2 : cols;
  const uint8_t* src = op.codes.const_data_ptr<uint8_t>() + b * rows * row_bytes;
  const float* table = code_table(op.code);
  const float* scale = nullptr;
  if (op.block_scale.defined()) {
    scale = op.block_scale.const_data_ptr<float>() +
            (op.block_scale.size(0) == 1 ? 0 : b) * op.block_scale.stride(0);
  }
  const int64_t col_blocks = (cols + kBlock - 1) / kBlock;
  const int64_t w = c1 - c0;
  for (int64_t r = r0; r < r1; ++r) {
    float* d = dst + (r - r0) * ld;
    const uint8_t* s = src + r * row_bytes;
    if (fp4) {
      for (int64_t c = c0 / 2; c < c1 / 2; ++c) {
        d[2 * c - c0] = table[s[c] & 15];
        d[2 * c + 1 - c0] = table[s[c] >> 4];
      }
    } else if (op.code == FloatCode::kE4m3 || op.code == FloatCode::kE5m2) {
      decode_float8(op.code == FloatCode::kE4m3, s + c0, d, w, table);
    } else {
      for (int64_t c = c0; c < c1; ++c) d[c - c0] = table[s[c]];
    }
    if (scale == nullptr) continue;
    if (k_cols) {  // scale [rows, ceil(cols / 32)]
      const float* sr = scale + r * col_blocks;
      for (int64_t blk = c0 / kBlock; blk * kBlock < c1; ++blk) {
        const float f = sr[blk];
        const int64_t e0 = std::max(c0, blk * kBlock), e1 = std::min(c1, (blk + 1) * kBlock);
        for (int64_t c = e0; c < e1; ++c) d[c - c0] *= f;
      }
    } else {  // scale [ceil(rows / 32), cols]
      const float* sr = scale + (r / kBlock) * cols + c0;
      for (int64_t c = 0; c < w; ++c) d[c] *= sr[c];
    }
  }
}

// A whole batch of an operand, decoded (decode_rect) to dst [rows, cols], rows over threads.
void decode_operand(const FloatOperand& op, int64_t b, bool k_cols, float* dst) {
  at::parallel_for(0, op.rows, grain_rows(op.cols), [&](int64_t begin, int64_t end) {
    decode_rect(op, b, k_cols, begin, end, 0, op.cols, dst + begin * op.cols, op.cols);
  });
}

// acc [m, n] (ldc n) = A [m, k] (fp32, decoded, lda) x W batch b, W decoded panel by panel:
// each thread takes column tiles of kTileN and, per kTileK rows of K, decodes W's panel into a
// buffer that stays in cache and adds its product (MKL sgemm, beta 1 after the first panel).
// W's codes are read once, at one byte (or half a byte) each, where decoding all of W writes and
// reads it back as fp32: the cost that dominates for few rows.
void tiled_float_gemm(const float* a, bool a_trans, int64_t lda, const FloatOperand& w,
                      int64_t b, int64_t m, int64_t k, int64_t n, float* acc) {
  constexpr int64_t kTileN = 128;
  constexpr int64_t kTileK = 512;
  const int64_t tiles = (n + kTileN - 1) / kTileN;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    blas::TileBuffer<float> panel(kTileK * kTileN);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t j0 = t * kTileN, tn = std::min(kTileN, n - j0);
      for (int64_t k0 = 0; k0 < k; k0 += kTileK) {
        const int64_t kc = std::min(kTileK, k - k0);
        if (!w.trans) {  // W [k, n]: rows k0.., columns j0..: panel [kc, tn]
          decode_rect(w, b, false, k0, k0 + kc, j0, j0 + tn, panel.data(), tn);
        } else {  // W [n, k]: rows j0.., columns k0..: panel [tn, kc]
          decode_rect(w, b, true, j0, j0 + tn, k0, k0 + kc, panel.data(), kc);
        }
        const float* ak = a + (a_trans ? k0 * lda : k0);
        blas::gemm<float, float>(a_trans, w.trans, m, tn, kc, 1.f, ak, lda, panel.data(),
                                 w.trans ? kc : tn, k0 == 0 ? 0.f : 1.f, acc + j0, n);
      }
    }
  });
}

// Batch b of W (FloatOperand, [k, n] or stored [n, k] when trans) decoded (decode_rect: MX
// block scales applied where W has them) into bf16 pairs along K, blas::vnni_gemm_bf16's B
// layout with ldb = n: the 32-bit word (kk / 2) * n + j holds W[kk, j] (low half) and
// W[kk + 1, j]; an odd k's last pair ends in 0. Exact: every code (e4m3, e5m2, hifloat8, e2m1,
// e1m2) decodes to a value of at most 4 significant bits, so its bf16 bits are its fp32 bits'
// high half, and a power-of-two block scale keeps that (what vdpbf16ps then does with values
// or products below fp32's normal range is bf16_gemm_exact's question).
// Decoded tile by tile into an fp32 panel that stays in cache (W is never written whole in
// fp32); a stored [n, k] tile becomes bf16 rows whose 32-bit pairs one 4-byte transpose
// (the confusion-transpose kernel) turns into pair rows.
void decode_w_pairs(const FloatOperand& w, int64_t b, int64_t k, int64_t n, uint32_t* out) {
  constexpr int64_t kTileN = 64, kTileK = 256;
  const int64_t tiles_n = (n + kTileN - 1) / kTileN, tiles_k = (k + kTileK - 1) / kTileK;
  transpose::PermuteCopyFn* transpose = transpose::permute_copy.cpu.get("npu_quant_matmul");
  at::parallel_for(0, tiles_n * tiles_k, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> panel(kTileK * kTileN);
    std::vector<uint32_t> staged(kTileK / 2 * kTileN), pairs(kTileK / 2 * kTileN);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t j0 = (t % tiles_n) * kTileN, k0 = (t / tiles_n) * kTileK;
      const int64_t tn = std::min(kTileN, n - j0), kc = std::min(kTileK, k - k0);
      const int64_t kc_pairs = (kc + 1) / 2;
      const auto bits = [](float v) {
        uint32_t u;
        std::memcpy(&u, &v, sizeof(u));
        return u;
      };
      if (!w.trans) {  // panel [kc, tn]: rows kk and kk + 1 interleaved
        decode_rect(w, b, false, k0, k0 + kc, j0, j0 + tn, panel.data(), tn);
        if (kc % 2 != 0) std::fill_n(panel.data() + kc * tn, tn, 0.f);
        for (int64_t q = 0; q < kc_pairs; ++q) {
          const float* lo = panel.data() + 2 * q * tn;
          const float* hi = lo + tn;
          uint32_t* o = out + (k0 / 2 + q) * n + j0;
          for (int64_t j = 0; j < tn; ++j) o[j] = bits(lo[j]) >> 16 | (bits(hi[j]) & 0xFFFF0000u);
        }
        continue;
      }
      // panel [tn, kc]: each row's adjacent pairs are already the words; [tn, kc_pairs] of them
      // transposed to [kc_pairs, tn]
      decode_rect(w, b, true, j0, j0 + tn, k0, k0 + kc, panel.data(), kc);
      for (int64_t j = 0; j < tn; ++j) {
        const float* row = panel.data() + j * kc;
        uint32_t* o = staged.data() + j * kc_pairs;
        for (int64_t q = 0; q < kc / 2; ++q) {
          o[q] = bits(row[2 * q]) >> 16 | (bits(row[2 * q + 1]) & 0xFFFF0000u);
        }
        if (kc % 2 != 0) o[kc / 2] = bits(row[kc - 1]) >> 16;
      }
      transpose(reinterpret_cast<const char*>(staged.data()), reinterpret_cast<char*>(pairs.data()),
                {4, 1, {kc_pairs, tn}, {1, kc_pairs}});
      for (int64_t q = 0; q < kc_pairs; ++q) {
        std::copy_n(pairs.data() + q * tn, tn, out + (k0 / 2 + q) * n + j0);
      }
    }
  });
}

// Per-block float32 scales (FloatBlockScales, quant_matmul.h): A [m, k] and W [k, n] decoded
// whole (exact, unscaled) and, per output tile of kBlockTileM x kBlockTileN over the threads and
// per K block in order, the block's fp32 product P (MKL sgemm of depth gk, beta 0) folded into
// the tile as acc = acc + fp32(fp32(P * s1[i / gm, kb]) * s2[kb, j / gn]), each product rounded
// to fp32 before the add (no fused multiply-add), as the golden's float32 tensors compute it.
void block_scaled_float_gemm(const FloatQuantMatmulArgs& p, const float* af, const float* wf,
                             const c10::BFloat16* a16, const uint32_t* w_pairs, float* acc_all) {
  // Output tiles of 256 x 256: each K block's product is one sgemm of depth gk per tile, and
  // larger tiles run those at a better rate (the panel, 256 KiB, stays in L2).
  constexpr int64_t kBlockTileM = 256, kBlockTileN = 256;
  const FloatBlockScales& bs = p.block;
  const int64_t m = p.m, k = p.k, n = p.n, gm = bs.gm, gn = bs.gn, gk = bs.gk;
  const int64_t ms = (m + gm - 1) / gm, ks = (k + gk - 1) / gk, ns = (n + gn - 1) / gn;
  const int64_t batches = c10::multiply_integers(p.out_batch);
  const int64_t tiles_m = (m + kBlockTileM - 1) / kBlockTileM;
  const int64_t tiles_n = (n + kBlockTileN - 1) / kBlockTileN;
  const float* s1_all = bs.x1_block.const_data_ptr<float>();
  const float* s2_all = bs.x2_block.const_data_ptr<float>();
  const bool s1_batched = bs.x1_block.size(0) > 1, s2_batched = bs.x2_block.size(0) > 1;
  at::parallel_for(0, batches * tiles_m * tiles_n, 1, [&](int64_t begin, int64_t end) {
    blas::TileBuffer<float> panel(kBlockTileM * kBlockTileN);
    float s2row[kBlockTileN];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / (tiles_m * tiles_n), r = t % (tiles_m * tiles_n);
      const int64_t i0 = (r / tiles_n) * kBlockTileM, j0 = (r % tiles_n) * kBlockTileN;
      const int64_t tm = std::min(kBlockTileM, m - i0), tn = std::min(kBlockTileN, n - j0);
      const int64_t ab = batch_index(p.out_batch, p.a_batch, b);
      const int64_t wb = batch_index(p.out_batch, p.w_batch, b);
      const float* a = a16 == nullptr ? af + ab * m * k : nullptr;
      const float* w = w_pairs == nullptr ? wf + wb * k * n : nullptr;
      const float* s1 = s1_all + (s1_batched ? ab : 0) * ms * ks;
      const float* s2 = s2_all + (s2_batched ? wb : 0) * ks * ns;
      float* acc = acc_all + b * m * n;
      for (int64_t i = 0; i < tm; ++i) std::fill_n(acc + (i0 + i) * n + j0, tn, 0.f);
      for (int64_t kb = 0; kb < ks; ++kb) {
        const int64_t k0 = kb * gk, kc = std::min(gk, k - k0);
        // In memory orientation: A [m, k] (lda k) or, transposed, [k, m] (lda m); W alike.
        if (w_pairs != nullptr) {  // bf16 operands (exact), kc rounded up to a pair
          const int64_t kp = k + k % 2;
          blas::vnni_gemm_bf16(tm, tn, kc + kc % 2, kp, n, tn, false, a16 + (ab * m + i0) * kp + k0,
                               reinterpret_cast<const c10::BFloat16*>(
                                   w_pairs + (wb * (kp / 2) + k0 / 2) * n + j0),
                               panel.data());
        } else {
          const float* ak = p.a.trans ? a + k0 * m + i0 : a + i0 * k + k0;
          const float* wk = p.w.trans ? w + j0 * k + k0 : w + k0 * n + j0;
          blas::gemm<float, float>(p.a.trans, p.w.trans, tm, tn, kc, 1.f, ak, p.a.cols, wk,
                                   p.w.cols, 0.f, panel.data(), tn);
        }
        for (int64_t j = 0; j < tn; ++j) s2row[j] = s2[kb * ns + (j0 + j) / gn];
        for (int64_t i = 0; i < tm; ++i) {
          const float f1 = s1[((i0 + i) / gm) * ks + kb];
          const Vec v1(f1);
          float* ar = acc + (i0 + i) * n + j0;
          const float* pr = panel.data() + i * tn;
          int64_t j = 0;
          for (; j + Vec::size() <= tn; j += Vec::size()) {
            const Vec scaled = rounded(rounded(Vec::loadu(pr + j) * v1) * Vec::loadu(s2row + j));
            (Vec::loadu(ar + j) + scaled).store(ar + j);
          }
          for (; j < tn; ++j) ar[j] = ar[j] + rounded(rounded(pr[j] * f1) * s2row[j]);
        }
      }
    }
  });
}

// A (decoded, fp32 [batches, m, k], or [batches, k, m] when a.trans) as bf16 rows of
// kp = k rounded up to even elements (zero-padded), blas::vnni_gemm_bf16's A layout. Exact for
// the decoded codes (see decode_w_pairs).
std::vector<c10::BFloat16> bf16_rows(const FloatQuantMatmulArgs& p, const float* a, int64_t kp) {
  const int64_t m = p.m, k = p.k;
  std::vector<c10::BFloat16> a16(p.a.batches * m * kp, c10::BFloat16(0.f));
  at::parallel_for(0, p.a.batches * m, grain_rows(k), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / m, i = r % m;
      for (int64_t kk = 0; kk < k; ++kk) {
        a16[r * kp + kk] = p.a.trans ? a[(b * k + kk) * m + i] : a[r * k + kk];
      }
    }
  });
  return a16;
}

// Every batch of W as bf16 pairs (decode_w_pairs), [w.batches, kp / 2, n] words.
at::Tensor w_bf16_pairs(const FloatQuantMatmulArgs& p, int64_t kp) {
  const int64_t n = p.n;
  // every word is written by decode_w_pairs (no zero fill)
  at::Tensor pairs = at::empty({p.w.batches * (kp / 2) * n}, p.w.codes.options().dtype(at::kInt));
  uint32_t* wp = reinterpret_cast<uint32_t*>(pairs.mutable_data_ptr<int32_t>());
  for (int64_t b = 0; b < p.w.batches; ++b) decode_w_pairs(p.w, b, p.k, n, wp + b * (kp / 2) * n);
  return pairs;
}

// Whether A @ W (decoded, MX block scales applied) computed on bf16 operands by vdpbf16ps, which
// reads subnormal inputs as 0 and flushes subnormal results, is the same fp32-accumulated GEMM
// as sgemm's. Every decoded value is a multiple of 2^lsb (the code format's smallest nonzero
// magnitude times the smallest block scale), so every product and partial sum is a multiple of
// 2^(lsb_a + lsb_w): with lsb_a + lsb_w >= -126 none is subnormal. And no sum may overflow where
// the other order might not: |a|, |w| < 2^top, k products.
bool bf16_gemm_exact(const FloatQuantMatmulArgs& p) {
  const auto range = [&](const FloatOperand& op, int& lsb, int& top) {
    const float* table = code_table(op.code);
    float lo = std::numeric_limits<float>::infinity(), hi = 0.f;
    for (int c = 0; c < (is_fp4(op.code) ? 16 : 256); ++c) {
      const float v = std::fabs(table[c]);
      if (std::isfinite(v) && v > 0.f) lo = std::min(lo, v), hi = std::max(hi, v);
    }
    lsb = std::ilogb(lo);  // a power of two: every value is a multiple of it
    top = std::ilogb(hi) + 1;
    if (!op.block_scale.defined() || op.block_scale.numel() == 0) return true;
    // the scales (powers of two, contiguous fp32): a NaN or zero one keeps sgemm's path
    const float* sc = op.block_scale.const_data_ptr<float>();
    float smin = std::numeric_limits<float>::infinity(), smax = 0.f;
    for (int64_t i = 0; i < op.block_scale.numel(); ++i) {
      if (!(sc[i] > 0.f && std::isfinite(sc[i]))) return false;
      smin = std::min(smin, sc[i]);
      smax = std::max(smax, sc[i]);
    }
    lsb += std::ilogb(smin);
    top += std::ilogb(smax);
    return true;
  };
  int lsb_a, top_a, lsb_w, top_w;
  if (!range(p.a, lsb_a, top_a) || !range(p.w, lsb_w, top_w)) return false;
  const int log2_k = std::ilogb(static_cast<float>(std::max<int64_t>(p.k, 1))) + 1;
  return lsb_a + lsb_w >= -126 && top_a + top_w + log2_k < 127;
}

// Up to this many rows of x1 per batch W is decoded panel by panel (tiled_float_gemm); above,
// whole, and MKL's threads run one large GEMM per batch.
constexpr int64_t kTiledFloatRows = 512;
// From this many rows of x1 the product runs on bf16 operands where the CPU has AVX512_BF16 (and
// bf16_gemm_exact holds); below, decoding W (whole, as bf16 pairs) costs more than it saves.
constexpr int64_t kBf16FloatRows = 128;

// See FloatQuantMatmulArgs (quant_matmul.h): x1 decoded and block-scaled in fp32 (each of its
// batches once); from kBf16FloatRows rows on AVX512_BF16 CPUs (where bf16_gemm_exact holds), both
// operands as bf16 into vdpbf16ps tiles; otherwise for few rows W decoded panel by panel in cache
// (tiled_float_gemm), else whole, and one MKL sgemm per output batch (with the operands'
// transposes) into an fp32 accumulator; then the epilogue.
void float_quant_matmul_kernel(const FloatQuantMatmulArgs& p, at::Tensor& out) {
  const int64_t batches = c10::multiply_integers(p.out_batch);
  const int64_t m = p.m, k = p.k, n = p.n;
  const auto opts = p.a.codes.options().dtype(at::kFloat);
  auto decoded = [&](const FloatOperand& op, bool k_cols) {
    at::Tensor f = at::empty({op.batches, op.rows, op.cols}, opts);
    for (int64_t b = 0; b < op.batches; ++b) {
      decode_operand(op, b, k_cols, f.mutable_data_ptr<float>() + b * op.rows * op.cols);
    }
    return f;
  };
  at::Tensor acc = at::empty({batches * m, n}, opts);
  if (k == 0) {
    acc.zero_();
  } else if (p.block.x1_block.defined()) {
    const at::Tensor af = decoded(p.a, !p.a.trans);
    if (has_avx512_bf16() && p.block.gk % 2 == 0) {
      // bf16 operands (the decoded codes exactly) into vdpbf16ps, whose products are exact in
      // fp32 and summed in fp32 as sgemm's are (the order aside; no product or partial sum of
      // these codes is an fp32 subnormal, which the instruction would flush): twice sgemm's
      // rate on a Zen 4. A as bf16 rows of kp = k rounded up to even elements.
      const int64_t kp = k + k % 2;
      const std::vector<c10::BFloat16> a16 = bf16_rows(p, af.const_data_ptr<float>(), kp);
      const at::Tensor w_pairs = w_bf16_pairs(p, kp);
      block_scaled_float_gemm(
          p, nullptr, nullptr, a16.data(),
          reinterpret_cast<const uint32_t*>(w_pairs.const_data_ptr<int32_t>()),
          acc.mutable_data_ptr<float>());
      return quant_matmul_epilogue_kernel(acc, p.epilogue, out);
    }
    const at::Tensor wf = decoded(p.w, p.w.trans);
    block_scaled_float_gemm(p, af.const_data_ptr<float>(), wf.const_data_ptr<float>(), nullptr,
                            nullptr, acc.mutable_data_ptr<float>());
  } else {
    const at::Tensor af = decoded(p.a, !p.a.trans);
    if (m >= kBf16FloatRows && has_avx512_bf16() && bf16_gemm_exact(p)) {
      // bf16 operands into vdpbf16ps (as the per-block path above), output tiles over the threads
      constexpr int64_t kTileM = 128, kTileN = 256;
      const int64_t kp = k + k % 2;
      const std::vector<c10::BFloat16> a16 = bf16_rows(p, af.const_data_ptr<float>(), kp);
      const at::Tensor w_pairs = w_bf16_pairs(p, kp);
      const auto* w16 = reinterpret_cast<const c10::BFloat16*>(w_pairs.const_data_ptr<int32_t>());
      const int64_t tiles_m = (m + kTileM - 1) / kTileM, tiles_n = (n + kTileN - 1) / kTileN;
      float* c = acc.mutable_data_ptr<float>();
      at::parallel_for(0, batches * tiles_m * tiles_n, 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const int64_t b = t / (tiles_m * tiles_n), r = t % (tiles_m * tiles_n);
          const int64_t i0 = (r / tiles_n) * kTileM, j0 = (r % tiles_n) * kTileN;
          const int64_t ab = batch_index(p.out_batch, p.a_batch, b);
          const int64_t wb = batch_index(p.out_batch, p.w_batch, b);
          blas::vnni_gemm_bf16(std::min(kTileM, m - i0), std::min(kTileN, n - j0), kp, kp, n, n,
                               false, a16.data() + (ab * m + i0) * kp,
                               w16 + 2 * (wb * (kp / 2) * n + j0), c + (b * m + i0) * n + j0);
        }
      });
      return quant_matmul_epilogue_kernel(acc, p.epilogue, out);
    }
    if (m <= kTiledFloatRows) {
      for (int64_t b = 0; b < batches; ++b) {
        tiled_float_gemm(
            af.const_data_ptr<float>() + batch_index(p.out_batch, p.a_batch, b) * m * k,
            p.a.trans, p.a.cols, p.w, batch_index(p.out_batch, p.w_batch, b), m, k, n,
            acc.mutable_data_ptr<float>() + b * m * n);
      }
      return quant_matmul_epilogue_kernel(acc, p.epilogue, out);
    }
    const at::Tensor wf = decoded(p.w, p.w.trans);
    for (int64_t b = 0; b < batches; ++b) {
      blas::gemm<float, float>(
          p.a.trans, p.w.trans, m, n, k, 1.f,
          af.const_data_ptr<float>() + batch_index(p.out_batch, p.a_batch, b) * m * k, p.a.cols,
          wf.const_data_ptr<float>() + batch_index(p.out_batch, p.w_batch, b) * k * n, p.w.cols,
          0.f, acc.mutable_data_ptr<float>() + b * m * n, n);
    }
  }
  quant_matmul_epilogue_kernel(acc, p.epilogue, out);
}

void pack_int4_kernel(const at::Tensor& weight, at::Tensor& packed) {
  const int64_t words = packed.numel();
  const int32_t* in = weight.const_data_ptr<int32_t>();
  int32_t* out = packed.mutable_data_ptr<int32_t>();
  at::parallel_for(0, words, int64_t{1} << 14, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      uint32_t word = 0;
      for (int k = 0; k < 8; ++k) {
        word |= (static_cast<uint32_t>(in[8 * i + k]) & 0xFu) << (4 * k);
      }
      out[i] = static_cast<int32_t>(word);
    }
  });
}

// ----------------------------------------------------------------------------- A8W4

// a | b rounded to float16 and back (round to nearest even; beyond the range: inf), as numpy's
// astype(np.float16) rounds the golden's float32 values.
inline void round_to_half(Vec& a, Vec& b) {
  const auto h = at::vec::convert_from_float<c10::Half>(a, b);
  std::tie(a, b) = at::vec::convert_to_float<c10::Half>(h);
}

// See A8W4Args (quant_matmul.h). Like tiled_int_gemm_kernel, each thread takes column tiles of
// the output, kTileN wide: per K group it converts the tile's int4 weight rows to fp32 in a panel
// that stays in cache (W is read once, at half a byte per code), multiplies the split codes by it
// with MKL's sgemm, and folds the product into the tile's float16 accumulator; then it writes the
// tile's outputs. The products are exact: |hi|, |lo|, |w| <= 8, so every partial sum is an
// integer of at most 64 * group_size <= 2^24 (the entry points bound group_size), in any order
// and across the kChunkK-deep pieces of a long group (summed by sgemm's beta = 1).
template <typename scalar_t>
void a8w4_tiles(const A8W4Args& p, const float* xs, scalar_t* out) {
  constexpr int64_t kTileN = 128;
  constexpr int64_t kChunkK = 512;
  const int64_t m = p.m, k = p.k, n = p.n, gs = p.group_size, groups = k / gs;
  const int64_t rows = 2 * m, tiles = (n + kTileN - 1) / kTileN;
  const int32_t* w4 = p.w.const_data_ptr<int32_t>();
  const float* scale = p.scale.const_data_ptr<float>();
  const float* bias = p.bias.defined() ? p.bias.const_data_ptr<float>() : nullptr;
  const float* token = p.pertoken.defined() ? p.pertoken.const_data_ptr<float>() : nullptr;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    blas::TileBuffer<float> panel(std::min(gs, kChunkK) * kTileN), part(rows * kTileN),
        acc(rows * kTileN);
    int32_t amax = 0;  // unused
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t j0 = t * kTileN, tn = std::min(kTileN, n - j0);  // multiples of 8
      std::fill(acc.data(), acc.data() + rows * tn, 0.f);
      for (int64_t g = 0; g < groups; ++g) {
        for (int64_t c0 = 0; c0 < gs; c0 += kChunkK) {
          const int64_t kc = std::min(kChunkK, gs - c0), k0 = g * gs + c0;
          for (int64_t r = 0; r < kc; ++r) {
            int4_to_float(w4 + (k0 + r) * (n / 8) + j0 / 8, panel.data() + r * tn, tn / 8, amax);
          }
          blas::gemm<float, float>(false, false, rows, tn, kc, 1.f, xs + k0, k, panel.data(), tn,
                                   c0 == 0 ? 0.f : 1.f, part.data(), tn);
        }
        // acc = fp16(acc + fp16(product * scale)): the golden's float16 accumulation
        const float* srow = scale + g * n + j0;
        for (int64_t r = 0; r < rows; ++r) {
          float* arow = acc.data() + r * tn;
          const float* prow = part.data() + r * tn;
          for_each_step<float>(tn, [&](int64_t j, int64_t len) {
            Vec pa, pb, sa, sb, aa, ab;
            FloatIO::load(prow + j, pa, pb, len);
            FloatIO::load(srow + j, sa, sb, len);
            FloatIO::load(arow + j, aa, ab, len);
            Vec ta = pa * sa, tb = pb * sb;
            round_to_half(ta, tb);
            aa = aa + ta;  // formed in fp32 and rounded, as numpy adds float16
            ab = ab + tb;
            round_to_half(aa, ab);
            FloatIO::store(arow + j, aa, ab, len);
          });
        }
      }
      // y = (acc_hi * 16 + acc_lo (+ bias)) (* pertoken) in fp32, rounded once
      const Vec sixteen(16.f);
      for (int64_t i = 0; i < m; ++i) {
        const float* hi = acc.data() + 2 * i * tn;
        const float* lo = hi + tn;
        const Vec tok(token != nullptr ? token[i] : 1.f);
        for_each_step<float>(tn, [&](int64_t j, int64_t len) {
          Vec ha, hb, la, lb;
          FloatIO::load(hi + j, ha, hb, len);
          FloatIO::load(lo + j, la, lb, len);
          Vec ya = ha * sixteen + la, yb = hb * sixteen + lb;  // * 16 is exact: FMA or not
          if (bias != nullptr) {
            Vec ba, bb;
            FloatIO::load(bias + j0 + j, ba, bb, len);
            ya = ya + ba;
            yb = yb + bb;
          }
          if (token != nullptr) {
            ya = ya * tok;
            yb = yb * tok;
          }
          VecPair<scalar_t>::store(out + i * n + j0 + j, ya, yb, len);
        });
      }
    }
  });
}

void a8w4_matmul_kernel(const A8W4Args& p, at::Tensor& out) {
  const int64_t m = p.m, k = p.k;
  // The split codes as fp32: row 2i is hi = floor(x / 16) of x's row i, row 2i + 1 its
  // lo = (x & 15) - 8 (the golden's order).
  blas::TileBuffer<float> xs(2 * m * k);
  const int8_t* px = p.x.const_data_ptr<int8_t>();
  float* ps = xs.data();
  at::parallel_for(0, m, grain_rows(k), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t c = 0; c < k; ++c) {
        const int32_t v = px[i * k + c];
        ps[2 * i * k + c] = static_cast<float>(v >> 4);
        ps[(2 * i + 1) * k + c] = static_cast<float>((v & 15) - 8);
      }
    }
  });
  AT_DISPATCH_SWITCH(out.scalar_type(), "npu_quant_matmul",
      AT_DISPATCH_CASE(at::kFloat, [&] { a8w4_tiles<scalar_t>(p, ps, out.mutable_data_ptr<scalar_t>()); })
      AT_DISPATCH_CASE(at::kHalf, [&] { a8w4_tiles<scalar_t>(p, ps, out.mutable_data_ptr<scalar_t>()); })
      AT_DISPATCH_CASE(at::kBFloat16,
                       [&] { a8w4_tiles<scalar_t>(p, ps, out.mutable_data_ptr<scalar_t>()); }));
}

}  // namespace

OPENNPU_REGISTER_CPU_SLOT(quant_matmul, &quant_matmul_kernel);
OPENNPU_REGISTER_CPU_SLOT(pack_int4, &pack_int4_kernel);
OPENNPU_REGISTER_CPU_SLOT(unpack_int4, &unpack_int4_kernel);
OPENNPU_REGISTER_CPU_SLOT(a8w4_matmul, &a8w4_matmul_kernel);
OPENNPU_REGISTER_CPU_SLOT(float_quant_matmul, &float_quant_matmul_kernel);

}  // namespace CPU_CAPABILITY
}  // namespace opennpu::quant
