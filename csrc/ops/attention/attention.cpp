// Entry points of the fusion attention family: argument validation in torch_npu's terms, layout
// handling, outputs in the contract's shapes, and the dropout mask generator.
#include "ops/attention/attention.h"

#include <ATen/Parallel.h>
#include <ATen/core/PhiloxRNGEngine.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <algorithm>
#include <cctype>
#include <limits>
#include <optional>
#include <string>

#include "common/checks.h"
#include "common/dtype.h"
#include "common/random.h"

namespace opennpu::attention {

KernelSlots<AttentionPlanFn> attention_plan;
KernelSlots<AttentionFwdFn> attention_fwd;
KernelSlots<AttentionBwdFn> attention_bwd;

uint64_t keep_threshold(double keep_prob) {
  if (keep_prob >= 1.0) return uint64_t{1} << 32;
  if (keep_prob <= 0.0) return 0;
  return static_cast<uint64_t>(keep_prob * 4294967296.0);
}

void philox_keep_bits(uint64_t seed, uint64_t offset, int64_t first, int64_t count,
                      uint64_t threshold, uint8_t* keep) {
  int64_t k = first;
  const int64_t end = first + count;
  while (k < end) {
    // One Philox block gives the words of bits 4c .. 4c+3.
    at::Philox4_32 block(seed, /*subsequence=*/0, /*offset=*/offset + static_cast<uint64_t>(k) / 4);
    uint32_t words[4];
    for (uint32_t& w : words) w = block();
    for (int64_t lane = k % 4; lane < 4 && k < end; ++lane, ++k) {
      keep[k - first] = static_cast<uint64_t>(words[lane]) < threshold ? 1 : 0;
    }
  }
}

namespace {

// a + b and a - b clamped to int64's range. |i + origin| is bounded by the sequence lengths, far
// from the limits; only the user's token counts can be extreme.
int64_t saturating_add(int64_t a, int64_t b) {
  int64_t sum = 0;
  if (!__builtin_add_overflow(a, b, &sum)) return sum;
  return b > 0 ? std::numeric_limits<int64_t>::max() : std::numeric_limits<int64_t>::min();
}

int64_t saturating_sub(int64_t a, int64_t b) {
  int64_t difference = 0;
  if (!__builtin_sub_overflow(a, b, &difference)) return difference;
  return b < 0 ? std::numeric_limits<int64_t>::max() : std::numeric_limits<int64_t>::min();
}

}  // namespace

KeyInterval visible_keys(const AttentionProblem& p, int64_t b, int64_t i) {
  const int64_t sq = p.q_len[b], skv = p.kv_len[b];
  int64_t lo = 0, hi = skv - 1;
  if (p.apply_band) {
    const int64_t shift = skv - sq;  // bottom-right alignment of the causal modes
    // pre/next_tokens may be anywhere in int64 (2**63 - 1 means "no limit"): the band's ends
    // are formed with saturating arithmetic, so they clamp instead of wrapping around.
    auto band = [&](int64_t origin) {
      lo = saturating_sub(i + origin, p.pre_tokens);
      hi = saturating_add(i + origin, p.next_tokens);
    };
    switch (p.sparse_mode) {
      case kDefaultMask: band(0); break;
      case kAllMask: break;
      case kLeftUpCausal: hi = i; break;
      case kRightDownCausal: hi = i + shift; break;
      case kBand: band(shift); break;
      case kPrefix:
      case kPrefixCompressed: hi = std::max(i + shift, p.prefix[b] - 1); break;
      case kVarlenRightDown:
        if (b == p.band_batch) band(shift); else hi = i + shift;
        break;
      case kVarlenLeftUp:
        if (b == p.band_batch) band(shift); else hi = i;
        break;
      default: break;
    }
  }
  return {std::max<int64_t>(lo, 0), std::min<int64_t>(hi, skv - 1)};
}

namespace {

constexpr const char* kFwd = "npu_fusion_attention";
constexpr const char* kBwd = "npu_fusion_attention_grad";

enum class Layout { BSH, SBH, BSND, BNSD, TND };

Layout parse_layout(const char* op, const std::string& text) {
  std::string up = text;
  for (char& c : up) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (up == "BSH") return Layout::BSH;
  if (up == "SBH") return Layout::SBH;
  if (up == "BSND") return Layout::BSND;
  if (up == "BNSD") return Layout::BNSD;
  if (up == "TND") return Layout::TND;
  OPENNPU_CHECK_ARG(false, op, "input_layout",
                    "must be one of 'BSH', 'SBH', 'BSND', 'BNSD', 'TND', but got '", text, "'");
  return Layout::BSH;
}

int64_t layout_rank(Layout l) { return (l == Layout::BSND || l == Layout::BNSD) ? 4 : 3; }

// Sizes of one q/k/v tensor in its layout. `heads` is needed to split H for BSH/SBH.
struct Dims {
  int64_t batch, seq, heads, dim;
};

Dims layout_dims(const char* op, const char* arg, const at::Tensor& t, Layout l, int64_t heads) {
  switch (l) {
    case Layout::BSH:
    case Layout::SBH: {
      const int64_t h = t.size(2);
      OPENNPU_CHECK_ARG(heads > 0 && h % heads == 0, op, arg,
                        "must have a hidden size (last dim) divisible by its head count ", heads,
                        ", but got shape ", shape_str(t.sizes()));
      const bool bsh = l == Layout::BSH;
      return {t.size(bsh ? 0 : 1), t.size(bsh ? 1 : 0), heads, h / heads};
    }
    case Layout::BSND: return {t.size(0), t.size(1), t.size(2), t.size(3)};
    case Layout::BNSD: return {t.size(0), t.size(2), t.size(1), t.size(3)};
    case Layout::TND: return {1, t.size(0), t.size(1), t.size(2)};
  }
  return {};
}

// Element strides of a contiguous tensor in layout l with head size d.
SeqView layout_view(const at::Tensor& t, Layout l, int64_t d) {
  switch (l) {
    case Layout::BSH: return {t.stride(0), d, t.stride(1)};
    case Layout::SBH: return {t.stride(1), d, t.stride(0)};
    case Layout::BSND: return {t.stride(0), t.stride(2), t.stride(1)};
    case Layout::BNSD: return {t.stride(0), t.stride(1), t.stride(2)};
    case Layout::TND: return {0, t.stride(1), t.stride(0)};
  }
  return {};
}

// The shape of a tensor with q's layout and sizes but head dim `d` (attention_out, dy).
std::vector<int64_t> with_head_dim(const at::Tensor& q, Layout l, int64_t heads, int64_t d) {
  std::vector<int64_t> shape(q.sizes().begin(), q.sizes().end());
  shape.back() = (l == Layout::BSH || l == Layout::SBH) ? heads * d : d;
  return shape;
}

// Cumulative sequence ends (torch_npu's actual_seq_qlen / actual_seq_kvlen) -> starts, lengths.
// A repeated value is an empty sequence; a trailing run of zeros marks batches not computed.
void split_cumulative(const char* op, const char* arg, c10::IntArrayRef cum, int64_t total,
                      std::vector<int64_t>& start, std::vector<int64_t>& len) {
  int64_t prev = 0;
  bool tail_zero = false;
  for (const int64_t end : cum) {
    if (tail_zero || (end == 0 && prev > 0)) {
      OPENNPU_CHECK_ARG(end == 0, op, arg,
                        "must be non-decreasing cumulative sequence ends (a trailing run of zeros "
                        "marks unused batches), but got ", cum);
      tail_zero = true;
      start.push_back(prev);
      len.push_back(0);
      continue;
    }
    OPENNPU_CHECK_ARG(end >= prev, op, arg,
                      "must be non-decreasing cumulative sequence ends without the leading 0 "
                      "(lengths 2, 2, 2 -> [2, 4, 6]), but got ", cum);
    start.push_back(prev);
    len.push_back(end - prev);
    prev = end;
  }
  OPENNPU_CHECK_ARG(prev <= total, op, arg, "ends at ", prev,
                    " tokens, more than the tensor's T = ", total);
}

// Everything both entry points derive from the shared arguments.
struct Prepared {
  AttentionProblem p;
  Layout layout;
  at::ScalarType dtype;
  at::Tensor q, k, v;  // compute dtype (AttentionPlan::compute), contiguous
  at::Tensor pse, mask, sink, dropout_mask;  // kept alive for p's raw pointers
  int64_t seq_q = 0, seq_kv = 0;  // non-TND Sq, Skv (TND: T of q and kv)
  int64_t numels = 0;
  std::vector<int64_t> out_shape;
  std::vector<int64_t> stats_shape;
};

struct SharedArgs {
  const at::Tensor& query;
  const at::Tensor& key;
  const at::Tensor& value;
  int64_t head_num;
  c10::string_view input_layout;
  const std::optional<at::Tensor>& pse;
  const std::optional<at::Tensor>& padding_mask;
  const std::optional<at::Tensor>& atten_mask;
  double scale;
  double keep_prob;
  int64_t pre_tockens;
  int64_t next_tockens;
  int64_t inner_precise;
  at::OptionalIntArrayRef prefix;
  at::OptionalIntArrayRef actual_seq_qlen;
  at::OptionalIntArrayRef actual_seq_kvlen;
  int64_t sparse_mode;
  c10::string_view softmax_layout;
  const std::optional<at::Tensor>& sink;
};

void check_mask_dtype(const char* op, const at::Tensor& mask) {
  OPENNPU_CHECK_ARG(mask.scalar_type() == at::kBool || mask.scalar_type() == at::kByte, op,
                    "atten_mask", "must be bool or uint8 (True / 1 = masked out), but got ",
                    mask.scalar_type());
}

}  // namespace

// dst takes src's values (resized to src's shape where it differs; the dtype must match).
void copy_out(at::Tensor& dst, const at::Tensor& src, const char* op, const char* arg) {
  OPENNPU_CHECK_ARG(dst.scalar_type() == src.scalar_type(), op, arg, "must be ",
                    src.scalar_type(), ", but got ", dst.scalar_type());
  if (!dst.sizes().equals(src.sizes())) dst.resize_(src.sizes());
  dst.copy_(src);
}

namespace {

Prepared prepare(const char* op, const SharedArgs& a) {
  Prepared out;
  AttentionProblem& p = out.p;
  const Layout l = parse_layout(op, std::string(a.input_layout));
  out.layout = l;
  const bool tnd = l == Layout::TND;
  p.tnd = tnd;

  check_floating(op, "query", a.query);
  check_floating(op, "key", a.key);
  check_floating(op, "value", a.value);
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"key", &a.key},
                                {"value", &a.value}}) {
    OPENNPU_CHECK_ARG(t->scalar_type() == a.query.scalar_type(), op, name,
                      "must have the dtype of 'query' (", a.query.scalar_type(), "), but got ",
                      t->scalar_type());
    check_same_device(op, name, *t, "query", a.query);
  }
  const int64_t rank = layout_rank(l);
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"query", &a.query},
                                {"key", &a.key}, {"value", &a.value}}) {
    OPENNPU_CHECK_ARG(t->dim() == rank, op, name, "must be ", rank, "-D for input_layout '",
                      std::string(a.input_layout), "', but got shape ", shape_str(t->sizes()));
  }
  OPENNPU_CHECK_ARG(a.head_num > 0, op, "head_num", "must be > 0, but got ", a.head_num);
  OPENNPU_CHECK_ARG(!a.padding_mask.has_value(), op, "padding_mask",
                    "is not supported (torch_npu reserves it), but a tensor was given");
  OPENNPU_CHECK_ARG(a.keep_prob > 0.0 && a.keep_prob <= 1.0, op, "keep_prob",
                    "must be in (0, 1], but got ", a.keep_prob);
  OPENNPU_CHECK_ARG(a.inner_precise >= 0 && a.inner_precise <= 2, op, "inner_precise",
                    "must be 0, 1 or 2, but got ", a.inner_precise);

  const Dims qd = layout_dims(op, "query", a.query, l, a.head_num);
  OPENNPU_CHECK_ARG(qd.heads == a.head_num, op, "head_num",
                    "must equal the head count of 'query' (", qd.heads, "), but got ", a.head_num);
  const int64_t d = qd.dim;
  // BSH/SBH: the key head count follows from D; value's head size from the key head count.
  int64_t kv_heads = 0;
  if (l == Layout::BSH || l == Layout::SBH) {
    OPENNPU_CHECK_ARG(d > 0 && a.key.size(2) % d == 0, op, "key",
                      "must have a hidden size divisible by the query head size ", d,
                      ", but got shape ", shape_str(a.key.sizes()));
    kv_heads = d > 0 ? a.key.size(2) / d : 0;
  } else {
    kv_heads = layout_dims(op, "key", a.key, l, 1).heads;
  }
  OPENNPU_CHECK_ARG(kv_heads > 0 && a.head_num % kv_heads == 0, op, "key",
                    "must have a head count that divides head_num ", a.head_num,
                    " (grouped-query attention), but got ", kv_heads, " heads (shape ",
                    shape_str(a.key.sizes()), ")");
  const Dims kd = layout_dims(op, "key", a.key, l, kv_heads);
  const Dims vd = layout_dims(op, "value", a.value, l, kv_heads);
  OPENNPU_CHECK_ARG(kd.dim == d, op, "key", "must have the head size of 'query' (", d,
                    "), but got ", kd.dim, " (shape ", shape_str(a.key.sizes()), ")");
  OPENNPU_CHECK_ARG(vd.heads == kv_heads && vd.batch == kd.batch && vd.seq == kd.seq, op, "value",
                    "must have the batch, sequence and head counts of 'key' (shape ",
                    shape_str(a.key.sizes()), "), but got shape ", shape_str(a.value.sizes()));
  OPENNPU_CHECK_ARG(kd.batch == qd.batch, op, "key", "must have the batch size of 'query' (",
                    qd.batch, "), but got ", kd.batch);
  check_strict_dtype(op, "query", a.query, {at::kHalf, at::kBFloat16, at::kFloat});
  OPENNPU_CHECK_STRICT(d >= 1 && d <= 768, op, "query", "must have a head size in [1, 768], but got ", d);
  OPENNPU_CHECK_STRICT(vd.dim <= d, op, "value",
                       "must have a head size <= that of query (", d, "), but got ", vd.dim);
  OPENNPU_CHECK_STRICT(a.head_num <= 256, op, "head_num", "must be <= 256, but got ", a.head_num);

  p.heads_q = a.head_num;
  p.heads_kv = kv_heads;
  p.head_dim = d;
  p.head_dim_v = vd.dim;
  p.scale = a.scale;
  p.keep_prob = a.keep_prob;

  // Sequences.
  if (tnd) {
    OPENNPU_CHECK_ARG(a.actual_seq_qlen.has_value() && !a.actual_seq_qlen->empty(), op,
                      "actual_seq_qlen",
                      "is required for input_layout 'TND' (cumulative query sequence ends), but "
                      "got none");
    OPENNPU_CHECK_ARG(a.actual_seq_kvlen.has_value() && !a.actual_seq_kvlen->empty(), op,
                      "actual_seq_kvlen",
                      "is required for input_layout 'TND' (cumulative key sequence ends), but "
                      "got none");
    OPENNPU_CHECK_ARG(a.actual_seq_qlen->size() == a.actual_seq_kvlen->size(), op,
                      "actual_seq_kvlen", "must have as many entries as actual_seq_qlen (",
                      a.actual_seq_qlen->size(), "), but got ", a.actual_seq_kvlen->size());
    split_cumulative(op, "actual_seq_qlen", *a.actual_seq_qlen, qd.seq, p.q_start, p.q_len);
    split_cumulative(op, "actual_seq_kvlen", *a.actual_seq_kvlen, kd.seq, p.kv_start, p.kv_len);
    p.batch = static_cast<int64_t>(p.q_len.size());
    p.stats_rows_per_head = qd.seq;
  } else {
    p.batch = qd.batch;
    p.q_start.assign(p.batch, 0);
    p.kv_start.assign(p.batch, 0);
    p.q_len.assign(p.batch, qd.seq);
    p.kv_len.assign(p.batch, kd.seq);
    p.stats_rows_per_head = qd.seq;
  }
  out.seq_q = qd.seq;
  out.seq_kv = kd.seq;

  // Softmax statistics layout.
  const std::string sl(a.softmax_layout);
  OPENNPU_CHECK_ARG(sl.empty() || sl == "TND", op, "softmax_layout",
                    "must be \"\" or \"TND\", but got \"", sl, "\"");
  OPENNPU_CHECK_ARG(sl.empty() || tnd, op, "softmax_layout",
                    "\"TND\" needs input_layout 'TND', but got '", std::string(a.input_layout), "'");
  p.stats_token_major = sl == "TND";
  out.stats_shape = tnd ? std::vector<int64_t>{qd.seq, a.head_num, 8}
                        : std::vector<int64_t>{qd.batch, a.head_num, qd.seq, 8};

  // Sparse mode and masks.
  OPENNPU_CHECK_ARG(a.sparse_mode >= 0 && a.sparse_mode <= 8, op, "sparse_mode",
                    "must be in [0, 8], but got ", a.sparse_mode);
  if (tnd) {
    OPENNPU_CHECK_ARG(a.sparse_mode != kPrefix, op, "sparse_mode",
                      "5 (prefix, uncompressed) is not available with input_layout 'TND'");
  } else {
    OPENNPU_CHECK_ARG(a.sparse_mode <= kPrefixCompressed, op, "sparse_mode",
                      a.sparse_mode, " (split varlen) needs input_layout 'TND', but got '",
                      std::string(a.input_layout), "'");
  }
  p.sparse_mode = a.sparse_mode;
  p.pre_tokens = a.pre_tockens;
  p.next_tokens = a.next_tockens;
  if (a.atten_mask.has_value()) {
    const at::Tensor& mask = *a.atten_mask;
    check_mask_dtype(op, mask);
    check_same_device(op, "atten_mask", mask, "query", a.query);
    p.apply_band = true;
    const bool reads_mask = a.sparse_mode == kDefaultMask || a.sparse_mode == kAllMask ||
                            a.sparse_mode == kPrefix;
    if (reads_mask) {
      int64_t max_sq = 0, max_skv = 0;
      for (const int64_t s : p.q_len) max_sq = std::max(max_sq, s);
      for (const int64_t s : p.kv_len) max_skv = std::max(max_skv, s);
      bool ok = false;
      if (mask.dim() == 2) {
        ok = tnd ? (mask.size(0) >= max_sq && mask.size(1) >= max_skv)
                 : (mask.size(0) == qd.seq && mask.size(1) == kd.seq);
      } else if (mask.dim() == 4 && !tnd) {
        ok = (mask.size(0) == 1 || mask.size(0) == qd.batch) &&
             (mask.size(1) == 1 || mask.size(1) == a.head_num) && mask.size(2) == qd.seq &&
             mask.size(3) == kd.seq;
      }
      OPENNPU_CHECK_ARG(ok, op, "atten_mask",
                        tnd ? "must be [maxSq, maxSkv] for input_layout 'TND' (at least ["
                            : "must be [B, N, Sq, Skv], [B, 1, Sq, Skv], [1, 1, Sq, Skv], [1, N, Sq, Skv] or "
                              "[Sq, Skv] (with [Sq, Skv] = [",
                        max_sq, ", ", max_skv, "]), but got ", shape_str(mask.sizes()));
      OPENNPU_CHECK_ARG(a.sparse_mode != kPrefix || mask.dim() == 4, op, "atten_mask",
                        "must be [B, N, Sq, Skv] or [B, 1, Sq, Skv] for sparse_mode 5, but got ",
                        shape_str(mask.sizes()));
      out.mask = mask.scalar_type() == at::kBool ? mask.view(at::kByte) : mask;
      if (out.mask.stride(-1) != 1) out.mask = out.mask.contiguous();
      p.user_mask = out.mask.const_data_ptr<uint8_t>();
      if (mask.dim() == 4) {
        p.mask_stride_b = mask.size(0) == 1 ? 0 : out.mask.stride(0);
        p.mask_stride_n = mask.size(1) == 1 ? 0 : out.mask.stride(1);
        p.mask_stride_i = out.mask.stride(2);
      } else {
        p.mask_stride_i = out.mask.stride(0);
      }
    } else {
      // Compressed modes describe the mask by the mode; the tensor's content is not read.
      OPENNPU_CHECK_STRICT(
          (mask.dim() == 2 && mask.size(1) == 2048 &&
           mask.size(0) == (a.sparse_mode == kPrefixCompressed ? 3072 : 2048)),
          op, "atten_mask", "must be the compressed ",
          a.sparse_mode == kPrefixCompressed ? "[3072, 2048]" : "[2048, 2048]",
          " mask for sparse_mode ", a.sparse_mode, ", but got ", shape_str(mask.sizes()));
    }
    if (a.sparse_mode == kPrefix || a.sparse_mode == kPrefixCompressed) {
      OPENNPU_CHECK_ARG(a.prefix.has_value() && static_cast<int64_t>(a.prefix->size()) == p.batch,
                        op, "prefix", "must list one prefix length per batch (", p.batch,
                        ") for sparse_mode ", a.sparse_mode, ", but got ",
                        a.prefix.has_value() ? c10::str(*a.prefix) : std::string("None"));
      for (const int64_t v : *a.prefix) {
        OPENNPU_CHECK_ARG(v >= 0, op, "prefix", "must be >= 0, but got ", *a.prefix);
      }
      p.prefix.assign(a.prefix->begin(), a.prefix->end());
    }
    if (a.sparse_mode == kVarlenRightDown) {
      for (int64_t b = p.batch - 1; b >= 0 && p.band_batch < 0; --b) {
        if (p.q_len[b] > 0) p.band_batch = b;
      }
    } else if (a.sparse_mode == kVarlenLeftUp) {
      for (int64_t b = 0; b < p.batch && p.band_batch < 0; ++b) {
        if (p.q_len[b] > 0) p.band_batch = b;
      }
    }
  }

  // Tensors in the accumulator dtype, contiguous in their layout.
  const at::ScalarType acc = acc_dtype(a.query);
  out.dtype = a.query.scalar_type();
  const AttentionPlan plan =
      attention_plan.get(op, a.query)(op, out.dtype, d, vd.dim, /*check_forced_tiles=*/true);
  const at::ScalarType compute = plan.compute;
  p.tiles = plan.tiles;
  p.pv = plan.pv;
  out.q = a.query.to(compute).contiguous();
  out.k = a.key.to(compute).contiguous();
  out.v = a.value.to(compute).contiguous();
  p.q = layout_view(out.q, l, d);
  p.k = layout_view(out.k, l, d);
  p.v = layout_view(out.v, l, vd.dim);
  out.out_shape = with_head_dim(a.query, l, a.head_num, vd.dim);
  {
    const at::Tensor probe = at::empty(out.out_shape, out.q.options().device(at::kMeta));
    p.out = layout_view(probe, l, vd.dim);
  }

  if (a.pse.has_value()) {
    const at::Tensor& pse = *a.pse;
    check_floating(op, "pse", pse);
    check_same_device(op, "pse", pse, "query", a.query);
    OPENNPU_CHECK_ARG(!tnd, op, "pse", "is not supported with input_layout 'TND'");
    OPENNPU_CHECK_ARG(pse.dim() == 4 && (pse.size(0) == 1 || pse.size(0) == qd.batch) &&
                          (pse.size(1) == 1 || pse.size(1) == a.head_num) &&
                          (pse.size(2) == 1 || pse.size(2) == qd.seq) && pse.size(3) == kd.seq,
                      op, "pse", "must be [B or 1, N or 1, Sq or 1, Skv] = [", qd.batch, ", ",
                      a.head_num, ", ", qd.seq, ", ", kd.seq, "], but got ",
                      shape_str(pse.sizes()));
    out.pse = pse.to(acc).contiguous();
    p.pse = out.pse.const_data_ptr();
    p.pse_stride_b = pse.size(0) == 1 ? 0 : out.pse.stride(0);
    p.pse_stride_n = pse.size(1) == 1 ? 0 : out.pse.stride(1);
    p.pse_stride_i = pse.size(2) == 1 ? 0 : out.pse.stride(2);
  }
  if (a.sink.has_value()) {
    const at::Tensor& sink = *a.sink;
    check_same_device(op, "sink", sink, "query", a.query);
    OPENNPU_CHECK_ARG(sink.scalar_type() == at::kFloat && sink.dim() == 1 &&
                          sink.size(0) == a.head_num,
                      op, "sink", "must be a float32 [head_num] = [", a.head_num,
                      "] tensor, but got ", sink.scalar_type(), " ", shape_str(sink.sizes()));
    out.sink = sink.contiguous();
    p.sink = out.sink.const_data_ptr<float>();
  }

  // Dropout bit numbering: (b, n, i, j) row-major per batch; TND sequences one after another.
  p.bit_start.resize(p.batch);
  int64_t bits = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    p.bit_start[b] = bits;
    bits += a.head_num * p.q_len[b] * p.kv_len[b];
  }
  out.numels = bits;
  return out;
}

// Sets up dropout for a given (seed, offset); `mask` is an optional pre-generated bit mask.
void configure_dropout(const char* op, Prepared& prep, int64_t seed, int64_t offset,
                       const std::optional<at::Tensor>& mask) {
  AttentionProblem& p = prep.p;
  p.dropout = p.keep_prob < 1.0;
  p.seed = static_cast<uint64_t>(seed);
  p.offset = static_cast<uint64_t>(offset);
  if (p.dropout && mask.has_value()) {
    OPENNPU_CHECK_ARG(mask->scalar_type() == at::kByte, op, "dropout_mask",
                      "must be the uint8 bit mask of _npu_dropout_gen_mask, but got ",
                      mask->scalar_type());
    OPENNPU_CHECK_ARG(mask->numel() * 8 >= prep.numels, op, "dropout_mask",
                      "must hold numels = ", prep.numels, " bits (", (prep.numels + 7) / 8,
                      " bytes), but got ", mask->numel(), " bytes");
    prep.dropout_mask = mask->contiguous();
    p.dropout_mask = prep.dropout_mask.const_data_ptr<uint8_t>();
  }
}

struct ForwardResult {
  at::Tensor out;  // in the compute dtype (prep.q's)
  at::Tensor softmax_max, softmax_sum;
};

ForwardResult run_forward(const char* op, const Prepared& prep) {
  const auto opts = prep.q.options();
  ForwardResult r;
  // The kernel writes every row, except TND tokens past the last sequence end, which stay 0.
  const bool runs = prep.numels > 0 || prep.p.sink != nullptr;
  r.out = runs && !prep.p.tnd ? at::empty(prep.out_shape, opts) : at::zeros(prep.out_shape, opts);
  // float32 as the contract says; float64 for float64 inputs so their gradients stay exact.
  const at::ScalarType stats = prep.dtype == at::kDouble ? at::kDouble : at::kFloat;
  r.softmax_max = at::empty(prep.stats_shape, opts.dtype(stats));
  r.softmax_sum = at::empty(prep.stats_shape, opts.dtype(stats));
  // Rows no sequence covers (TND tokens past the last end) keep these values. Otherwise the
  // kernel writes every row's statistics (a row that sees no key too), so nothing is filled.
  if (!runs || prep.p.tnd) {
    r.softmax_max.fill_(-std::numeric_limits<float>::infinity());
    r.softmax_sum.zero_();
  }
  if (runs) {
    attention_fwd.get(op, prep.q)(prep.p, prep.q, prep.k, prep.v, r.out, r.softmax_max, r.softmax_sum);
  }
  return r;
}

using ForwardOutputs =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, c10::SymInt, c10::SymInt, c10::SymInt>;

// npu_fusion_attention's parameters (the kernel entry and its variants' shared core take them).
// FA_HEAD: the leading ones, which v3 shares.
#define FA_HEAD                                                                                   \
  const at::Tensor &query, const at::Tensor &key, const at::Tensor &value, int64_t head_num,      \
      c10::string_view input_layout, const std::optional<at::Tensor>&pse,                        \
      const std::optional<at::Tensor>&padding_mask, const std::optional<at::Tensor>&atten_mask,  \
      double scale, double keep_prob, int64_t pre_tockens, int64_t next_tockens,                 \
      int64_t inner_precise
#define FA_PARAMS                                                                                 \
  FA_HEAD, at::OptionalIntArrayRef prefix,                                                        \
      at::OptionalIntArrayRef actual_seq_qlen, at::OptionalIntArrayRef actual_seq_kvlen,         \
      int64_t sparse_mode, bool gen_mask_parallel, bool sync, c10::string_view softmax_layout,   \
      const std::optional<at::Tensor>&sink, const std::optional<at::Tensor>&dropout_mask,       \
      int64_t seed, int64_t offset

// npu_fusion_attention and its variants (v2, v3), whose entry points convert their arguments to
// these; `op` names the variant in error messages.
ForwardOutputs fusion_attention_forward(const char* op, FA_PARAMS) {
  (void)gen_mask_parallel;  // how Ascend schedules the mask generation; nothing to do here
  (void)sync;
  Prepared prep = prepare(op, {query, key, value, head_num, input_layout, pse, padding_mask,
                               atten_mask, scale, keep_prob, pre_tockens, next_tockens,
                               inner_precise, prefix, actual_seq_qlen, actual_seq_kvlen,
                               sparse_mode, softmax_layout, sink});
  if (keep_prob < 1.0 && !dropout_mask.has_value()) {
    // Reserve one 32-bit Philox word per score (the mask bit count).
    const auto [s, o] = reserve_philox(query.device(), static_cast<uint64_t>(prep.numels));
    seed = static_cast<int64_t>(s);
    offset = static_cast<int64_t>(o);
  }
  configure_dropout(op, prep, seed, offset, dropout_mask);
  ForwardResult r = run_forward(op, prep);
  at::Tensor attention_out = r.out.to(prep.dtype);
  at::Tensor softmax_out = at::empty({0}, query.options());
  return {attention_out, r.softmax_max, r.softmax_sum, softmax_out, c10::SymInt(seed),
          c10::SymInt(offset), c10::SymInt(prep.numels)};
}

// softmax_max / softmax_sum given to the backward must have the forward's shape.
at::Tensor check_stats(const char* op, const char* arg, const at::Tensor& t, const Prepared& prep) {
  OPENNPU_CHECK_ARG(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble, op, arg,
                    "must be float32 (float64 for float64 inputs), but got ", t.scalar_type());
  OPENNPU_CHECK_ARG(t.sizes().equals(prep.stats_shape), op, arg, "must be the ",
                    shape_str(prep.stats_shape), " tensor npu_fusion_attention returned, but got ",
                    shape_str(t.sizes()));
  return t.to(prep.dtype == at::kDouble ? at::kDouble : at::kFloat).contiguous();
}

using GradOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The gradient of fusion_attention_forward. `numels` is the forward's mask bit count, checked
// against the shapes where given (the v3 variant has none).
// npu_fusion_attention_grad's parameters, with the types of seed, offset (SEED) and numels.
// FA_GRAD_HEAD: the leading ones, which grad_v3 shares.
#define FA_GRAD_HEAD                                                                              \
  const at::Tensor &query, const at::Tensor &key, const at::Tensor &value, const at::Tensor &dy, \
      int64_t head_num, c10::string_view input_layout, const std::optional<at::Tensor>&pse,      \
      const std::optional<at::Tensor>&padding_mask, const std::optional<at::Tensor>&atten_mask,  \
      const std::optional<at::Tensor>&softmax_max, const std::optional<at::Tensor>&softmax_sum,  \
      const std::optional<at::Tensor>&softmax_in, const std::optional<at::Tensor>&attention_in,  \
      double scale_value, double keep_prob, int64_t pre_tockens, int64_t next_tockens,           \
      int64_t inner_precise
#define FA_GRAD_PARAMS(SEED, NUMELS)                                                              \
  FA_GRAD_HEAD, SEED seed, SEED offset, NUMELS numels,                                            \
      at::OptionalIntArrayRef prefix, at::OptionalIntArrayRef actual_seq_qlen,                   \
      at::OptionalIntArrayRef actual_seq_kvlen, int64_t sparse_mode, bool gen_mask_parallel,     \
      bool sync, c10::string_view softmax_layout, const std::optional<at::Tensor>&sink

GradOutputs fusion_attention_backward(const char* op,
                                      FA_GRAD_PARAMS(int64_t, std::optional<int64_t>)) {
  (void)softmax_in;  // reserved by torch_npu (softmax_out is empty)
  (void)gen_mask_parallel;
  (void)sync;
  Prepared prep = prepare(op, {query, key, value, head_num, input_layout, pse, padding_mask,
                               atten_mask, scale_value, keep_prob, pre_tockens, next_tockens,
                               inner_precise, prefix, actual_seq_qlen, actual_seq_kvlen,
                               sparse_mode, softmax_layout, sink});
  AttentionProblem& p = prep.p;
  OPENNPU_CHECK_ARG(keep_prob >= 1.0 || !numels.has_value() || *numels == prep.numels, op,
                    "numels", "must be the forward's mask bit count ", prep.numels, ", but got ",
                    numels.value_or(0));
  configure_dropout(op, prep, seed, offset, std::nullopt);
  check_same_device(op, "dy", dy, "query", query);
  check_floating(op, "dy", dy);
  OPENNPU_CHECK_ARG(dy.scalar_type() == query.scalar_type(), op, "dy",
                    "must have the dtype of 'query' (", query.scalar_type(), "), but got ",
                    dy.scalar_type());
  OPENNPU_CHECK_ARG(dy.sizes().equals(prep.out_shape), op, "dy",
                    "must have the shape of attention_out ", shape_str(prep.out_shape),
                    ", but got ", shape_str(dy.sizes()));
  const at::ScalarType acc = acc_dtype(query);
  const at::ScalarType compute = prep.q.scalar_type();  // acc, or fp16/bf16 (AttentionPlan)
  const at::Tensor dy_in = dy.to(compute).contiguous();

  // The probabilities are recomputed from the forward's statistics; without them (or without
  // attention_in) the forward runs once more here.
  at::Tensor smax, ssum, out_in;
  if (softmax_max.has_value() && softmax_sum.has_value() && attention_in.has_value()) {
    smax = check_stats(op, "softmax_max", *softmax_max, prep);
    ssum = check_stats(op, "softmax_sum", *softmax_sum, prep);
    OPENNPU_CHECK_ARG(attention_in->sizes().equals(prep.out_shape), op, "attention_in",
                      "must be the forward's attention_out ", shape_str(prep.out_shape),
                      ", but got ", shape_str(attention_in->sizes()));
    out_in = attention_in->to(compute).contiguous();
  } else {
    ForwardResult r = run_forward(op, prep);
    smax = r.softmax_max;
    ssum = r.softmax_sum;
    out_in = r.out;
  }

  const auto opts = prep.q.options().dtype(acc);
  // The kernel writes dq/dk/dv whole; TND tokens outside every sequence stay zero.
  const auto grad_like = [&](const at::Tensor& t) {
    return p.tnd || prep.numels == 0 ? at::zeros_like(t) : at::empty_like(t);
  };
  at::Tensor dq = grad_like(prep.q), dk = grad_like(prep.k), dv = grad_like(prep.v);
  const std::vector<int64_t> k_heads =
      p.tnd ? std::vector<int64_t>{p.heads_q, prep.seq_kv, p.head_dim}
            : std::vector<int64_t>{p.batch, p.heads_q, prep.seq_kv, p.head_dim};
  std::vector<int64_t> v_heads = k_heads;
  v_heads.back() = p.head_dim_v;
  at::Tensor dk_heads = at::empty(k_heads, opts);
  at::Tensor dv_heads = at::empty(v_heads, opts);
  at::Tensor dpse_acc;
  if (pse.has_value()) {
    dpse_acc = at::zeros({p.batch, p.heads_q, pse->size(2), prep.seq_kv}, opts);
  }
  at::Tensor dsink_parts;
  if (sink.has_value()) dsink_parts = at::zeros({p.batch, p.heads_q}, opts.dtype(at::kFloat));
  if (prep.numels > 0) {
    attention_bwd.get(op, prep.q)(p, prep.q, prep.k, prep.v, dy_in, out_in, smax, ssum, dq, dk, dv,
                                dk_heads, dv_heads, dpse_acc, dsink_parts);
  }

  at::Tensor dpse = at::empty({0}, query.options());
  if (pse.has_value()) {
    std::vector<int64_t> reduce;
    if (pse->size(0) == 1) reduce.push_back(0);
    if (pse->size(1) == 1) reduce.push_back(1);
    at::Tensor summed = reduce.empty() ? dpse_acc : dpse_acc.sum(reduce, /*keepdim=*/true);
    dpse = summed.to(pse->scalar_type()).contiguous();
  }
  at::Tensor dsink = sink.has_value() ? dsink_parts.sum(0) : at::empty({0}, query.options().dtype(at::kFloat));
  return {dq.to(prep.dtype), dk.to(key.scalar_type()), dv.to(value.scalar_type()), dpse, dsink};
}

ForwardOutputs npu_fusion_attention(FA_PARAMS) {
  return fusion_attention_forward(kFwd, query, key, value, head_num, input_layout, pse,
                                  padding_mask, atten_mask, scale, keep_prob, pre_tockens,
                                  next_tockens, inner_precise, prefix, actual_seq_qlen,
                                  actual_seq_kvlen, sparse_mode, gen_mask_parallel, sync,
                                  softmax_layout, sink, dropout_mask, seed, offset);
}

GradOutputs npu_fusion_attention_grad(FA_GRAD_PARAMS(c10::SymInt, c10::SymInt)) {
  return fusion_attention_backward(
      kBwd, query, key, value, dy, head_num, input_layout, pse, padding_mask, atten_mask,
      softmax_max, softmax_sum, softmax_in, attention_in, scale_value, keep_prob, pre_tockens,
      next_tockens, inner_precise, seed.expect_int(), offset.expect_int(), numels.expect_int(),
      prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode, gen_mask_parallel, sync,
      softmax_layout, sink);
}

// ----------------------------------------------------------------------------- v3: host tensors

constexpr const char* kFwdV3 = "npu_fusion_attention_v3";
constexpr const char* kBwdV3 = "npu_fusion_attention_grad_v3";

// actual_seq_qlen / actual_seq_kvlen of the v3 ops: a 1-D integer tensor in host memory (CPU, or
// npu, whose memory is the host's) -> its values.
std::optional<std::vector<int64_t>> host_ints(const char* op, const char* arg,
                                              const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return std::nullopt;
  OPENNPU_CHECK_ARG(t->device().is_cpu(), op, arg,
                    "must be a CPU (host) tensor of cumulative sequence ends, but got one on ",
                    t->device());
  OPENNPU_CHECK_ARG(t->dim() == 1 && at::isIntegralType(t->scalar_type(), /*includeBool=*/false),
                    op, arg, "must be a 1-D integer tensor of cumulative sequence ends, but got ",
                    t->scalar_type(), " ", shape_str(t->sizes()));
  const at::Tensor values = t->to(at::kLong).contiguous();
  const int64_t* data = values.const_data_ptr<int64_t>();
  return std::vector<int64_t>(data, data + values.numel());
}

// seed / offset of npu_fusion_attention_grad_v3: the one-element int64 tensors the forward
// returned (absent: 0).
int64_t host_scalar(const char* op, const char* arg, const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return 0;
  OPENNPU_CHECK_ARG(t->numel() == 1 && at::isIntegralType(t->scalar_type(), false), op, arg,
                    "must be the one-element integer tensor npu_fusion_attention_v3 returned, "
                    "but got ", t->scalar_type(), " ", shape_str(t->sizes()));
  return t->item<int64_t>();
}

std::optional<std::vector<int64_t>> concrete_ints(at::OptionalSymIntArrayRef values) {
  if (!values.has_value()) return std::nullopt;
  std::vector<int64_t> out;
  out.reserve(values->size());
  for (const c10::SymInt& v : *values) out.push_back(v.expect_int());
  return out;
}

at::OptionalIntArrayRef as_ref(const std::optional<std::vector<int64_t>>& v) {
  return v.has_value() ? at::OptionalIntArrayRef(*v) : at::OptionalIntArrayRef();
}

// seed and offset as torch_npu's v3 returns them: one-element int64 tensors (on query's device;
// torch_npu returns CPU tensors outside graph capture).
at::Tensor id_tensor(const at::Tensor& query, int64_t value) {
  return at::full({1}, value, query.options().dtype(at::kLong));
}

using V3Outputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The parameters of npu_fusion_attention_v3 and its .out form (whose prefix is int[]?, not
// SymInt[]?), up to sink.
#define FA_V3_PARAMS(PREFIX)                                                                      \
  FA_HEAD, PREFIX prefix, const std::optional<at::Tensor>&actual_seq_qlen,                        \
      const std::optional<at::Tensor>&actual_seq_kvlen, int64_t sparse_mode,                     \
      bool gen_mask_parallel, bool sync, c10::string_view softmax_layout,                        \
      const std::optional<at::Tensor>&sink

// The same for npu_fusion_attention_grad_v3 and its .out form.
#define FA_GRAD_V3_PARAMS(PREFIX)                                                                 \
  FA_GRAD_HEAD, const std::optional<at::Tensor>&seed,                                             \
      const std::optional<at::Tensor>&offset, PREFIX prefix,                                     \
      const std::optional<at::Tensor>&actual_seq_qlen,                                           \
      const std::optional<at::Tensor>&actual_seq_kvlen, int64_t sparse_mode,                     \
      bool gen_mask_parallel, bool sync, c10::string_view softmax_layout,                        \
      const std::optional<at::Tensor>&sink

// v3 with an int[] prefix: both overloads end here.
V3Outputs fusion_attention_v3(FA_V3_PARAMS(at::OptionalIntArrayRef)) {
  const auto qlen = host_ints(kFwdV3, "actual_seq_qlen", actual_seq_qlen);
  const auto kvlen = host_ints(kFwdV3, "actual_seq_kvlen", actual_seq_kvlen);
  auto [out, smax, ssum, sout, seed, offset, numels] = fusion_attention_forward(
      kFwdV3, query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale,
      keep_prob, pre_tockens, next_tockens, inner_precise, prefix, as_ref(qlen), as_ref(kvlen),
      sparse_mode, gen_mask_parallel, sync, softmax_layout, sink, std::nullopt, 0, 0);
  return {out, smax, ssum, sout, id_tensor(query, seed.expect_int()),
          id_tensor(query, offset.expect_int())};
}

V3Outputs npu_fusion_attention_v3(FA_V3_PARAMS(at::OptionalSymIntArrayRef)) {
  const auto prefix_values = concrete_ints(prefix);
  return fusion_attention_v3(query, key, value, head_num, input_layout, pse, padding_mask,
                             atten_mask, scale, keep_prob, pre_tockens, next_tockens,
                             inner_precise, as_ref(prefix_values), actual_seq_qlen,
                             actual_seq_kvlen, sparse_mode, gen_mask_parallel, sync,
                             softmax_layout, sink);
}

std::tuple<at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&>
npu_fusion_attention_v3_out(FA_V3_PARAMS(at::OptionalIntArrayRef),
                            const std::optional<at::Tensor>& /*workspace*/,
                            at::Tensor& attention_score, at::Tensor& softmax_max,
                            at::Tensor& softmax_sum, at::Tensor& softmax_out, at::Tensor& seed,
                            at::Tensor& offset) {
  const V3Outputs r = fusion_attention_v3(
      query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale, keep_prob,
      pre_tockens, next_tockens, inner_precise, prefix, actual_seq_qlen, actual_seq_kvlen,
      sparse_mode, gen_mask_parallel, sync, softmax_layout, sink);
  copy_out(attention_score, std::get<0>(r), kFwdV3, "attention_score");
  copy_out(softmax_max, std::get<1>(r), kFwdV3, "softmax_max");
  copy_out(softmax_sum, std::get<2>(r), kFwdV3, "softmax_sum");
  copy_out(softmax_out, std::get<3>(r), kFwdV3, "softmax_out");
  copy_out(seed, std::get<4>(r), kFwdV3, "seed");
  copy_out(offset, std::get<5>(r), kFwdV3, "offset");
  return {attention_score, softmax_max, softmax_sum, softmax_out, seed, offset};
}

// grad_v3 with an int[] prefix: both overloads end here.
GradOutputs fusion_attention_grad_v3(FA_GRAD_V3_PARAMS(at::OptionalIntArrayRef)) {
  const auto qlen = host_ints(kBwdV3, "actual_seq_qlen", actual_seq_qlen);
  const auto kvlen = host_ints(kBwdV3, "actual_seq_kvlen", actual_seq_kvlen);
  return fusion_attention_backward(
      kBwdV3, query, key, value, dy, head_num, input_layout, pse, padding_mask, atten_mask,
      softmax_max, softmax_sum, softmax_in, attention_in, scale_value, keep_prob, pre_tockens,
      next_tockens, inner_precise, host_scalar(kBwdV3, "seed", seed),
      host_scalar(kBwdV3, "offset", offset), std::nullopt, prefix, as_ref(qlen), as_ref(kvlen),
      sparse_mode, gen_mask_parallel, sync, softmax_layout, sink);
}

GradOutputs npu_fusion_attention_grad_v3(FA_GRAD_V3_PARAMS(at::OptionalSymIntArrayRef)) {
  const auto prefix_values = concrete_ints(prefix);
  return fusion_attention_grad_v3(
      query, key, value, dy, head_num, input_layout, pse, padding_mask, atten_mask, softmax_max,
      softmax_sum, softmax_in, attention_in, scale_value, keep_prob, pre_tockens, next_tockens,
      inner_precise, seed, offset, as_ref(prefix_values), actual_seq_qlen, actual_seq_kvlen,
      sparse_mode, gen_mask_parallel, sync, softmax_layout, sink);
}

std::tuple<at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&>
npu_fusion_attention_grad_v3_out(FA_GRAD_V3_PARAMS(at::OptionalIntArrayRef),
                                 const std::optional<at::Tensor>& /*workspace*/, at::Tensor& dq,
                                 at::Tensor& dk, at::Tensor& dv, at::Tensor& dpse,
                                 at::Tensor& dsink) {
  const GradOutputs r = fusion_attention_grad_v3(
      query, key, value, dy, head_num, input_layout, pse, padding_mask, atten_mask, softmax_max,
      softmax_sum, softmax_in, attention_in, scale_value, keep_prob, pre_tockens, next_tockens,
      inner_precise, seed, offset, prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode,
      gen_mask_parallel, sync, softmax_layout, sink);
  copy_out(dq, std::get<0>(r), kBwdV3, "dq");
  copy_out(dk, std::get<1>(r), kBwdV3, "dk");
  copy_out(dv, std::get<2>(r), kBwdV3, "dv");
  copy_out(dpse, std::get<3>(r), kBwdV3, "dpse");
  copy_out(dsink, std::get<4>(r), kBwdV3, "dsink");
  return {dq, dk, dv, dpse, dsink};
}

#undef FA_HEAD
#undef FA_PARAMS
#undef FA_V3_PARAMS
#undef FA_GRAD_HEAD
#undef FA_GRAD_PARAMS
#undef FA_GRAD_V3_PARAMS

// ----------------------------------------------------------------------------- v2: MLA rope parts

constexpr const char* kFwdV2 = "npu_fusion_attention_v2";
constexpr const char* kBwdV2 = "npu_fusion_attention_grad_v2";

// query_rope / key_rope: a second query-key pair whose product adds to the scores,
// q . k + q_rope . k_rope, computed as one product of [q, q_rope] and [k, k_rope] (the head
// dims concatenated per head). rope_dim 0: no rope parts.
struct RopeParts {
  at::Tensor query, key;  // concatenated (or the inputs themselves)
  int64_t head_dim = 0, rope_dim = 0;
  bool split_heads = false;  // BSH / SBH: heads packed in the last dim
};

std::string upper(c10::string_view text) {
  std::string up(text);
  for (char& c : up) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return up;
}

// [.., heads * a] and [.., heads * b] -> [.., heads * (a + b)], each head's b after its a.
at::Tensor cat_per_head(const at::Tensor& x, const at::Tensor& rope, int64_t heads, bool split) {
  if (!split) return at::cat({x, rope}, -1);
  auto per_head = [&](const at::Tensor& t) {
    return t.reshape({t.size(0), t.size(1), heads, t.size(2) / heads});
  };
  return at::cat({per_head(x), per_head(rope)}, -1).flatten(2);
}

// The inverse of cat_per_head: the first `a` and the last `b` values of each head.
std::pair<at::Tensor, at::Tensor> split_per_head(const at::Tensor& t, int64_t heads, int64_t a,
                                                 int64_t b, bool split) {
  if (!split) return {t.narrow(-1, 0, a).contiguous(), t.narrow(-1, a, b).contiguous()};
  const at::Tensor h = t.reshape({t.size(0), t.size(1), heads, a + b});
  return {h.narrow(-1, 0, a).flatten(2).contiguous(), h.narrow(-1, a, b).flatten(2).contiguous()};
}

RopeParts with_rope(const char* op, const at::Tensor& query, const at::Tensor& key,
                    int64_t head_num, c10::string_view input_layout,
                    const std::optional<at::Tensor>& query_rope,
                    const std::optional<at::Tensor>& key_rope) {
  RopeParts r{query, key};
  OPENNPU_CHECK_ARG(query_rope.has_value() == key_rope.has_value(), op,
                    query_rope.has_value() ? "key_rope" : "query_rope",
                    "must be given together with ",
                    query_rope.has_value() ? "query_rope" : "key_rope", ", but got None");
  if (!query_rope.has_value()) return r;
  const std::string layout = upper(input_layout);
  r.split_heads = layout == "BSH" || layout == "SBH";
  const at::Tensor& qr = *query_rope;
  const at::Tensor& kr = *key_rope;
  for (const auto& [name, t, ref, ref_name] :
       {std::tuple<const char*, const at::Tensor*, const at::Tensor*, const char*>{
            "query_rope", &qr, &query, "query"},
        {"key_rope", &kr, &key, "key"}}) {
    OPENNPU_CHECK_ARG(t->scalar_type() == query.scalar_type(), op, name,
                      "must have the dtype of 'query' (", query.scalar_type(), "), but got ",
                      t->scalar_type());
    check_same_device(op, name, *t, "query", query);
    bool same_lead = t->dim() == ref->dim() && t->dim() >= 1;
    for (int64_t i = 0; same_lead && i + 1 < t->dim(); ++i) same_lead = t->size(i) == ref->size(i);
    OPENNPU_CHECK_ARG(same_lead, op, name, "must have the shape of '", ref_name, "' ",
                      shape_str(ref->sizes()), " but for its last dim (the rope head size), but "
                      "got ", shape_str(t->sizes()));
  }
  OPENNPU_CHECK_ARG(head_num > 0, op, "head_num", "must be > 0, but got ", head_num);
  if (r.split_heads) {
    OPENNPU_CHECK_ARG(query.size(2) % head_num == 0 && qr.size(2) % head_num == 0, op,
                      "query_rope", "must have a hidden size divisible by head_num ", head_num,
                      " (as query), but got ", shape_str(qr.sizes()));
    r.head_dim = query.size(2) / head_num;
    r.rope_dim = qr.size(2) / head_num;
    const int64_t kv_heads = r.head_dim > 0 ? key.size(2) / r.head_dim : 0;
    OPENNPU_CHECK_ARG(kv_heads > 0 && key.size(2) % r.head_dim == 0 &&
                          kr.size(2) == kv_heads * r.rope_dim,
                      op, "key_rope", "must have a hidden size of ", kv_heads, " key heads x ",
                      r.rope_dim, " (the rope head size of query_rope), but got ",
                      shape_str(kr.sizes()));
    r.query = cat_per_head(query, qr, head_num, true);
    r.key = cat_per_head(key, kr, kv_heads, true);
  } else {
    r.head_dim = query.size(-1);
    r.rope_dim = qr.size(-1);
    OPENNPU_CHECK_ARG(kr.size(-1) == r.rope_dim, op, "key_rope",
                      "must have the rope head size of query_rope (", r.rope_dim, "), but got ",
                      kr.size(-1));
    r.query = cat_per_head(query, qr, head_num, false);
    r.key = cat_per_head(key, kr, 0, false);
  }
  return r;
}

// pse_type 1 (torch_npu's default): scale * (q k^T + pse), the kernels' form. pse_type 0:
// scale * q k^T + pse, computed as scale * (q k^T + pse / scale). 2 and 3 (the ALiBi bias
// generated from slopes) are not implemented.
std::optional<at::Tensor> pse_for_type(const char* op, const std::optional<at::Tensor>& pse,
                                       int64_t pse_type, double scale) {
  OPENNPU_CHECK_ARG(pse_type >= 0 && pse_type <= 3, op, "pse_type",
                    "must be 0, 1, 2 or 3, but got ", pse_type);
  OPENNPU_CHECK_ARG(pse_type <= 1, op, "pse_type",
                    pse_type, " (ALiBi bias generated from slopes) is not supported by opennpu; "
                    "pass the bias itself with pse_type 0 or 1");
  if (pse_type == 1 || !pse.has_value()) return pse;
  OPENNPU_CHECK_ARG(scale != 0.0, op, "scale",
                    "must be nonzero with pse_type 0 and a pse, but got 0");
  check_floating(op, "pse", *pse);
  return pse->to(acc_dtype(*pse)).div(scale);
}

using V2Outputs = ForwardOutputs;

V2Outputs npu_fusion_attention_v2(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t head_num,
    c10::string_view input_layout, const std::optional<at::Tensor>& pse,
    const std::optional<at::Tensor>& padding_mask, const std::optional<at::Tensor>& atten_mask,
    const std::optional<at::Tensor>& query_rope, const std::optional<at::Tensor>& key_rope,
    double scale, double keep_prob, int64_t pre_tokens, int64_t next_tokens,
    int64_t inner_precise, at::OptionalIntArrayRef prefix,
    at::OptionalIntArrayRef actual_seq_qlen, at::OptionalIntArrayRef actual_seq_kvlen,
    int64_t sparse_mode, bool gen_mask_parallel, bool sync, int64_t pse_type,
    at::OptionalIntArrayRef /*q_start_idx*/, at::OptionalIntArrayRef /*kv_start_idx*/,
    c10::string_view softmax_layout, const std::optional<at::Tensor>& sink,
    const std::optional<at::Tensor>& dropout_mask, int64_t seed, int64_t offset) {
  const RopeParts r = with_rope(kFwdV2, query, key, head_num, input_layout, query_rope, key_rope);
  return fusion_attention_forward(
      kFwdV2, r.query, r.key, value, head_num, input_layout,
      pse_for_type(kFwdV2, pse, pse_type, scale), padding_mask, atten_mask, scale, keep_prob,
      pre_tokens, next_tokens, inner_precise, prefix, actual_seq_qlen, actual_seq_kvlen,
      sparse_mode, gen_mask_parallel, sync, softmax_layout, sink, dropout_mask, seed, offset);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
npu_fusion_attention_grad_v2(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& dy,
    int64_t head_num, c10::string_view input_layout, const std::optional<at::Tensor>& pse,
    const std::optional<at::Tensor>& padding_mask, const std::optional<at::Tensor>& atten_mask,
    const std::optional<at::Tensor>& softmax_max, const std::optional<at::Tensor>& softmax_sum,
    const std::optional<at::Tensor>& softmax_in, const std::optional<at::Tensor>& attention_in,
    const std::optional<at::Tensor>& query_rope, const std::optional<at::Tensor>& key_rope,
    double scale_value, double keep_prob, int64_t pre_tokens, int64_t next_tokens,
    int64_t inner_precise, c10::SymInt seed, c10::SymInt offset, c10::SymInt numels,
    at::OptionalIntArrayRef prefix, at::OptionalIntArrayRef actual_seq_qlen,
    at::OptionalIntArrayRef actual_seq_kvlen, int64_t sparse_mode, bool gen_mask_parallel,
    bool sync, int64_t pse_type, at::OptionalIntArrayRef /*q_start_idx*/,
    at::OptionalIntArrayRef /*kv_start_idx*/, c10::string_view softmax_layout,
    const std::optional<at::Tensor>& sink) {
  const RopeParts r = with_rope(kBwdV2, query, key, head_num, input_layout, query_rope, key_rope);
  auto [dq, dk, dv, dpse, dsink] = fusion_attention_backward(
      kBwdV2, r.query, r.key, value, dy, head_num, input_layout,
      pse_for_type(kBwdV2, pse, pse_type, scale_value), padding_mask, atten_mask, softmax_max,
      softmax_sum, softmax_in, attention_in, scale_value, keep_prob, pre_tokens, next_tokens,
      inner_precise, seed.expect_int(), offset.expect_int(), numels.expect_int(), prefix,
      actual_seq_qlen, actual_seq_kvlen, sparse_mode, gen_mask_parallel, sync, softmax_layout,
      sink);
  if (pse.has_value() && pse_type == 0) dpse = dpse.div(scale_value).to(pse->scalar_type());
  at::Tensor dq_rope = at::empty({0}, query.options());
  at::Tensor dk_rope = at::empty({0}, query.options());
  if (query_rope.has_value()) {
    const int64_t kv_heads = r.split_heads ? key.size(2) / r.head_dim : 0;
    std::tie(dq, dq_rope) = split_per_head(dq, head_num, r.head_dim, r.rope_dim, r.split_heads);
    std::tie(dk, dk_rope) = split_per_head(dk, kv_heads, r.head_dim, r.rope_dim, r.split_heads);
  }
  return {dq, dk, dv, dpse, dq_rope, dk_rope, dsink};
}

// Bit-packed dropout keep mask: bit k (little-endian within each byte) is 1 iff element k is kept
// with probability 1 - p. Padded to a multiple of 128 bits; padding bits are 0.
at::Tensor npu_dropout_gen_mask(const at::Tensor& self, c10::IntArrayRef size, double p,
                                int64_t seed, int64_t offset, std::optional<bool> /*parallel*/,
                                std::optional<bool> /*sync*/) {
  constexpr const char* op = "_npu_dropout_gen_mask";
  OPENNPU_CHECK_ARG(p >= 0.0 && p <= 1.0, op, "p", "must be a drop probability in [0, 1], but got ", p);
  int64_t numels = 1;
  for (const int64_t s : size) {
    OPENNPU_CHECK_ARG(s >= 0, op, "size", "must have non-negative sizes, but got ", size);
    // numels + 127 below must not overflow either
    OPENNPU_CHECK_ARG(!__builtin_mul_overflow(numels, s, &numels) &&
                          numels <= std::numeric_limits<int64_t>::max() - 127,
                      op, "size", "must describe fewer than 2**63 - 127 elements, but got ", size);
  }
  const int64_t bytes = (numels + 127) / 128 * 16;
  at::Tensor mask = at::zeros({bytes}, self.options().dtype(at::kByte));
  uint8_t* out = mask.data_ptr<uint8_t>();
  const uint64_t threshold = keep_threshold(1.0 - p);
  at::parallel_for(0, (numels + 7) / 8, 4096, [&](int64_t begin, int64_t end) {
    uint8_t keep[8];
    for (int64_t byte = begin; byte < end; ++byte) {
      const int64_t first = byte * 8;
      const int64_t count = std::min<int64_t>(8, numels - first);
      philox_keep_bits(static_cast<uint64_t>(seed), static_cast<uint64_t>(offset), first, count,
                       threshold, keep);
      uint8_t packed = 0;
      for (int64_t bit = 0; bit < count; ++bit) packed |= static_cast<uint8_t>(keep[bit] << bit);
      out[byte] = packed;
    }
  });
  return mask;
}

}  // namespace

TORCH_LIBRARY_IMPL(npu, CPU, m) {
  m.impl("npu_fusion_attention", &npu_fusion_attention);
  m.impl("npu_fusion_attention_grad", &npu_fusion_attention_grad);
  m.impl("npu_fusion_attention_v2", &npu_fusion_attention_v2);
  m.impl("npu_fusion_attention_grad_v2", &npu_fusion_attention_grad_v2);
  m.impl("npu_fusion_attention_v3", &npu_fusion_attention_v3);
  m.impl("npu_fusion_attention_v3.out", &npu_fusion_attention_v3_out);
  m.impl("npu_fusion_attention_grad_v3", &npu_fusion_attention_grad_v3);
  m.impl("npu_fusion_attention_grad_v3.out", &npu_fusion_attention_grad_v3_out);
  m.impl("_npu_dropout_gen_mask.Tensor", &npu_dropout_gen_mask);
}

}  // namespace opennpu::attention
