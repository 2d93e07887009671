// Rotary embedding: npu_rotary_mul and npu_rotary_mul_backward (Ascend's RotaryMul / RotaryMulGrad).
//
//   out = x * r1 + rotate(x) * r2,   r1 = cos, r2 = sin, both broadcast against x
//   'half':       rotate(x) = cat(-x[D/2:], x[:D/2])
//   'interleave': rotate(x)[2i] = -x[2i+1], rotate(x)[2i+1] = x[2i]
//   de-interleave (npu_interleave_rope, npu_kv_rmsnorm_rope_cache): q = (x[0], x[2], ..., x[1], x[3],
//                 ...), out = q * r1 + rotate_half(q) * r2 (not in place: rows are permuted)
// Any layout (BNSD, BSND, SBND, TND, ...) is a broadcast pattern of r over x's leading dims; the
// kernels walk rows of D elements and find each row's r row through (possibly zero) strides.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <vector>

#include "common/kernel_slots.h"

namespace opennpu::rotary {

enum class Mode { kHalf, kInterleave, kDeinterleave };

// Leading-dim geometry: x has rows indexed by `sizes` (x.shape[:-1]); each tensor's row start is
// sum(index[d] * strides[d]) in elements.
struct RowLayout {
  std::vector<int64_t> sizes;
  std::vector<int64_t> x_strides, r1_strides, r2_strides;
};

// out (contiguous) = x * r1 + rotate(x) * r2. x rows may be strided (last dim contiguous); r1/r2
// share one dtype: x's, or the accumulator dtype.
using RotaryFwdFn = void(const at::Tensor& x, const at::Tensor& r1, const at::Tensor& r2,
                         const RowLayout& layout, Mode mode, at::Tensor& out);

// Backward over contiguous grad and x of shape [..., D], with r1/r2 materialised in their joint
// broadcast shape `r_shape` (contiguous). dr1/dr2 (accumulator dtype, r_shape) receive the sums
// of x * grad and rotate(x) * grad over the dims where r broadcasts.
using RotaryBwdFn = void(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& r1,
                         const at::Tensor& r2, Mode mode, at::Tensor& dx, at::Tensor& dr1,
                         at::Tensor& dr2);

// npu_kv_rmsnorm_rope_cache's per-token rows (rope_cache.cpp prepares them). Token t (of T) has
// its kv row at kv + t * kv_stride (kv's dtype, D_kv elements) and its cos / sin rows at
// cos_off[t] / sin_off[t] (elements, cos's dtype = kv's, Dr elements). gamma: acc dtype.
//   v == nullptr (MLA V1): c = rms_norm(kv[:Dc]) * gamma,  k = rope(kv[Dc:Dc + Dr])
//   v != nullptr (V2):     y = rms_norm(kv) * gamma,  k = cat(rope(y[:Dr]), y[Dr:]),  c = v row
// k / c are rounded to kv's dtype into k_out / c_out ([T, Wk] / [T, Wc], contiguous) and, where
// k_stage / c_stage are set, also into those [T, W] rows: the cache's dtype, or int8 codes
// round(value * scale) clamped to [-128, 127] where a scale (acc dtype, W elements) is given.
struct KvRopeRows {
  at::ScalarType dtype;  // kv's
  int64_t T = 0, Dc = 0, Dr = 0, Wk = 0, Wc = 0;
  const void* kv = nullptr;
  int64_t kv_stride = 0;
  const void* v = nullptr;
  int64_t v_stride = 0;
  const void* cos = nullptr;
  const void* sin = nullptr;
  const int64_t* cos_off = nullptr;
  const int64_t* sin_off = nullptr;
  const void* gamma = nullptr;
  double eps = 1e-5;
  void* k_out = nullptr;
  void* c_out = nullptr;
  void* k_stage = nullptr;  // nullptr: k_out is what the cache receives
  void* c_stage = nullptr;
  const void* k_scale = nullptr;  // set: k_stage holds int8 codes
  const void* c_scale = nullptr;
};

using KvRopeFn = void(const KvRopeRows& rows);

extern KernelSlots<RotaryFwdFn> rotary_fwd;
extern KernelSlots<KvRopeFn> kv_rope_rows;
extern KernelSlots<RotaryBwdFn> rotary_bwd;

// Registers rotary.cpp's entry points (npu:: ops, then opennpu:: helpers) for one dispatch key;
// npu_kv_rmsnorm_rope_cache (rope_cache.cpp) registers itself for CPU only.
void register_npu_entry_points(torch::Library& m);
void register_opennpu_entry_points(torch::Library& m);

}  // namespace opennpu::rotary
