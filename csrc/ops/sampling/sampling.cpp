// Entry points of the sampling family: validation, per-row parameters, CPU registration.
#include "ops/sampling/sampling.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/rsub.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "common/checks.h"

namespace opennpu::sampling {

KernelSlots<TopKTopPFn> top_k_top_p;
KernelSlots<SampleFn> top_k_top_p_sample;

namespace {

bool is_low_or_fp32(const at::Tensor& t) {
  const auto s = t.scalar_type();
  return s == at::kFloat || s == at::kHalf || s == at::kBFloat16;
}

void check_logits(const char* op, const at::Tensor& logits) {
  OPENNPU_CHECK_ARG(is_low_or_fp32(logits), op, "logits",
                    "must be float32, float16 or bfloat16, but got ", logits.scalar_type());
  OPENNPU_CHECK_ARG(logits.dim() == 2, op, "logits",
                    "must be 2-D [batch, vocab], but got shape ", shape_str(logits.sizes()));
}

// A per-row tensor: 1-D of `rows` elements ([rows, 1] too where `column_ok`).
void check_per_row(const char* op, const char* name, const at::Tensor& t, const at::Tensor& logits,
                   bool column_ok = false) {
  check_same_device(op, name, t, "logits", logits);
  const int64_t rows = logits.size(0);
  const bool ok = (t.dim() == 1 && t.size(0) == rows) ||
                  (column_ok && t.dim() == 2 && t.size(0) == rows && t.size(1) == 1);
  OPENNPU_CHECK_ARG(ok, op, name, "must have shape [", rows, "] (logits.size(0))",
                    column_ok ? " or [batch, 1]" : "", ", but got ", shape_str(t.sizes()));
}

void check_float_per_row(const char* op, const char* name, const at::Tensor& t,
                         const at::Tensor& logits, bool column_ok = false) {
  OPENNPU_CHECK_ARG(is_low_or_fp32(t), op, name, "must be float32, float16 or bfloat16, but got ",
                    t.scalar_type());
  check_per_row(op, name, t, logits, column_ok);
  OPENNPU_CHECK_STRICT(t.scalar_type() == logits.scalar_type(), op, name,
                       "must have the dtype of 'logits' (", logits.scalar_type(), "), but got ",
                       t.scalar_type());
}

std::vector<int64_t> int_values(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kLong).contiguous();
  const int64_t* p = c.const_data_ptr<int64_t>();
  return {p, p + c.numel()};
}

std::vector<float> float_values(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kFloat).contiguous();
  const float* p = c.const_data_ptr<float>();
  return {p, p + c.numel()};
}

void check_k_dtype(const char* op, const char* name, const at::Tensor& k) {
  OPENNPU_CHECK_ARG(k.scalar_type() == at::kInt || k.scalar_type() == at::kLong, op, name,
                    "must be int32 or int64, but got ", k.scalar_type());
  OPENNPU_CHECK_STRICT(k.scalar_type() == at::kInt, op, name, "must be int32, but got ",
                       k.scalar_type());
}

at::Tensor npu_top_k_top_p(const at::Tensor& logits, const std::optional<at::Tensor>& p,
                           const std::optional<at::Tensor>& k) {
  constexpr const char* op = "npu_top_k_top_p";
  check_logits(op, logits);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  if (p.has_value()) check_float_per_row(op, "p", *p, logits);
  if (k.has_value()) {
    check_k_dtype(op, "k", *k);
    check_per_row(op, "k", *k, logits);
  }
  at::Tensor out = at::empty({rows, vocab}, logits.options());
  if (rows == 0 || vocab == 0) return out;

  std::vector<int64_t> ks;
  if (k.has_value()) {
    ks = int_values(*k);
    for (int64_t b = 0; b < rows; ++b) {
      OPENNPU_CHECK_ARG(ks[b] >= 1 && ks[b] <= vocab, op, "k",
                        "must hold values in [1, vocab = logits.size(1) = ", vocab,
                        "], but row ", b, " has ", ks[b]);
      OPENNPU_CHECK_STRICT(ks[b] <= 1024, op, "k", "must hold values <= 1024, but row ", b,
                           " has ", ks[b]);
    }
  }
  std::vector<float> thr;
  if (p.has_value()) thr = float_values(at::rsub(*p, 1));  // 1 - p in p's dtype, as the golden
  FilterArgs args;
  args.k = ks.empty() ? nullptr : ks.data();
  args.one_minus_p = thr.empty() ? nullptr : thr.data();
  const at::Tensor x = logits.contiguous();
  top_k_top_p.get(op, x)(x, args, out);
  return out;
}

std::tuple<at::Tensor, at::Tensor> npu_top_k_top_p_sample(
    const at::Tensor& logits, const at::Tensor& top_k, const at::Tensor& top_p,
    const std::optional<at::Tensor>& q, std::optional<double> eps,
    std::optional<bool> is_need_logits, std::optional<int64_t> top_k_guess,
    const std::optional<at::Tensor>& min_ps, std::optional<int64_t> ks_max,
    std::optional<bool> input_is_logits, std::optional<c10::string_view> post_sample,
    std::optional<at::Generator> generator) {
  constexpr const char* op = "npu_top_k_top_p_sample";
  check_logits(op, logits);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  check_k_dtype(op, "top_k", top_k);
  check_per_row(op, "top_k", top_k, logits, /*column_ok=*/true);
  check_float_per_row(op, "top_p", top_p, logits, /*column_ok=*/true);
  if (min_ps.has_value()) check_float_per_row(op, "min_ps", *min_ps, logits, true);
  const std::string mode{post_sample.value_or("qSample")};
  OPENNPU_CHECK_ARG(mode == "qSample" || mode == "multiNomial" || mode == "None", op,
                    "post_sample", "must be 'qSample', 'multiNomial' or 'None', but got '", mode,
                    "'");
  const int64_t k_limit = ks_max.value_or(1024);
  OPENNPU_CHECK_ARG(k_limit >= 1, op, "ks_max", "must be a positive integer, but got ", k_limit);
  const bool need_logits = is_need_logits.value_or(false);
  const bool logits_in = input_is_logits.value_or(true);

  SampleArgs args;
  args.eps = static_cast<float>(eps.value_or(1e-8));
  args.top_k_guess = top_k_guess.value_or(32);
  args.k_max = std::min<int64_t>((k_limit + 7) / 8 * 8, 1024);
  args.input_is_logits = logits_in;
  at::Tensor q_values;
  if (mode == "qSample" && q.has_value()) {
    OPENNPU_CHECK_ARG(q->scalar_type() == at::kFloat, op, "q",
                      "must be float32 for post_sample='qSample', but got ", q->scalar_type());
    check_same_device(op, "q", *q, "logits", logits);
    OPENNPU_CHECK_ARG(q->sizes().equals(logits.sizes()), op, "q",
                      "must have the shape of 'logits' (", shape_str(logits.sizes()),
                      ") for post_sample='qSample', but got ", shape_str(q->sizes()));
    q_values = q->contiguous();
    args.post = Post::kQSample;
  } else if (mode == "multiNomial") {
    // Ascend reads a per-row (seed, offset) from an int64 q for its own stateless generator; that
    // generator is not emulated: the draw comes from `generator` (or the default one).
    OPENNPU_CHECK_ARG(!q.has_value(), op, "q",
                      "must be None for post_sample='multiNomial' in opennpu (Ascend's per-row "
                      "seed/offset sampling is not emulated; pass a torch.Generator instead)");
    args.post = Post::kMultinomial;
  }  // 'None', or 'qSample' without q (torch_npu then skips the sample step): argmax

  at::Tensor index = at::empty({rows}, logits.options().dtype(at::kLong));
  at::Tensor kept = need_logits ? at::empty({rows, vocab}, logits.options().dtype(at::kFloat))
                                : at::empty({0}, logits.options().dtype(at::kFloat));
  if (rows == 0) return {index, kept};
  OPENNPU_CHECK_ARG(vocab >= 1, op, "logits", "must have a vocab (last) dim of at least 1, ",
                    "but got shape ", shape_str(logits.sizes()));

  const std::vector<int64_t> ks = int_values(top_k);
  const std::vector<float> ps = float_values(top_p);
  std::vector<float> min_p;
  if (min_ps.has_value()) min_p = float_values(*min_ps);
  args.top_k = ks.data();
  args.top_p = ps.data();
  args.min_p = min_p.empty() ? nullptr : min_p.data();
  if (args.post == Post::kMultinomial) {
    // torch.multinomial(probs [B, V], 1, replacement=True) draws e ~ Exp(1) for every (row,
    // column) and takes argmax(probs / e): the same draws give the same tokens as the golden.
    q_values = at::empty({rows, vocab}, logits.options().dtype(at::kFloat));
    q_values.exponential_(1.0, generator);
  }
  if (q_values.defined()) args.q = q_values.const_data_ptr<float>();
  const at::Tensor x = logits.contiguous();
  at::Tensor kept_out = need_logits ? kept : at::Tensor();
  top_k_top_p_sample.get(op, x)(x, args, index, kept_out);
  return {index, kept};
}

}  // namespace

TORCH_LIBRARY_IMPL(npu, CPU, m) {
  m.impl("npu_top_k_top_p", &npu_top_k_top_p);
  m.impl("npu_top_k_top_p_sample", &npu_top_k_top_p_sample);
}

}  // namespace opennpu::sampling
