// CPU kernel of npu_grouped_matmul (compiled once per ISA; see common/cpu_dispatch.h and
// grouped_matmul.h for the plan).
//
// Tiles: every group's output is cut into blocks of at most kRowTile x kColTile; the threads take
// tiles from a shared counter (largest groups' tiles first, so the run ends on small ones). Each
// tile is one BLAS call run on the calling thread (MKL uses one thread inside a parallel region),
// then the epilogue: + bias, and for fp16 / bf16 the single rounding of the fp32 tile into the
// output. A tile of kRowTile x kColTile fp32 values (512 KB) stays in L2 between the two.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/Utils.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <tuple>
#include <vector>

#include "common/blas.h"
#include "common/half_gemm.h"
#include "common/vec.h"
#include "ops/moe/grouped_matmul.h"
#include "ops/quant/int_codes.h"

namespace opennpu::moe {
inline namespace CPU_CAPABILITY {
namespace {

constexpr int64_t kRowTile = 256;
constexpr int64_t kColTile = 512;

struct Tile {
  int64_t group, r0, c0;
};

// Whether fp16 / bf16 tiles go to MKL's half-precision GEMMs (fp32 accumulation and output):
// where the CPU GEMM policy keeps them in their dtype (common/half_gemm.h, through
// blas::half_gemm_available). Elsewhere, and with OPENNPU_GMM_HALF_GEMM=0, the tiles' operands
// are converted to fp32 for sgemm, with the same fp32 accumulation and single rounding.
bool use_half_gemm(at::ScalarType dtype) {
  static const bool enabled = [] {
    const char* env = std::getenv("OPENNPU_GMM_HALF_GEMM");
    return env == nullptr || std::strcmp(env, "0") != 0;
  }();
  return enabled && blas::half_gemm_available(dtype);
}

// The float paths' plan (GroupedGemmPlan).
//
// whole_aten: fp32 / fp16 / bf16 groups without bias go to ATen's GEMM (MKL for fp32; oneDNN,
// AMX where the CPU has it, for fp16 / bf16, accumulating in fp32 and rounding once as the tiles
// do) where the CPU multiplies their dtype natively (measured faster than the tiles at every
// group size tried: docs/performance.md). Where the CPU GEMM policy sends fp16 / bf16 to fp32
// (common/half_gemm.h: a CPU without their arithmetic, where ATen emulates it), they take the
// tiles, which convert each tile's operands to fp32 (use_half_gemm); a bias always does.
//
// antiquant_fp32: the weight-only path multiplies fp32 copies wherever the CPU GEMM policy says
// fp32 and, under OPENNPU_HALF_GEMM=auto, also on CPUs without AMX (e.g. an AMD Zen 4 with
// AVX512_BF16: the dequantised weight is made once per call, and its fp32 GEMM was faster there).
// OPENNPU_HALF_GEMM=native / fp32 force it either way.
GroupedGemmPlan grouped_gemm_plan_kernel(at::ScalarType dtype) {
  GroupedGemmPlan plan;
  const bool half = dtype == at::kHalf || dtype == at::kBFloat16;
  plan.whole_aten = dtype == at::kFloat;
  if (!half) return plan;  // fp32 / fp64: nothing to convert (and the weight-only path is half)
  const HalfGemmSetting setting = half_gemm_setting();  // read once per call
  const bool fp32 = setting == HalfGemmSetting::kFp32 ||
                    (setting == HalfGemmSetting::kAuto && !cpu_multiplies_natively(dtype));
  plan.whole_aten = !fp32;
  plan.antiquant_fp32 = setting == HalfGemmSetting::kAuto ? fp32 || !at::cpu::init_amx() : fp32;
  return plan;
}

// out[r, :] = acc[r, :] (+ bias), rounded once to scalar_t; acc may alias out (fp32 / fp64).
template <typename scalar_t>
void epilogue(const acc_t<scalar_t>* acc, int64_t ldacc, const acc_t<scalar_t>* bias, int64_t m,
              int64_t n, scalar_t* out, int64_t ldout) {
  using T = acc_t<scalar_t>;
  using Vec = AccVec<scalar_t>;
  using AccIO = VecPair<T>;
  using IO = VecPair<scalar_t>;
  for (int64_t r = 0; r < m; ++r) {
    const T* a_row = acc + r * ldacc;
    scalar_t* o_row = out + r * ldout;
    for_each_step<scalar_t>(n, [&](int64_t c, int64_t len) {
      Vec a, b;
      AccIO::load(a_row + c, a, b, len);
      if (bias != nullptr) {
        Vec ba, bb;
        AccIO::load(bias + c, ba, bb, len);
        a = a + ba;
        b = b + bb;
      }
      IO::store(o_row + c, a, b, len);
    });
  }
}

// Copies an operand block stored as `rows` rows of `cols` scalar_t (row stride ld) into a dense
// float block (row stride cols).
template <typename scalar_t>
void to_float(const scalar_t* src, int64_t ld, int64_t rows, int64_t cols, float* dst) {
  using Vec = AccVec<scalar_t>;
  using IO = VecPair<scalar_t>;
  for (int64_t r = 0; r < rows; ++r) {
    for_each_step<scalar_t>(cols, [&](int64_t c, int64_t len) {
      Vec a, b;
      IO::load(src + r * ld + c, a, b, len);
      VecPair<float>::store(dst + r * cols + c, a, b, len);
    });
  }
}

// Per-thread scratch: the fp32 output tile, and the fp32 operand copies of the fallback path.
struct Scratch {
  blas::TileBuffer<float> acc, a, b;
};

template <typename scalar_t>
void run_tile(const GemmGroup& g, const Tile& t, bool half_gemm, Scratch& s) {
  using T = acc_t<scalar_t>;
  const int64_t m = std::min(kRowTile, g.m - t.r0);
  const int64_t n = std::min(kColTile, g.n - t.c0);
  const auto* a = static_cast<const scalar_t*>(g.a) + (g.ta ? t.r0 : t.r0 * g.lda);
  const auto* b = static_cast<const scalar_t*>(g.b) + (g.tb ? t.c0 * g.ldb : t.c0);
  auto* out = static_cast<scalar_t*>(g.out) + t.r0 * g.ldout + t.c0;
  const T* bias = g.bias != nullptr ? static_cast<const T*>(g.bias) + t.c0 : nullptr;
  if constexpr (std::is_same_v<scalar_t, T>) {
    // fp32 / fp64: straight into the output, then the bias in place.
    blas::gemm<scalar_t, T>(g.ta, g.tb, m, n, g.k, T(1), a, g.lda, b, g.ldb, T(0), out, g.ldout);
    if (bias != nullptr) epilogue<scalar_t>(out, g.ldout, bias, m, n, out, g.ldout);
  } else {
    if (s.acc.size() < kRowTile * kColTile) s.acc = blas::TileBuffer<float>(kRowTile * kColTile);
    float* acc = s.acc.data();
    if (half_gemm) {
      blas::gemm<scalar_t, float>(g.ta, g.tb, m, n, g.k, 1.f, a, g.lda, b, g.ldb, 0.f, acc, n);
    } else {
      // The operands as stored (transposed or not), converted to dense fp32 blocks.
      const int64_t a_rows = g.ta ? g.k : m, a_cols = g.ta ? m : g.k;
      const int64_t b_rows = g.tb ? n : g.k, b_cols = g.tb ? g.k : n;
      if (s.a.size() < a_rows * a_cols) s.a = blas::TileBuffer<float>(a_rows * a_cols);
      if (s.b.size() < b_rows * b_cols) s.b = blas::TileBuffer<float>(b_rows * b_cols);
      to_float(a, g.lda, a_rows, a_cols, s.a.data());
      to_float(b, g.ldb, b_rows, b_cols, s.b.data());
      blas::gemm<float, float>(g.ta, g.tb, m, n, g.k, 1.f, s.a.data(), std::max<int64_t>(a_cols, 1),
                               s.b.data(), std::max<int64_t>(b_cols, 1), 0.f, acc, n);
    }
    epilogue<scalar_t>(acc, n, bias, m, n, out, g.ldout);
  }
}

void grouped_gemm_kernel(at::ScalarType dtype, c10::ArrayRef<GemmGroup> groups) {
  // Tiles of the largest groups first (by rows x k), row blocks outer so consecutive tiles of one
  // thread share the rows of a.
  std::vector<int64_t> by_size(groups.size());
  for (size_t i = 0; i < groups.size(); ++i) by_size[i] = static_cast<int64_t>(i);
  std::stable_sort(by_size.begin(), by_size.end(), [&](int64_t x, int64_t y) {
    return groups[x].m * groups[x].k > groups[y].m * groups[y].k;
  });
  std::vector<Tile> tiles;
  for (int64_t gi : by_size) {
    const GemmGroup& g = groups[gi];
    for (int64_t r0 = 0; r0 < g.m; r0 += kRowTile) {
      for (int64_t c0 = 0; c0 < g.n; c0 += kColTile) tiles.push_back({gi, r0, c0});
    }
  }
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
  if (num_tiles == 0) return;
  const bool half_gemm = use_half_gemm(dtype);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "npu_grouped_matmul", [&] {
    std::atomic<int64_t> next{0};
    const int64_t threads = std::min<int64_t>(at::get_num_threads(), num_tiles);
    at::parallel_for(0, std::max<int64_t>(threads, 1), 1, [&](int64_t, int64_t) {
      Scratch scratch;
      for (int64_t t = next.fetch_add(1); t < num_tiles; t = next.fetch_add(1)) {
        run_tile<scalar_t>(groups[tiles[t].group], tiles[t], half_gemm, scratch);
      }
    });
  });
}

// (code + offset) * scale over one step of a row: fp32, with the sum rounded to fp16 first for
// fp16 (see grouped_matmul.h), rounded once to scalar_t and stored as scalar_t or, for out_t
// float, as the fp32 value of that rounding.
template <typename scalar_t, typename out_t>
OPENNPU_VEC_INLINE void dequant_step(const float* codes, const AccVec<scalar_t>& s0,
                                     const AccVec<scalar_t>& s1, const AccVec<scalar_t>* o0,
                                     const AccVec<scalar_t>* o1, out_t* out, int64_t len) {
  using Vec = AccVec<scalar_t>;
  Vec a, b;
  VecPair<float>::load(codes, a, b, len);
  if (o0 != nullptr) {
    a = a + *o0;
    b = b + *o1;
    if constexpr (std::is_same_v<scalar_t, c10::Half>) {
      std::tie(a, b) = at::vec::convert_to_float<c10::Half>(at::vec::convert_from_float<c10::Half>(a, b));
    }
  }
  a = a * s0;
  b = b * s1;
  if constexpr (std::is_same_v<out_t, float>) {
    std::tie(a, b) = at::vec::convert_to_float<scalar_t>(at::vec::convert_from_float<scalar_t>(a, b));
    VecPair<float>::store(out, a, b, len);
  } else {
    VecPair<scalar_t>::store(out, a, b, len);
  }
}

template <typename scalar_t, typename out_t>
void antiquant_typed(const at::Tensor& codes, bool int4, bool k_on_rows, const at::Tensor& scale,
                     const at::Tensor& offset, int64_t group_size, at::Tensor& out) {
  using Vec = AccVec<scalar_t>;
  constexpr int64_t kStep = VecPair<scalar_t>::kStep;
  const int64_t rows = out.size(0), cols = out.size(1), n = scale.size(1);
  const void* pc = codes.const_data_ptr();
  const float* ps = scale.const_data_ptr<float>();
  const float* po = offset.defined() ? offset.const_data_ptr<float>() : nullptr;
  out_t* pout = out.mutable_data_ptr<out_t>();
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(cols);
    for (int64_t r = begin; r < end; ++r) {
      quant::codes_row_to_float(
          static_cast<const char*>(pc) + r * (int4 ? cols / 2 : cols), int4, cols, buf.data());
      out_t* o_row = pout + r * cols;
      if (k_on_rows) {  // row r is k: the scale row of its group, one channel per column
        const float* s = ps + (r / group_size) * n;
        const float* o = po != nullptr ? po + (r / group_size) * n : nullptr;
        for_each_step<scalar_t>(cols, [&](int64_t c, int64_t len) {
          Vec s0, s1, o0, o1;
          VecPair<float>::load(s + c, s0, s1, len);
          if (o != nullptr) VecPair<float>::load(o + c, o0, o1, len);
          dequant_step<scalar_t>(buf.data() + c, s0, s1, o != nullptr ? &o0 : nullptr, &o1,
                                 o_row + c, len);
        });
      } else {  // row r is channel n = r; the columns are k, one scale per group of them
        for (int64_t g0 = 0; g0 < cols; g0 += group_size) {
          const int64_t g1 = std::min(cols, g0 + group_size);
          const Vec s(ps[(g0 / group_size) * n + r]);
          const Vec o(po != nullptr ? po[(g0 / group_size) * n + r] : 0.f);
          for (int64_t c = g0; c < g1; c += kStep) {
            dequant_step<scalar_t>(buf.data() + c, s, s, po != nullptr ? &o : nullptr, &o,
                                   o_row + c, std::min(kStep, g1 - c));
          }
        }
      }
    }
  });
}

template <typename out_t>
void antiquant_to(const at::Tensor& codes, bool int4, bool k_on_rows, const at::Tensor& scale,
                  const at::Tensor& offset, int64_t group_size, at::ScalarType dtype,
                  at::Tensor& out) {
  if (dtype == at::kHalf) {
    antiquant_typed<c10::Half, std::conditional_t<std::is_same_v<out_t, float>, float, c10::Half>>(
        codes, int4, k_on_rows, scale, offset, group_size, out);
  } else {
    TORCH_INTERNAL_ASSERT(dtype == at::kBFloat16,
                          "npu_grouped_matmul: antiquant dtype must be float16 or bfloat16");
    antiquant_typed<c10::BFloat16,
                    std::conditional_t<std::is_same_v<out_t, float>, float, c10::BFloat16>>(
        codes, int4, k_on_rows, scale, offset, group_size, out);
  }
}

void antiquant_weight_kernel(const at::Tensor& codes, bool int4, bool k_on_rows,
                             const at::Tensor& scale, const at::Tensor& offset,
                             int64_t group_size, at::ScalarType dtype, at::Tensor& out) {
  if (out.scalar_type() == at::kFloat) {
    antiquant_to<float>(codes, int4, k_on_rows, scale, offset, group_size, dtype, out);
  } else {
    TORCH_INTERNAL_ASSERT(out.scalar_type() == dtype, "npu_grouped_matmul: antiquant output "
                          "must be float32 or ", dtype, ", got ", out.scalar_type());
    antiquant_to<void>(codes, int4, k_on_rows, scale, offset, group_size, dtype, out);
  }
}

}  // namespace

OPENNPU_REGISTER_CPU_SLOT(grouped_gemm, &grouped_gemm_kernel);
OPENNPU_REGISTER_CPU_SLOT(grouped_gemm_plan, &grouped_gemm_plan_kernel);
OPENNPU_REGISTER_CPU_SLOT(antiquant_weight, &antiquant_weight_kernel);

}  // namespace CPU_CAPABILITY
}  // namespace opennpu::moe
