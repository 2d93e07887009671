// Entry points of npu_rotary_mul: validation, broadcast geometry, and their registration for
// CPU here (for CUDA in rotary_cuda.cu).
#include "ops/rotary/rotary.h"

#include <ATen/ExpandUtils.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "common/checks.h"
#include "common/dtype.h"

namespace opennpu::rotary {

KernelSlots<RotaryFwdFn> rotary_fwd;
KernelSlots<RotaryBwdFn> rotary_bwd;
KernelSlots<KvRopeFn> kv_rope_rows;

namespace {

Mode parse_mode(const char* op, c10::string_view mode) {
  if (mode == "half") return Mode::kHalf;
  if (mode == "interleave") return Mode::kInterleave;
  // The message torch_npu gives (op-plugin OpUtils.cpp), asserted by its tests.
  TORCH_CHECK(false, "The rotary_mode of ", op, " should be half or interleave, but got ", mode);
}

void check_x(const char* op, const char* name, const at::Tensor& x) {
  check_floating(op, name, x);
  OPENNPU_CHECK_ARG(x.dim() >= 1 && x.size(-1) % 2 == 0, op, name,
                    "must have an even last dim D (pairs are rotated), but got shape ",
                    shape_str(x.sizes()));
  check_strict_dtype(op, name, x, {at::kHalf, at::kBFloat16, at::kFloat});
  check_strict_rank(op, name, x, 3, 4);
  OPENNPU_CHECK_STRICT(x.size(-1) < 896, op, name, "must have D < 896, but got D = ", x.size(-1));
}

// r1/r2 broadcast to x over the leading dims and match D (or 1) in the last; returned as a
// contiguous tensor of rank x.dim() with the last dim materialised to D.
at::Tensor prepare_r(const char* op, const char* name, const at::Tensor& r, const at::Tensor& x) {
  check_floating(op, name, r);
  check_same_device(op, name, r, "self", x);
  bool ok = r.dim() >= 1 && r.dim() <= x.dim();
  for (int64_t i = 1; ok && i <= r.dim(); ++i) {
    ok = r.size(-i) == x.size(-i) || r.size(-i) == 1;
  }
  OPENNPU_CHECK_ARG(ok, op, name, "must broadcast to the shape of 'self' ", shape_str(x.sizes()),
                    " (last dim ", x.size(-1), " or 1), but got ", shape_str(r.sizes()));
  std::vector<int64_t> padded(x.dim() - r.dim(), 1);
  padded.insert(padded.end(), r.sizes().begin(), r.sizes().end());
  std::vector<int64_t> full = padded;
  full.back() = x.size(-1);
  return r.view(padded).expand(full);
}

// Strict mode: the broadcast patterns Ascend documents (11SD/B1SD/BNSD, 1S1D/BS1D/BSND,
// S11D/SB1D/SBND for 4-D; T1D/TND for 3-D), with r1 and r2 of one shape.
void check_strict_r_pattern(const char* op, const at::Tensor& x, const at::Tensor& r1,
                            const at::Tensor& r2) {
  if (!strict_mode()) return;
  OPENNPU_CHECK_STRICT(r1.sizes().equals(r2.sizes()), op, "r2", "must have the shape of 'r1' ",
                       shape_str(r1.sizes()), ", but got ", shape_str(r2.sizes()));
  bool ok = r1.dim() == x.dim();
  int mask = 0;
  for (int64_t d = 0; ok && d + 1 < x.dim(); ++d) {
    const bool kept = r1.size(d) == x.size(d);
    ok = kept || r1.size(d) == 1;
    mask = mask * 2 + (kept ? 1 : 0);
  }
  ok = ok && r1.size(-1) == x.size(-1);
  if (ok && x.dim() == 4) ok = mask != 0b000 && mask != 0b011;
  if (ok && x.dim() == 3) ok = (mask & 0b10) != 0;
  OPENNPU_CHECK_STRICT(ok, op, "r1",
                       "must follow a documented layout pattern for 'self' ", shape_str(x.sizes()),
                       " (4-D: 11SD, B1SD, BNSD, 1S1D, BS1D, BSND, S11D, SB1D, SBND; 3-D: T1D, "
                       "TND), but got ",
                       shape_str(r1.sizes()));
}

// r1/r2 keep x's dtype when both already have it; otherwise both go to the accumulator dtype,
// so e.g. fp32 cos/sin are never rounded to bf16.
at::ScalarType r_dtype(const at::Tensor& x, const at::Tensor& r1, const at::Tensor& r2) {
  if (r1.scalar_type() == x.scalar_type() && r2.scalar_type() == x.scalar_type()) {
    return x.scalar_type();
  }
  return acc_dtype(x);
}

std::vector<int64_t> leading(c10::IntArrayRef v) { return {v.begin(), v.end() - 1}; }

// x * c + rotate(x) * s into a new contiguous tensor; x's rows may be strided (a transposed view
// of a projection's output is read in place), c and s are x-broadcastable views.
// `into` (contiguous, x's shape and dtype) receives the result instead of a new tensor; it may
// be x itself in the half and interleave modes (each step reads its lanes before it writes them).
at::Tensor apply_rotary(const char* op, const at::Tensor& self, const at::Tensor& r1,
                        const at::Tensor& r2, Mode mode, const at::Tensor& into = at::Tensor()) {
  const at::Tensor x = self.stride(-1) == 1 ? self : self.contiguous();
  const at::Tensor c = r1.contiguous();
  const at::Tensor s = r2.contiguous();
  RowLayout layout;
  layout.sizes = leading(x.sizes());
  layout.x_strides = leading(x.strides());
  layout.r1_strides = leading(c.expand(x.sizes()).strides());
  layout.r2_strides = leading(s.expand(x.sizes()).strides());
  at::Tensor out = into.defined()
                       ? into
                       : at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() > 0) rotary_fwd.get(op, x)(x, c, s, layout, mode, out);
  return out;
}

void check_backward_args(const char* op, const at::Tensor& grad, const at::Tensor& self,
                         const at::Tensor& r1, const at::Tensor& r2) {
  check_x(op, "self", self);
  check_floating(op, "grad", grad);
  check_same_device(op, "grad", grad, "self", self);
  check_same_shape(op, "grad", grad, "self", self);
  check_strict_r_pattern(op, self, r1, r2);
}

}  // namespace

at::Tensor npu_rotary_mul(const at::Tensor& self, const at::Tensor& r1, const at::Tensor& r2,
                          c10::string_view rotary_mode, const std::optional<at::Tensor>& rotate) {
  constexpr const char* op = "npu_rotary_mul";
  const Mode mode = parse_mode(op, rotary_mode);
  check_x(op, "self", self);
  check_strict_r_pattern(op, self, r1, r2);
  const at::ScalarType rt = r_dtype(self, r1, r2);
  at::Tensor c = prepare_r(op, "r1", r1, self).to(rt);
  at::Tensor s = prepare_r(op, "r2", r2, self).to(rt);

  if (rotate.has_value() && rotate->defined()) {
    // rotate(x) = x @ rotate: a GEMM (BLAS through ATen), then the same mul-add, all in acc dtype
    // (fp32 for fp16 / bf16: one rounding at the end, and never ATen's half-precision GEMM, which
    // CPUs without fp16 / bf16 arithmetic emulate; see common/half_gemm.h).
    const at::Tensor& m = *rotate;
    check_floating(op, "rotate", m);
    check_same_device(op, "rotate", m, "self", self);
    const int64_t D = self.size(-1);
    OPENNPU_CHECK_ARG(m.dim() == 2 && m.size(0) == D && m.size(1) == D, op, "rotate",
                      "must be a [D, D] = [", D, ", ", D, "] matrix, but got ",
                      shape_str(m.sizes()));
    const auto acc = acc_dtype(self);
    const at::Tensor xa = self.to(acc);
    const at::Tensor rx = at::matmul(xa, m.to(acc));
    return (xa * c.to(acc) + rx * s.to(acc)).to(self.scalar_type()).contiguous();
  }

  return apply_rotary(op, self, c, s, mode);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> npu_rotary_mul_backward(
    const at::Tensor& grad, const at::Tensor& self, const at::Tensor& r1, const at::Tensor& r2,
    c10::string_view rotary_mode) {
  constexpr const char* op = "npu_rotary_mul_backward";
  const Mode mode = parse_mode(op, rotary_mode);
  check_backward_args(op, grad, self, r1, r2);
  const at::ScalarType rt = r_dtype(self, r1, r2);
  const at::Tensor c_b = prepare_r(op, "r1", r1, self);
  const at::Tensor s_b = prepare_r(op, "r2", r2, self);
  // Both r tensors in their joint broadcast shape, so one pass fills dr1 and dr2.
  const auto joint = at::infer_size(c_b.sizes(), s_b.sizes());
  const at::Tensor c = c_b.expand(joint).to(rt).contiguous();
  const at::Tensor s = s_b.expand(joint).to(rt).contiguous();

  const auto acc = acc_dtype(self);
  const at::Tensor x = self.contiguous();
  const at::Tensor g = grad.to(x.scalar_type()).contiguous();
  at::Tensor dx = at::empty(x.sizes(), x.options());
  at::Tensor dc = at::zeros(joint, x.options().dtype(acc));
  at::Tensor ds = at::zeros(joint, x.options().dtype(acc));
  if (x.numel() > 0) rotary_bwd.get(op, x)(g, x, c, s, mode, dx, dc, ds);

  // Sum over what r1/r2 broadcast along (their own size-1 dims, the last one included).
  std::vector<int64_t> r1_padded(self.dim() - r1.dim(), 1), r2_padded(self.dim() - r2.dim(), 1);
  r1_padded.insert(r1_padded.end(), r1.sizes().begin(), r1.sizes().end());
  r2_padded.insert(r2_padded.end(), r2.sizes().begin(), r2.sizes().end());
  at::Tensor dr1 = dc.sum_to_size(r1_padded).reshape(r1.sizes()).to(self.scalar_type());
  at::Tensor dr2 = ds.sum_to_size(r2_padded).reshape(r2.sizes()).to(self.scalar_type());
  return {dx, dr1, dr2};
}

at::Tensor rotary_mul_backward_dx(const at::Tensor& grad, const at::Tensor& self,
                                  const at::Tensor& r1, const at::Tensor& r2,
                                  c10::string_view rotary_mode) {
  constexpr const char* op = "npu_rotary_mul_backward";
  const Mode mode = parse_mode(op, rotary_mode);
  check_backward_args(op, grad, self, r1, r2);
  // dx = g * r1 + rotate^T(g * r2), and rotate^T(v) * s = rotate(v) * s' elementwise with
  // s' = -(s with its halves swapped) in half mode, -(s with each pair swapped) in interleave
  // mode: the forward kernel applied to g. Negating and swapping are exact, so in half mode dx
  // equals the full backward's bit for bit, and in interleave mode to within one rounding (the
  // kernels order their fma differently); x itself is not read.
  const at::ScalarType rt = r_dtype(self, r1, r2);
  const at::Tensor c = prepare_r(op, "r1", r1, self).to(rt);
  const at::Tensor s = prepare_r(op, "r2", r2, self).to(rt);
  const int64_t D = self.size(-1);
  const at::Tensor s_adj =
      mode == Mode::kHalf
          ? at::cat({s.narrow(-1, D / 2, D / 2), s.narrow(-1, 0, D / 2)}, -1).neg()
          : s.unflatten(-1, {D / 2, 2}).flip(-1).flatten(-2).neg();
  return apply_rotary(op, grad.to(self.scalar_type()), c, s_adj, mode);
}

at::Tensor npu_interleave_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  constexpr const char* op = "npu_interleave_rope";
  check_floating(op, "x", x);
  OPENNPU_CHECK_ARG(x.dim() >= 1 && x.size(-1) % 2 == 0, op, "x",
                    "must have an even last dim D (pairs are rotated), but got shape ",
                    shape_str(x.sizes()));
  check_strict_dtype(op, "x", x, {at::kHalf, at::kBFloat16});
  check_strict_rank(op, "x", x, 4, 4);
  OPENNPU_CHECK_STRICT(x.size(-1) == 64, op, "x", "must have D = 64, but got D = ", x.size(-1));
  OPENNPU_CHECK_STRICT(cos.dim() == 4 && cos.size(1) == 1, op, "cos",
                       "must be [B, 1, S or 1, D], but got ", shape_str(cos.sizes()));
  const at::ScalarType rt = r_dtype(x, cos, sin);
  const at::Tensor c = prepare_r(op, "cos", cos, x).to(rt);
  const at::Tensor s = prepare_r(op, "sin", sin, x).to(rt);
  OPENNPU_CHECK_ARG(cos.size(-1) == x.size(-1), op, "cos", "must have the last dim D = ",
                    x.size(-1), " of 'x', but got ", shape_str(cos.sizes()));
  OPENNPU_CHECK_ARG(sin.size(-1) == x.size(-1), op, "sin", "must have the last dim D = ",
                    x.size(-1), " of 'x', but got ", shape_str(sin.sizes()));
  return apply_rotary(op, x, c, s, Mode::kDeinterleave);
}

std::tuple<at::Tensor, at::Tensor> npu_apply_rotary_pos_emb(const at::Tensor& query,
                                                            const at::Tensor& key,
                                                            const at::Tensor& cos,
                                                            const at::Tensor& sin,
                                                            c10::string_view layout,
                                                            c10::string_view rotary_mode) {
  constexpr const char* op = "npu_apply_rotary_pos_emb";
  OPENNPU_CHECK_ARG(rotary_mode == "half" || rotary_mode == "interleave", op, "rotary_mode",
                    "must be 'half' or 'interleave' ('quarter' is not implemented by opennpu), "
                    "but got '", rotary_mode, "'");
  const Mode mode = rotary_mode == "half" ? Mode::kHalf : Mode::kInterleave;
  OPENNPU_CHECK_ARG(layout == "BSND" || layout == "SBND" || layout == "BNSD" || layout == "TND", op,
                    "layout", "must be 'BSND', 'SBND', 'BNSD' or 'TND', but got '", layout, "'");
  const int64_t rank = layout == "TND" ? 3 : 4;
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"query", query},
                                {"key", key}, {"cos", cos}, {"sin", sin}}) {
    check_floating(op, name, t);
    check_same_device(op, name, t, "query", query);
    OPENNPU_CHECK_ARG(t.dim() == rank, op, name, "must be ", rank, "-D for layout '", layout,
                      "', but got shape ", shape_str(t.sizes()));
    OPENNPU_CHECK_ARG(t.scalar_type() == query.scalar_type(), op, name,
                      "must have the dtype of 'query' (", query.scalar_type(), "), but got ",
                      t.scalar_type());
  }
  check_x(op, "query", query);
  const int64_t D = query.size(-1);
  const int64_t n_dim = layout == "BNSD" ? 1 : rank - 2;
  bool same = true;
  for (int64_t d = 0; d < rank; ++d) same = same && (d == n_dim || key.size(d) == query.size(d));
  OPENNPU_CHECK_ARG(same, op, "key", "must have the shape of 'query' ", shape_str(query.sizes()),
                    " except in N, but got ", shape_str(key.sizes()));
  OPENNPU_CHECK_STRICT(D == 64 || D == 128, op, "query", "must have D = 64 or 128, but got D = ", D);
  const at::Tensor c = prepare_r(op, "cos", cos, query);
  const at::Tensor s = prepare_r(op, "sin", sin, query);
  OPENNPU_CHECK_ARG(cos.size(-1) == D && sin.size(-1) == D, op, "cos",
                    "and 'sin' must have the last dim D = ", D, " of 'query', but got ",
                    shape_str(cos.sizes()), " and ", shape_str(sin.sizes()));
  // torch_npu updates query and key in place and returns them.
  for (const at::Tensor* t : {&query, &key}) {
    const at::Tensor cb = t == &query ? c : prepare_r(op, "cos", cos, key);
    const at::Tensor sb = t == &query ? s : prepare_r(op, "sin", sin, key);
    if (t->is_contiguous()) {
      apply_rotary(op, *t, cb, sb, mode, *t);
    } else {
      t->copy_(apply_rotary(op, *t, cb, sb, mode));
    }
  }
  return {query, key};
}

void register_npu_entry_points(torch::Library& m) {
  m.impl("npu_interleave_rope", &npu_interleave_rope);
  m.impl("npu_apply_rotary_pos_emb", &npu_apply_rotary_pos_emb);
  m.impl("npu_rotary_mul", &npu_rotary_mul);
  m.impl("npu_rotary_mul_backward", &npu_rotary_mul_backward);
}

void register_opennpu_entry_points(torch::Library& m) {
  m.impl("_rotary_mul_backward_dx", &rotary_mul_backward_dx);
}

TORCH_LIBRARY_IMPL(npu, CPU, m) { register_npu_entry_points(m); }

TORCH_LIBRARY_IMPL(opennpu, CPU, m) { register_opennpu_entry_points(m); }

}  // namespace opennpu::rotary
