// Entry points of npu_fused_infer_attention_score (and .out, _get_max_workspace, _infer_output)
// and npu_fused_infer_attention_score_v2: argument validation in torch_npu's terms, layouts,
// sequence lengths, paged KV cache, masks; prefill on the training kernels (attention_fwd_cpu),
// decode on infer_decode_cpu.
#include "ops/attention/infer_attention.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/log.h>
#include <ATen/ops/roll.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <c10/core/SymIntArrayRef.h>
#include <torch/library.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "common/checks.h"
#include "common/dtype.h"
#include "ops/quant/hifloat8.h"
#include "ops/quant/quant.h"
#include "ops/quant/quant_matmul.h"

namespace opennpu::attention {

KernelSlots<InferDecodeFn> infer_decode;

namespace {

constexpr const char* kOp = "npu_fused_infer_attention_score";
constexpr const char* kOpV2 = "npu_fused_infer_attention_score_v2";
constexpr double kNegInf = -std::numeric_limits<double>::infinity();

enum class L { BSH, BSND, BNSD, NBSD, TND, NTD, NSD };

struct Layouts {
  L in, out;
};

Layouts parse_layout(const char* op, c10::string_view text) {
  std::string up(text);
  for (char& c : up) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  static const std::pair<const char*, Layouts> table[] = {
      {"BSH", {L::BSH, L::BSH}},         {"BSND", {L::BSND, L::BSND}},
      {"BNSD", {L::BNSD, L::BNSD}},      {"TND", {L::TND, L::TND}},
      {"NTD", {L::NTD, L::NTD}},         {"NSD", {L::NSD, L::NSD}},
      {"BNSD_BSND", {L::BNSD, L::BSND}}, {"BSH_BNSD", {L::BSH, L::BNSD}},
      {"BSND_BNSD", {L::BSND, L::BNSD}}, {"BSH_NBSD", {L::BSH, L::NBSD}},
      {"BSND_NBSD", {L::BSND, L::NBSD}}, {"BNSD_NBSD", {L::BNSD, L::NBSD}},
      {"TND_NTD", {L::TND, L::NTD}},     {"NTD_TND", {L::NTD, L::TND}},
  };
  for (const auto& [name, l] : table) {
    if (up == name) return l;
  }
  OPENNPU_CHECK_ARG(false, op, "input_layout",
                    "must be one of BSH, BSND, BNSD, TND, NTD, NSD, BNSD_BSND, BSH_BNSD, "
                    "BSND_BNSD, BSH_NBSD, BSND_NBSD, BNSD_NBSD, TND_NTD, NTD_TND, but got '",
                    std::string(text), "'");
  return {};
}

bool varlen(L l) { return l == L::TND || l == L::NTD; }
int64_t rank_of(L l) { return (l == L::BSND || l == L::BNSD) ? 4 : 3; }

// [B, N, S, D] (or varlen [T, N, D]) view of a tensor in layout l with `heads` heads.
at::Tensor canonical(const at::Tensor& t, L l, int64_t heads) {
  switch (l) {
    case L::BSH: return t.unflatten(2, {heads, t.size(2) / heads}).permute({0, 2, 1, 3});
    case L::BSND: return t.permute({0, 2, 1, 3});
    case L::BNSD: return t;
    case L::NBSD: return t.permute({1, 0, 2, 3});
    case L::NSD: return t.unsqueeze(0);
    case L::TND: return t;
    case L::NTD: return t.permute({1, 0, 2});
  }
  return t;
}

SeqView view_of(const at::Tensor& c) {
  if (c.dim() == 3) return {0, c.stride(1), c.stride(0)};
  return {c.stride(0), c.stride(1), c.stride(2)};
}

std::vector<int64_t> out_shape(L l, int64_t b, int64_t n, int64_t s, int64_t d) {
  switch (l) {
    case L::BSH: return {b, s, n * d};
    case L::BSND: return {b, s, n, d};
    case L::BNSD: return {b, n, s, d};
    case L::NBSD: return {n, b, s, d};
    case L::NSD: return {n, s, d};
    case L::TND: return {s, n, d};
    case L::NTD: return {n, s, d};
  }
  return {};
}

std::vector<int64_t> to_ints(at::OptionalSymIntArrayRef a) {
  std::vector<int64_t> out;
  if (!a.has_value()) return out;
  for (const c10::SymInt& s : *a) out.push_back(s.guard_int(__FILE__, __LINE__));
  return out;
}

void reject(const char* op, const char* arg, const std::optional<at::Tensor>& t, const char* what) {
  OPENNPU_CHECK_ARG(!t.has_value(), op, arg, "is not supported by opennpu (", what,
                    "); pass None");
}

// Antiquant factors of one side (key or value) of an int8 cache, as an entry point passes them:
// `index` >= 0 when they are row `index` of v1's combined [2, ...] antiquant_scale/offset.
struct Antiquant {
  std::optional<at::Tensor> scale, offset;
  int64_t mode = 0;
  int64_t index = -1;
  const char* scale_name = "";
  const char* offset_name = "";
  const char* mode_name = "";
};

// The arguments both versions share, in v1's names.
struct Args {
  const at::Tensor& query;
  const at::Tensor& key;
  const at::Tensor& value;
  const std::optional<at::Tensor>& pse_shift;
  const std::optional<at::Tensor>& atten_mask;
  std::vector<int64_t> actual_seq_lengths, actual_seq_lengths_kv;
  bool has_seq, has_seq_kv;
  const std::optional<at::Tensor>& block_table;
  const std::optional<at::Tensor>& query_rope;
  const std::optional<at::Tensor>& key_rope;
  const std::optional<at::Tensor>& sink;
  int64_t num_heads;
  double scale;
  int64_t pre_tokens, next_tokens;
  c10::string_view input_layout;
  int64_t num_key_value_heads;
  int64_t sparse_mode;
  int64_t inner_precise;
  int64_t block_size;
  bool softmax_lse_flag;
  Antiquant kq{}, vq{};  // no scale: float key/value
  bool float_out = false;  // attention_out in float32 whatever query's dtype (to be quantised)
  // Full int8 quantisation (see full_quant()): P's quantisation factor (quant_scale1; 0: off)
  // and dequant_scale2; query / key / value here are the int8 codes as float32.
  float p_quant = 0.0f;
  double dequant2 = 1.0;
  // v2's int8 MLA (query_quant_mode 3): the int8 latent cache with rope parts (prefill kernel)
  bool int8_mla = false;
};

// The factors of one side in the form the kernels read (KvQuant): fp32, contiguous,
// kChannel [KVN, width]; kToken [B, 1 | KVN, S] (logical rows) or [blocks, 1 | KVN, block_size]
// (paged, modes 4 / 5).
struct QuantTable {
  KvQuant::Kind kind = KvQuant::Kind::kNone;
  at::Tensor scale, offset;
  bool paged = false;

  KvQuant view() const {
    KvQuant q;
    q.kind = kind;
    if (kind == KvQuant::Kind::kNone) return q;
    q.scale = scale.const_data_ptr<float>();
    q.offset = offset.defined() ? offset.const_data_ptr<float>() : nullptr;
    if (kind == KvQuant::Kind::kToken) {
      q.stride_blk = scale.stride(0);
      q.stride_n = scale.size(1) == 1 ? 0 : scale.stride(1);
      q.stride_s = scale.stride(2);
      q.paged = paged;
    }
    return q;
  }
};

// Checks one side's factors against torch_npu's shapes for its mode and normalises them.
//   mode 0: per-channel (1, KV_N, 1, D), (1, KV_N, D), (1, H), (KV_N, 1, D), (KV_N, D), (H), or
//           per-tensor (1,); mode 1: per-token (1, B, KV_S) or (B, KV_S), float32;
//   mode 2: per-tensor per-head (KV_N,); mode 3: per-token per-head (B, KV_N, KV_S), float32;
//   mode 4 / 5: per-token of a paged cache (blocknum, block_size) / (blocknum, KV_N, block_size),
//           float32. A combined [2, ...] antiquant_scale holds the key (row 0) and value (row 1)
//           factors in these shapes (modes 0 and 1).
// Offsets have the scale's shape; (x + offset) * scale is what the kernels compute.
QuantTable quant_table(const char* op, const Antiquant& aq, const at::Tensor& query, int64_t kvn,
                       int64_t width, int64_t batch, int64_t max_kv, bool paged, bool tnd,
                       int64_t blocks, int64_t block_size) {
  QuantTable qt;
  const int64_t mode = aq.mode;
  const bool token = mode == 1 || mode == 3 || mode == 4 || mode == 5;
  const auto take = [&](const at::Tensor& t, const char* name) {
    check_same_device(op, name, t, "query", query);
    const at::ScalarType st = t.scalar_type();
    OPENNPU_CHECK_ARG(token ? st == at::kFloat
                            : (st == at::kHalf || st == at::kBFloat16 || st == at::kFloat),
                      op, name, "must be ", token ? "float32" : "float16, bfloat16 or float32",
                      " for ", aq.mode_name, " ", mode, ", but got ", st);
    if (aq.index < 0) return t;
    OPENNPU_CHECK_ARG(t.dim() >= 1 && t.size(0) == 2, op, name,
                      "must hold the key (row 0) and value (row 1) factors in a leading dim of "
                      "2, but got shape ", shape_str(t.sizes()));
    return t.select(0, aq.index);
  };
  at::Tensor sc = take(*aq.scale, aq.scale_name);
  at::Tensor off;
  if (aq.offset.has_value()) {
    OPENNPU_CHECK_ARG(aq.offset->sizes() == aq.scale->sizes(), op, aq.offset_name,
                      "must have the shape of '", aq.scale_name, "' ",
                      shape_str(aq.scale->sizes()), ", but got ", shape_str(aq.offset->sizes()));
    off = take(*aq.offset, aq.offset_name);
  }
  const std::vector<int64_t> sz(sc.sizes().begin(), sc.sizes().end());
  const auto is = [&](std::initializer_list<int64_t> shape) {
    return sz == std::vector<int64_t>(shape);
  };
  const int64_t H = kvn * width;
  std::vector<int64_t> target;  // the normalised shape, before expanding
  std::string expected;
  switch (mode) {
    case 0:
      if (is({}) || is({1})) {
        target = {1, 1};
      } else if (is({1, kvn, 1, width}) || is({1, kvn, width}) || is({1, H}) ||
                 is({kvn, 1, width}) || is({kvn, width}) || is({H})) {
        target = {kvn, width};
      }
      expected = "(1, KV_N, 1, D), (1, KV_N, D), (1, H), (KV_N, 1, D), (KV_N, D), (H) (per "
                 "channel) or (1,) (per tensor)";
      break;
    case 1:
      if (sz.size() == 3 && sz[0] == 1 && sz[1] == batch) target = {batch, 1, sz[2]};
      if (sz.size() == 2 && sz[0] == batch) target = {batch, 1, sz[1]};
      expected = "(1, B, KV_S) or (B, KV_S) (per token)";
      break;
    case 2:
      if (is({kvn})) target = {kvn, 1};
      expected = "(KV_N,) (per tensor and head)";
      break;
    case 3:
      if (sz.size() == 3 && sz[0] == batch && sz[1] == kvn) target = sz;
      expected = "(B, KV_N, KV_S) (per token and head)";
      break;
    case 4:
      if (is({blocks, block_size})) target = {blocks, 1, block_size};
      expected = "(blocknum, block_size) (per token of a paged cache)";
      break;
    case 5:
      if (is({blocks, kvn, block_size})) target = sz;
      expected = "(blocknum, KV_N, block_size) (per token and head of a paged cache)";
      break;
    default:
      OPENNPU_CHECK_ARG(false, op, aq.mode_name, "must be in [0, 5], but got ", mode);
  }
  OPENNPU_CHECK_ARG(!(mode == 4 || mode == 5) || paged, op, aq.mode_name, "may be ", mode,
                    " only with a paged cache (block_table), but block_table is None");
  OPENNPU_CHECK_ARG(!target.empty(), op, aq.scale_name, "must be ", expected, " for ",
                    aq.mode_name, " ", mode, " with B = ", batch, ", KV_N = ", kvn, ", D = ", width,
                    paged ? ", blocknum = " + std::to_string(blocks) + ", block_size = " +
                                std::to_string(block_size)
                          : std::string(),
                    ", but got shape ", shape_str(aq.index < 0 ? aq.scale->sizes() : sc.sizes()),
                    aq.index < 0 ? "" : " (after taking its row)");
  if (mode == 1 || mode == 3) {
    OPENNPU_CHECK_ARG(target[2] >= max_kv, op, aq.scale_name, "must cover the ", max_kv,
                      " keys read (KV_S >= ", max_kv, "), but got shape ",
                      shape_str(aq.scale->sizes()));
    OPENNPU_CHECK_ARG(!tnd || paged, op, aq.mode_name, "may be ", mode,
                      " (per token) with input_layout TND/NTD only with a paged cache");
  }
  const auto norm = [&](const at::Tensor& t) {
    at::Tensor r = t.to(at::kFloat).reshape(target);
    if (target[0] == 1 && target.size() == 2) r = r.expand({kvn, width});
    if (target.size() == 2 && target[1] == 1) r = r.expand({kvn, width});
    return r.contiguous();
  };
  qt.kind = token ? KvQuant::Kind::kToken : KvQuant::Kind::kChannel;
  qt.paged = mode == 4 || mode == 5;
  qt.scale = norm(sc);
  if (off.defined()) qt.offset = norm(off);
  return qt;
}

// Shapes of the outputs (what _infer_output computes).
struct Shapes {
  Layouts l;
  int64_t heads, kv_heads, batch, seq_q, dim_v;
  std::vector<int64_t> out, lse;
};

Shapes output_shapes(const char* op, const at::Tensor& query, const at::Tensor& value,
                     c10::string_view layout, bool paged, int64_t num_heads,
                     int64_t num_key_value_heads, bool lse_flag) {
  Shapes s;
  s.l = parse_layout(op, layout);
  OPENNPU_CHECK_ARG(num_heads > 0, op, "num_heads", "must be > 0, but got ", num_heads);
  OPENNPU_CHECK_ARG(num_key_value_heads >= 0, op, "num_key_value_heads", "must be >= 0, but got ",
                    num_key_value_heads);
  s.heads = num_heads;
  s.kv_heads = num_key_value_heads == 0 ? num_heads : num_key_value_heads;
  OPENNPU_CHECK_ARG(num_heads % s.kv_heads == 0, op, "num_key_value_heads",
                    "must divide num_heads ", num_heads, " (grouped-query attention), but got ",
                    num_key_value_heads);
  const L in = s.l.in;
  OPENNPU_CHECK_ARG(query.dim() == rank_of(in), op, "query", "must be ", rank_of(in),
                    "-D for input_layout '", std::string(layout), "', but got shape ",
                    shape_str(query.sizes()));
  OPENNPU_CHECK_ARG(in != L::BSH || query.size(2) % num_heads == 0, op, "query",
                    "must have a hidden size divisible by num_heads ", num_heads,
                    ", but got shape ", shape_str(query.sizes()));
  const at::Tensor qc = canonical(query, in, num_heads);
  OPENNPU_CHECK_ARG(qc.size(1) == num_heads, op, "num_heads",
                    "must equal the head count of 'query' (", qc.size(1), "), but got ",
                    num_heads);
  s.batch = varlen(in) ? 1 : qc.size(0);
  s.seq_q = varlen(in) ? qc.size(0) : qc.size(2);
  // value's head size: its last dim, or H / kv_heads for hidden-size layouts (BSH, paged BnBsH).
  const bool hidden = paged ? value.dim() == 3 : in == L::BSH;
  if (hidden) {
    OPENNPU_CHECK_ARG(value.dim() >= 1 && value.size(-1) % s.kv_heads == 0, op, "value",
                      "must have a hidden size divisible by the key/value head count ",
                      s.kv_heads, ", but got shape ", shape_str(value.sizes()));
    s.dim_v = value.size(-1) / s.kv_heads;
  } else if (paged && value.dim() == 5) {  // NZ: [num_blocks, KVN, D / c, block_size, c]
    s.dim_v = value.size(2) * value.size(4);
  } else {
    OPENNPU_CHECK_ARG(value.dim() >= 1, op, "value", "must have a head dim, but got a scalar");
    s.dim_v = value.size(-1);
  }
  OPENNPU_CHECK_ARG(varlen(in) == varlen(s.l.out), op, "input_layout", "is not supported: '",
                    std::string(layout), "'");
  s.out = out_shape(s.l.out, s.batch, num_heads, s.seq_q, s.dim_v);
  if (lse_flag) {
    s.lse = varlen(in) ? std::vector<int64_t>{s.seq_q, num_heads, 1}
                       : std::vector<int64_t>{s.batch, num_heads, s.seq_q, 1};
  } else {
    s.lse = {1};
  }
  return s;
}

// Per-batch lengths: none -> `full`; one value -> every batch; else the first `batch` values.
std::vector<int64_t> per_batch(const char* op, const char* arg, const std::vector<int64_t>& v,
                               bool given, int64_t batch, int64_t full) {
  if (!given) return std::vector<int64_t>(batch, full);
  OPENNPU_CHECK_ARG(v.size() == 1 || static_cast<int64_t>(v.size()) >= batch, op, arg,
                    "must hold one length or at least one per batch (", batch, "), but got ",
                    c10::IntArrayRef(v));
  std::vector<int64_t> out(batch);
  for (int64_t b = 0; b < batch; ++b) {
    out[b] = v.size() == 1 ? v[0] : v[b];
    OPENNPU_CHECK_ARG(out[b] >= 0 && out[b] <= full, op, arg, "must hold lengths in [0, ", full,
                      "], but got ", c10::IntArrayRef(v));
  }
  return out;
}

// Cumulative ends (TND) -> starts and lengths.
void cumulative(const char* op, const char* arg, const std::vector<int64_t>& v, int64_t total,
                std::vector<int64_t>& start, std::vector<int64_t>& len) {
  int64_t prev = 0;
  for (const int64_t end : v) {
    OPENNPU_CHECK_ARG(end >= prev, op, arg,
                      "must be non-decreasing cumulative sequence ends (lengths 2, 3 -> [2, 5]), "
                      "but got ", c10::IntArrayRef(v));
    start.push_back(prev);
    len.push_back(end - prev);
    prev = end;
  }
  OPENNPU_CHECK_ARG(prev <= total, op, arg, "ends at ", prev, " tokens, more than the tensor's T = ",
                    total);
}

bool decode_kernel_enabled() {
  const char* env = std::getenv("OPENNPU_FIA_DECODE");
  return env == nullptr || std::string(env) != "0";
}

// A paged cache in Ascend's NZ layout, [num_blocks, KVN, D / c, block_size, c] with c the
// elements of 32 bytes (16 for fp16 / bf16, 32 for int8, 8 for fp32; npu_scatter_pa_kv_cache's
// PA_NZ writes it): element (block, n, d / c, t, d % c) is channel d of row t of kv head n. The
// kernels read rows with a contiguous last dim, so the cache is copied into the
// [num_blocks, block_size, KVN, D] form once per call.
at::Tensor nz_cache_rows(const char* op, const char* name, const at::Tensor& t, int64_t kv_heads) {
  const int64_t c = 32 / static_cast<int64_t>(t.element_size());
  OPENNPU_CHECK_ARG(t.size(1) == kv_heads && t.size(4) == c, op, name,
                    "in the NZ layout must be [num_blocks, ", kv_heads, " (num_key_value_heads), "
                    "D / ", c, ", block_size, ", c, "] for ", t.scalar_type(), ", but got shape ",
                    shape_str(t.sizes()));
  return t.permute({0, 3, 1, 2, 4}).reshape({t.size(0), t.size(3), kv_heads, t.size(2) * c});
}

std::tuple<at::Tensor, at::Tensor> run(const char* op, const Args& a) {
  const at::Tensor& query = a.query;
  const bool paged = a.block_table.has_value();
  const Shapes sh = output_shapes(op, query, a.value, a.input_layout, paged, a.num_heads,
                                  a.num_key_value_heads, a.softmax_lse_flag);
  const L in = sh.l.in;
  const bool tnd = varlen(in);
  const int64_t N = sh.heads, KVN = sh.kv_heads;

  OPENNPU_CHECK_ARG(query.scalar_type() == at::kHalf || query.scalar_type() == at::kBFloat16 ||
                        query.scalar_type() == at::kFloat || query.scalar_type() == at::kDouble,
                    op, "query", "must be float16, bfloat16, float32 or float64, but got ",
                    query.scalar_type());
  // int8 key/value: antiquant (the factors are checked once the batch and lengths are known).
  const bool int8 = a.key.scalar_type() == at::kChar;
  const bool quant_given = a.kq.scale.has_value();
  if (int8) {
    OPENNPU_CHECK_ARG(quant_given, op, "key",
                      "is int8, which needs antiquant factors (key_antiquant_scale and "
                      "value_antiquant_scale, or antiquant_scale), but none were given");
    OPENNPU_CHECK_ARG(query.scalar_type() == at::kHalf || query.scalar_type() == at::kBFloat16 ||
                          query.scalar_type() == at::kFloat,
                      op, "query", "must be float16, bfloat16 or float32 with an int8 key/value "
                      "cache, but got ", query.scalar_type());
    OPENNPU_CHECK_ARG(!a.query_rope.has_value() || a.int8_mla, op, "key_rope",
                      "is not supported with an int8 key/value cache (MLA has no antiquant; "
                      "v2's int8 MLA takes an int8 query, query_quant_mode 3)");
  } else {
    OPENNPU_CHECK_ARG(!quant_given, op, a.kq.scale_name,
                      "applies to an int8 key/value cache, but 'key' is ", a.key.scalar_type(),
                      "; pass None");
  }
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"key", &a.key},
                                {"value", &a.value}}) {
    const at::ScalarType want = int8 ? at::kChar : query.scalar_type();
    OPENNPU_CHECK_ARG(t->scalar_type() == want, op, name,
                      int8 ? "must be int8 like 'key' (an int8 antiquant cache) ("
                           : "must have the dtype of 'query' (",
                      want, "), but got ", t->scalar_type(),
                      t->scalar_type() == at::kInt
                          ? " (an int4 key/value packed in int32 needs antiquant factors)"
                          : "");
    check_same_device(op, name, *t, "query", query);
  }
  OPENNPU_CHECK_ARG(a.query_rope.has_value() == a.key_rope.has_value(), op,
                    a.query_rope.has_value() ? "key_rope" : "query_rope",
                    "must be given together with ",
                    a.query_rope.has_value() ? "query_rope" : "key_rope");
  OPENNPU_CHECK_ARG(a.sparse_mode >= 0 && a.sparse_mode <= 4, op, "sparse_mode",
                    "must be 0, 1, 2, 3 or 4 (5-9 are not supported), but got ", a.sparse_mode);
  OPENNPU_CHECK_ARG(a.inner_precise >= 0 && a.inner_precise <= 3, op, "inner_precise",
                    "must be in [0, 3], but got ", a.inner_precise);

  // Query view and the head size of q/k.
  const at::Tensor q = canonical(query, in, N);
  const int64_t D = q.size(-1);
  const int64_t seq_q = sh.seq_q;

  // Key / value views: contiguous [B, KVN, S, D] / [T, KVN, D], or the paged cache
  // [blocks, block_size, KVN, D].
  const auto kv_view = [&](const at::Tensor& t, const char* name) -> at::Tensor {
    if (paged) {
      OPENNPU_CHECK_ARG(t.dim() == 3 || t.dim() == 4 || t.dim() == 5, op, name,
                        "must be a paged cache [num_blocks, block_size, H] or [num_blocks, "
                        "num_key_value_heads, block_size, D] (or NZ [num_blocks, "
                        "num_key_value_heads, D / c, block_size, c]) with block_table, but got "
                        "shape ", shape_str(t.sizes()));
      if (t.dim() == 5) return nz_cache_rows(op, name, t, KVN);
      if (t.dim() == 3) {
        OPENNPU_CHECK_ARG(t.size(2) % KVN == 0, op, name, "must have a hidden size divisible by ",
                          KVN, " key/value heads, but got shape ", shape_str(t.sizes()));
        return t.unflatten(2, {KVN, t.size(2) / KVN});
      }
      OPENNPU_CHECK_ARG(t.size(1) == KVN, op, name, "must have ", KVN,
                        " key/value heads (dim 1 of [num_blocks, N, block_size, D]), but got "
                        "shape ", shape_str(t.sizes()));
      return t.permute({0, 2, 1, 3});
    }
    OPENNPU_CHECK_ARG(t.dim() == rank_of(in), op, name, "must be ", rank_of(in),
                      "-D for input_layout '", std::string(a.input_layout), "', but got shape ",
                      shape_str(t.sizes()));
    if (in == L::BSH) {
      OPENNPU_CHECK_ARG(t.size(2) % KVN == 0, op, name, "must have a hidden size divisible by ",
                        KVN, " key/value heads, but got shape ", shape_str(t.sizes()));
    }
    const at::Tensor c = canonical(t, in, KVN);
    OPENNPU_CHECK_ARG(c.size(1) == KVN, op, name, "must have ", KVN,
                      " key/value heads (num_key_value_heads, or num_heads when 0), but got shape ",
                      shape_str(t.sizes()));
    return c;
  };
  const at::Tensor kc = kv_view(a.key, "key");
  const at::Tensor vc = kv_view(a.value, "value");
  OPENNPU_CHECK_ARG(kc.size(-1) == D, op, "key", "must have the head size of 'query' (", D,
                    "), but got ", kc.size(-1), " (shape ", shape_str(a.key.sizes()), ")");
  for (int64_t i = 0; i + 1 < kc.dim(); ++i) {
    OPENNPU_CHECK_ARG(kc.size(i) == vc.size(i), op, "value",
                      "must match 'key' in every dim but the head size (key ",
                      shape_str(a.key.sizes()), "), but got shape ", shape_str(a.value.sizes()));
  }
  const int64_t Dv = vc.size(-1);
  TORCH_INTERNAL_ASSERT(Dv == sh.dim_v);

  AttentionProblem p;
  p.heads_q = N;
  p.heads_kv = KVN;
  p.scale = a.scale;
  p.p_quant = a.p_quant;
  p.tnd = tnd;
  p.stats_token_major = tnd;

  // Sequences.
  int64_t batch = 0, kv_cap = 0;
  int64_t table_cols = 0;
  at::Tensor table;
  if (paged) {
    table = *a.block_table;
    check_same_device(op, "block_table", table, "query", query);
    OPENNPU_CHECK_ARG(table.scalar_type() == at::kInt && table.dim() == 2, op, "block_table",
                      "must be an int32 [B, max_blocks_per_seq] tensor, but got ",
                      table.scalar_type(), " ", shape_str(table.sizes()));
    OPENNPU_CHECK_ARG(a.block_size > 0 && a.block_size == kc.size(1), op, "block_size",
                      "must be the cache's block size ", kc.size(1), " (dim 1 of [num_blocks, "
                      "block_size, H] / dim 2 of [num_blocks, N, block_size, D]), but got ",
                      a.block_size);
    OPENNPU_CHECK_ARG(a.has_seq_kv, op, "actual_seq_lengths_kv",
                      "is required with block_table (the cached length of each sequence)");
    table = table.contiguous();
    table_cols = table.size(1);
    kv_cap = table_cols * a.block_size;
  }
  if (tnd) {
    OPENNPU_CHECK_ARG(a.has_seq, op, "actual_seq_lengths",
                      "is required for input_layout TND/NTD (cumulative query ends), but got None");
    cumulative(op, "actual_seq_lengths", a.actual_seq_lengths, seq_q, p.q_start, p.q_len);
    batch = static_cast<int64_t>(p.q_len.size());
    if (paged) {
      // vllm-ascend's convention: per-sequence cached lengths, not cumulative ends.
      p.kv_len = per_batch(op, "actual_seq_lengths_kv", a.actual_seq_lengths_kv, true, batch, kv_cap);
      p.kv_start.assign(batch, 0);
    } else {
      OPENNPU_CHECK_ARG(a.has_seq_kv, op, "actual_seq_lengths_kv",
                        "is required for input_layout TND/NTD (cumulative key ends), but got None");
      OPENNPU_CHECK_ARG(a.actual_seq_lengths_kv.size() == p.q_len.size(), op,
                        "actual_seq_lengths_kv", "must have as many entries as actual_seq_lengths (",
                        p.q_len.size(), "), but got ", a.actual_seq_lengths_kv.size());
      cumulative(op, "actual_seq_lengths_kv", a.actual_seq_lengths_kv, kc.size(0), p.kv_start,
                 p.kv_len);
    }
  } else {
    batch = q.size(0);
    if (!paged) {
      OPENNPU_CHECK_ARG(kc.size(0) == batch, op, "key", "must have the batch size of 'query' (",
                        batch, "), but got shape ", shape_str(a.key.sizes()));
      kv_cap = kc.size(2);
    }
    p.q_start.assign(batch, 0);
    p.kv_start.assign(batch, 0);
    // Q_S = 1: actual_seq_lengths has no effect (torch_npu's decode branch ignores it).
    p.q_len = seq_q == 1 ? std::vector<int64_t>(batch, 1)
                         : per_batch(op, "actual_seq_lengths", a.actual_seq_lengths, a.has_seq,
                                     batch, seq_q);
    p.kv_len = per_batch(op, "actual_seq_lengths_kv", a.actual_seq_lengths_kv, a.has_seq_kv,
                         batch, kv_cap);
  }
  p.batch = batch;
  p.stats_rows_per_head = seq_q;
  p.bit_start.assign(batch, 0);
  if (paged) {
    OPENNPU_CHECK_ARG(table.size(0) >= batch, op, "block_table", "must have a row per batch (",
                      batch, "), but got shape ", shape_str(table.sizes()));
  }
  // Block ids are checked here where the table is host memory; the CUDA decode kernel checks
  // each id it reads (a device-side assertion, as ATen's CUDA indexing).
  if (paged && !table.is_cuda()) {
    const int32_t* t = table.const_data_ptr<int32_t>();
    const int64_t blocks = kc.size(0);
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t need = (p.kv_len[b] + a.block_size - 1) / a.block_size;
      for (int64_t j = 0; j < need; ++j) {
        const int64_t id = t[b * table_cols + j];
        OPENNPU_CHECK_ARG(id >= 0 && id < blocks, op, "block_table", "holds block id ", id,
                          " at [", b, ", ", j, "], outside the cache's ", blocks, " blocks");
      }
    }
  }
  int64_t max_q = 0, max_kv = 0, sum_q = 0;
  for (int64_t b = 0; b < batch; ++b) {
    max_q = std::max(max_q, p.q_len[b]);
    max_kv = std::max(max_kv, p.kv_len[b]);
    sum_q += p.q_len[b];
  }
  const bool decode = max_q <= 1 && (tnd || seq_q == 1);
  const bool rope = a.query_rope.has_value();
  QuantTable kq, vq;
  if (int8) {
    const int64_t blocks = paged ? kc.size(0) : 0;
    kq = quant_table(op, a.kq, query, KVN, D, batch, max_kv, paged, tnd, blocks, a.block_size);
    vq = quant_table(op, a.vq, query, KVN, Dv, batch, max_kv, paged, tnd, blocks, a.block_size);
  }
  // torch_npu: with one query row and no rope, sparse_mode, pre_tokens and next_tokens are ignored.
  const bool ignore_sparse = decode && !rope;

  // Rope parts (MLA): scores = q . k + q_rope . k_rope.
  at::Tensor qr, kr;
  int64_t Dr = 0;
  if (rope) {
    const at::Tensor& qrt = *a.query_rope;
    const at::Tensor& krt = *a.key_rope;
    for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"query_rope", &qrt},
                                  {"key_rope", &krt}}) {
      OPENNPU_CHECK_ARG(t->scalar_type() == query.scalar_type(), op, name,
                        "must have the dtype of 'query' (", query.scalar_type(), "), but got ",
                        t->scalar_type());
      check_same_device(op, name, *t, "query", query);
    }
    OPENNPU_CHECK_ARG(qrt.dim() == query.dim(), op, "query_rope", "must have query's rank (",
                      query.dim(), "), but got shape ", shape_str(qrt.sizes()));
    if (in == L::BSH) {
      OPENNPU_CHECK_ARG(qrt.size(2) % N == 0, op, "query_rope",
                        "must have a hidden size divisible by num_heads, but got shape ",
                        shape_str(qrt.sizes()));
    }
    qr = canonical(qrt, in, N);
    Dr = qr.size(-1);
    for (int64_t i = 0; i + 1 < q.dim(); ++i) {
      OPENNPU_CHECK_ARG(qr.size(i) == q.size(i), op, "query_rope",
                        "must match 'query' in every dim but the head size (query ",
                        shape_str(query.sizes()), "), but got shape ", shape_str(qrt.sizes()));
    }
    OPENNPU_CHECK_ARG(krt.dim() == a.key.dim(), op, "key_rope", "must have key's rank (",
                      a.key.dim(), "), but got shape ", shape_str(krt.sizes()));
    if ((paged && krt.dim() == 3) || (!paged && in == L::BSH)) {
      OPENNPU_CHECK_ARG(krt.size(-1) % KVN == 0, op, "key_rope",
                        "must have a hidden size divisible by the key/value head count, but got "
                        "shape ", shape_str(krt.sizes()));
    }
    kr = kv_view(krt, "key_rope");
    bool ok = kr.size(-1) == Dr;
    for (int64_t i = 0; i + 1 < kc.dim(); ++i) ok = ok && kr.size(i) == kc.size(i);
    OPENNPU_CHECK_ARG(ok, op, "key_rope", "must match 'key' but for a head size of ", Dr,
                      " (query_rope's), but got shape ", shape_str(krt.sizes()));
  }

  // Masks.
  at::Tensor mask;
  if (a.atten_mask.has_value()) {
    const at::Tensor& m = *a.atten_mask;
    check_same_device(op, "atten_mask", m, "query", query);
    OPENNPU_CHECK_ARG(m.scalar_type() == at::kBool || m.scalar_type() == at::kByte ||
                          m.scalar_type() == at::kChar,
                      op, "atten_mask", "must be bool, int8 or uint8 (nonzero = masked out), but got ",
                      m.scalar_type());
  }
  const bool reads_mask = a.atten_mask.has_value() && (a.sparse_mode == 0 || a.sparse_mode == 1);
  if (!ignore_sparse) {
    p.sparse_mode = a.sparse_mode;
    p.pre_tokens = a.pre_tokens;
    p.next_tokens = a.next_tokens;
    // Modes 2-4 describe the mask (the tensor is the compressed 2048 x 2048 placeholder).
    p.apply_band = a.atten_mask.has_value() || a.sparse_mode >= 2;
    if (a.sparse_mode == 0 && !a.atten_mask.has_value()) p.apply_band = false;
  }
  if (reads_mask) {
    const at::Tensor& m = *a.atten_mask;
    mask = (m.scalar_type() == at::kByte ? m : m.view(at::kByte));
    if (mask.dim() > 0 && mask.stride(-1) != 1) mask = mask.contiguous();
    int64_t rows = 0, cols = 0;
    bool ok = true;
    if (mask.dim() == 2 && decode && !tnd) {  // (B, KV_S)
      ok = mask.size(0) == batch || mask.size(0) == 1;
      p.mask_stride_b = mask.size(0) == 1 ? 0 : mask.stride(0);
      rows = 1;
    } else if (mask.dim() == 2) {  // (Q_S, KV_S)
      p.mask_stride_i = mask.stride(0);
      rows = mask.size(0);
    } else if (mask.dim() == 3) {  // (B | 1, Q_S, KV_S)
      ok = !tnd && (mask.size(0) == batch || mask.size(0) == 1);
      p.mask_stride_b = mask.size(0) == 1 ? 0 : mask.stride(0);
      p.mask_stride_i = mask.stride(1);
      rows = mask.size(1);
    } else if (mask.dim() == 4) {  // (B | 1, 1 | N, Q_S, KV_S)
      ok = !tnd && (mask.size(0) == batch || mask.size(0) == 1) &&
           (mask.size(1) == 1 || mask.size(1) == N);
      p.mask_stride_b = mask.size(0) == 1 ? 0 : mask.stride(0);
      p.mask_stride_n = mask.size(1) == 1 ? 0 : mask.stride(1);
      p.mask_stride_i = mask.stride(2);
      rows = mask.size(2);
    } else {
      ok = false;
    }
    if (mask.dim() > 0) cols = mask.size(-1);
    ok = ok && rows >= max_q && cols >= max_kv;
    OPENNPU_CHECK_ARG(ok, op, "atten_mask",
                      "must be (Q_S, KV_S), (B | 1, Q_S, KV_S) or (B | 1, 1 | N, Q_S, KV_S) "
                      "(decode also (B, KV_S)) covering ", max_q, " query rows and ", max_kv,
                      " keys for batch ", batch, ", but got shape ", shape_str(m.sizes()));
    if (rows == 1) p.mask_stride_i = 0;
    p.user_mask = mask.const_data_ptr<uint8_t>();
  }
  at::Tensor sink;
  if (a.sink.has_value()) {
    check_same_device(op, "learnable_sink", *a.sink, "query", query);
    OPENNPU_CHECK_ARG(a.sink->dim() == 1 && a.sink->size(0) == N && a.sink->is_floating_point(),
                      op, "learnable_sink", "must be a floating [num_query_heads] = [", N,
                      "] tensor, but got ", a.sink->scalar_type(), " ", shape_str(a.sink->sizes()));
    sink = a.sink->to(at::kFloat).contiguous();
    p.sink = sink.const_data_ptr<float>();
  }

  // Outputs.
  const auto opts = query.options();
  at::Tensor out = at::empty(sh.out, a.float_out ? opts.dtype(at::kFloat) : opts);
  const bool rows_left = tnd ? sum_q < seq_q : max_q < seq_q || [&] {
    for (int64_t b = 0; b < batch; ++b) if (p.q_len[b] < seq_q) return true;
    return false;
  }();
  if (rows_left || out.numel() == 0) out.zero_();
  at::Tensor lse = a.softmax_lse_flag ? at::empty(sh.lse, opts.dtype(at::kFloat))
                                      : at::zeros({1}, opts.dtype(at::kFloat));
  if (out.numel() == 0 || batch == 0) {
    if (a.softmax_lse_flag) lse.fill_(kNegInf);
    return {out, lse};
  }

  const bool fast_dtype = query.scalar_type() != at::kDouble;
  if (decode && !a.pse_shift.has_value() && fast_dtype && a.p_quant == 0.0f &&
      !(int8 && rope) && decode_kernel_enabled()) {
    const auto last_contig = [](const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); };
    const at::Tensor qv = last_contig(q), kv = last_contig(kc), vv = last_contig(vc);
    const at::Tensor qrv = rope ? last_contig(qr) : at::Tensor(), krv = rope ? last_contig(kr) : at::Tensor();
    DecodeProblem d;
    d.p = &p;
    p.head_dim = D;
    p.head_dim_v = Dv;
    p.q = view_of(qv);
    const at::Tensor oc = canonical(out, sh.l.out, N);
    p.out = view_of(oc);
    d.q = qv.const_data_ptr();
    const auto rows_of = [&](const at::Tensor& t) {
      KvRows r;
      r.base = t.const_data_ptr();
      if (paged) {
        r.stride_blk = t.stride(0);
        r.stride_s = t.stride(1);
        r.stride_n = t.stride(2);
      } else {
        const SeqView sv = view_of(t);
        r.stride_blk = sv.stride_b;
        r.stride_s = sv.stride_s;
        r.stride_n = sv.stride_n;
      }
      return r;
    };
    d.cache.k = rows_of(kv);
    d.cache.v = rows_of(vv);
    d.cache.int8 = int8;
    d.out_float = a.float_out;
    d.cache.kq = kq.view();
    d.cache.vq = vq.view();
    if (rope) {
      d.cache.k_rope = rows_of(krv);
      d.q_rope = qrv.const_data_ptr();
      d.q_rope_view = view_of(qrv);
      d.rope_dim = Dr;
    }
    if (paged) {
      d.cache.block_table = table.const_data_ptr<int32_t>();
      d.cache.table_stride = table_cols;
      d.cache.block_size = a.block_size;
      d.cache.num_blocks = kc.size(0);
    }
    d.visible.resize(batch);
    for (int64_t b = 0; b < batch; ++b) {
      d.visible[b] = p.kv_len[b] == 0 || p.q_len[b] == 0 ? KeyInterval{0, -1} : visible_keys(p, b, 0);
    }
    if (a.softmax_lse_flag) {
      lse.fill_(kNegInf);
      d.lse = lse.data_ptr<float>();
    }
    // out's canonical view: writes go through p.out into `out`.
    infer_decode.get(op, query)(d, query.scalar_type(), oc.data_ptr());
    return {out, lse};
  }

  // Prefill (and decode with pse_shift / float64): the training forward kernel. An int8 cache is
  // dequantised to fp32 (the rows read only) and the attention runs in fp32.
  const at::ScalarType acc = acc_dtype(query);
  const AttentionPlan plan = attention_plan.get(op, query)(
      op, int8 || a.float_out ? at::kFloat : query.scalar_type(), D + Dr, Dv,
      /*check_forced_tiles=*/false);
  const at::ScalarType compute = plan.compute;
  p.tiles = plan.tiles;
  p.pv = plan.pv;
  const auto conv = [&](const at::Tensor& t) { return t.to(compute); };
  // int8 rows [B, KVN, S, D] (TND [T, KVN, D]) -> (x + offset) * scale in fp32; `idx` the
  // gathered blocks of a paged cache ([B, cols]).
  const auto dequant = [&](const at::Tensor& x, const QuantTable& qt, const at::Tensor& idx) {
    const at::Tensor xf = x.to(at::kFloat);
    const auto bcast = [&](const at::Tensor& t) {
      if (qt.kind == KvQuant::Kind::kChannel) {
        return x.dim() == 3 ? t.unsqueeze(0) : t.unsqueeze(0).unsqueeze(2);
      }
      at::Tensor r = t;  // [B | blocks, 1 | KVN, S | bs]
      if (qt.paged) {
        r = t.index_select(0, idx.flatten())
                .view({batch, idx.size(1), t.size(1), t.size(2)})
                .permute({0, 2, 1, 3})
                .reshape({batch, t.size(1), idx.size(1) * t.size(2)});
      }
      return r.narrow(2, 0, x.size(2)).unsqueeze(-1);
    };
    const at::Tensor sc = bcast(qt.scale);
    return qt.offset.defined() ? xf.add(bcast(qt.offset)).mul_(sc) : xf.mul(sc);
  };
  at::Tensor qx = conv(q), kx, vx;
  // Paged: gather the blocks each sequence uses into [B, KVN, S, D]: O(S * D) next to
  // O(Sq * S * D).
  at::Tensor idx;
  if (paged) {
    const int64_t cols = (max_kv + a.block_size - 1) / a.block_size;
    idx = at::zeros({batch, std::max<int64_t>(cols, 1)}, table.options().dtype(at::kLong));
    const int32_t* t = table.const_data_ptr<int32_t>();
    int64_t* ix = idx.data_ptr<int64_t>();
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t need = (p.kv_len[b] + a.block_size - 1) / a.block_size;
      for (int64_t j = 0; j < need; ++j) ix[b * idx.size(1) + j] = t[b * table_cols + j];
    }
  }
  const auto rows = [&](const at::Tensor& c) {
    if (!paged) return c;
    return c.index_select(0, idx.flatten())
        .reshape({batch, idx.size(1) * a.block_size, KVN, c.size(-1)})
        .permute({0, 2, 1, 3});
  };
  if (int8) {
    at::Tensor k8 = rows(kc), v8 = rows(vc);
    if (!tnd || paged) {  // only the rows read: keys [0, max_kv)
      k8 = k8.narrow(2, 0, max_kv);
      v8 = v8.narrow(2, 0, max_kv);
    }
    kx = conv(dequant(k8, kq, idx));
    vx = conv(dequant(v8, vq, idx));
  } else {
    kx = conv(rows(kc));
    vx = conv(rows(vc));
  }
  if (rope) {  // int8 MLA: the rows of the int8 cache's narrowing
    kr = rows(kr);
    if (int8 && (!tnd || paged)) kr = kr.narrow(2, 0, max_kv);
    kr = conv(kr);
  }
  if (rope) {
    qx = at::cat({qx, conv(qr)}, -1);
    kx = at::cat({kx, kr}, -1);
  }
  const auto contig_last = [](const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); };
  qx = contig_last(qx);
  kx = contig_last(kx);
  vx = contig_last(vx);
  p.head_dim = D + Dr;
  p.head_dim_v = Dv;
  p.q = view_of(qx);
  p.k = view_of(kx);
  p.v = view_of(vx);
  at::Tensor pse;
  if (a.pse_shift.has_value()) {
    const at::Tensor& ps = *a.pse_shift;
    check_same_device(op, "pse_shift", ps, "query", query);
    OPENNPU_CHECK_ARG(ps.is_floating_point() && ps.dim() == 4 &&
                          (ps.size(0) == 1 || ps.size(0) == batch) && ps.size(1) == N &&
                          ps.size(2) >= max_q && ps.size(3) >= max_kv && !tnd,
                      op, "pse_shift", "must be a floating (B | 1, Q_N, Q_S, KV_S) = (", batch, ", ",
                      N, ", ", max_q, ", ", max_kv, ") tensor (not with TND), but got ",
                      ps.scalar_type(), " ", shape_str(ps.sizes()));
    OPENNPU_CHECK_ARG(a.scale != 0.0, op, "scale", "must be nonzero with pse_shift");
    // The kernel computes scale * (q k + pse): pse_shift / scale gives scale * q k + pse_shift.
    pse = ps.to(acc).div(a.scale).contiguous();
    p.pse = pse.const_data_ptr();
    p.pse_stride_b = ps.size(0) == 1 ? 0 : pse.stride(0);
    p.pse_stride_n = pse.stride(1);
    p.pse_stride_i = ps.size(2) == 1 ? 0 : pse.stride(2);
  }
  at::Tensor out_c = compute == out.scalar_type() ? out : at::zeros(sh.out, opts.dtype(compute));
  const at::Tensor oc = canonical(out_c, sh.l.out, N);
  p.out = view_of(oc);
  const std::vector<int64_t> stats_shape =
      tnd ? std::vector<int64_t>{seq_q, N, 8} : std::vector<int64_t>{batch, N, seq_q, 8};
  const at::ScalarType st = acc == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor smax = at::full(stats_shape, kNegInf, opts.dtype(st));
  at::Tensor ssum = at::zeros(stats_shape, opts.dtype(st));
  if (sum_q > 0) attention_fwd.get(op, qx)(p, qx, kx, vx, out_c, smax, ssum);
  if (!out_c.is_same(out)) out.copy_(out_c);
  if (a.softmax_lse_flag) {
    lse.copy_(smax.select(-1, 0).add(ssum.select(-1, 0).log()).unsqueeze(-1));
  }
  return {out, lse};
}

// Output quantisation (v1's quant_scale2 / quant_offset2, v2's quant_scale_out / quant_offset_out):
// attention_out = cast(o * scale + offset) with o the float32 attention output (never rounded to
// query's dtype), the product and the sum each rounded to float32, and the cast, as Ascend's
// post-quant kernels do it: int8 through float16 (float32 -> float16 -> int8, both round half to
// even; opennpu saturates to [-128, 127] and maps NaN to 0), float8 directly (round half to
// even, torch's conversion: no saturation), hifloat8 (v2's out_dtype 290; uint8 codes) directly
// through the quant family's encoder (half away from zero, as en_dtypes casts; |v| >= 40960 ->
// inf, no saturation). Per tensor (one factor) or per channel (Q_N * D
// factors in any shape, e.g. (Q_N, D), (1, Q_N, 1, D), (1, 1, Q_N, D), (H,), (1, 1, H)).
struct OutQuant {
  at::ScalarType dtype = at::kChar;  // int8, float8_e5m2, float8_e4m3fn or Byte (hifloat8)
  at::Tensor scale, offset;          // float32 [1] or [Q_N, D]; offset undefined: 0
  bool per_channel = false;
};

std::optional<OutQuant> out_quant(const char* op, const char* scale_name, const char* offset_name,
                                  const std::optional<at::Tensor>& scale,
                                  const std::optional<at::Tensor>& offset, const Args& a,
                                  at::ScalarType dtype) {
  OPENNPU_CHECK_ARG(scale.has_value() || !offset.has_value(), op, offset_name, "needs '",
                    scale_name, "' (an output quantisation offset without a scale)");
  if (!scale.has_value()) return std::nullopt;
  const at::Tensor& query = a.query;
  const at::ScalarType qt = query.scalar_type();
  OPENNPU_CHECK_ARG(qt == at::kHalf || qt == at::kBFloat16 || qt == at::kFloat, op, "query",
                    "must be float16, bfloat16 or float32 with output quantisation ('", scale_name,
                    "'), but got ", qt);
  const at::Tensor& sc = *scale;
  check_same_device(op, scale_name, sc, "query", query);
  OPENNPU_CHECK_ARG(sc.scalar_type() == at::kFloat ||
                        (sc.scalar_type() == at::kBFloat16 && qt == at::kBFloat16),
                    op, scale_name, "must be float32 (or bfloat16 with a bfloat16 query), but got ",
                    sc.scalar_type(), " with a ", qt, " query");
  if (offset.has_value()) {
    check_same_device(op, offset_name, *offset, "query", query);
    OPENNPU_CHECK_ARG(offset->scalar_type() == sc.scalar_type() && offset->sizes() == sc.sizes(),
                      op, offset_name, "must have the dtype and shape of '", scale_name, "' (",
                      sc.scalar_type(), " ", shape_str(sc.sizes()), "), but got ",
                      offset->scalar_type(), " ", shape_str(offset->sizes()));
  }
  const Shapes sh = output_shapes(op, query, a.value, a.input_layout, a.block_table.has_value(),
                                  a.num_heads, a.num_key_value_heads, a.softmax_lse_flag);
  const int64_t channels = sh.heads * sh.dim_v;
  OPENNPU_CHECK_ARG(sc.numel() == 1 || sc.numel() == channels, op, scale_name,
                    "must hold one factor (per tensor) or Q_N * D = ", sh.heads, " * ", sh.dim_v,
                    " = ", channels, " factors (per channel: (Q_N, D), (1, Q_N, 1, D), "
                    "(1, 1, Q_N, D), (H,), (1, 1, H)), but got shape ", shape_str(sc.sizes()));
  OutQuant q;
  q.dtype = dtype;
  q.per_channel = sc.numel() != 1;
  const auto norm = [&](const at::Tensor& t) {
    at::Tensor r = t.to(at::kFloat).contiguous();
    return q.per_channel ? r.view({sh.heads, sh.dim_v}) : r.view({1});
  };
  q.scale = norm(sc);
  if (offset.has_value()) q.offset = norm(*offset);
  return q;
}

// `out` (float32, in the output layout `l` with `heads` heads) quantised in place and cast.
at::Tensor quantise_out(const OutQuant& q, at::Tensor out, L l, int64_t heads) {
  TORCH_INTERNAL_ASSERT(out.scalar_type() == at::kFloat);
  at::Tensor c = canonical(out, l, heads);  // [B, N, S, D] or [T, N, D]: a view of out
  const auto fit = [&](const at::Tensor& t) {
    return q.per_channel && c.dim() == 4 ? t.unsqueeze(1) : t;  // [N, 1, D] against [B, N, S, D]
  };
  c.mul_(fit(q.scale));
  if (q.offset.defined()) c.add_(fit(q.offset));
  if (q.dtype == at::kByte) return quant::to_hifloat8(out);
  if (q.dtype != at::kChar) return out.to(q.dtype);
  // float32 -> float16 (round half to even; overflow gives +-inf) -> int8 (half to even).
  at::Tensor h = out.to(at::kHalf).to(at::kFloat);
  h.nan_to_num_(0.0, 127.0, -128.0).round_().clamp_(-128.0, 127.0);
  return h.to(at::kChar);
}

// a with other query / key / value tensors, mask and kv lengths (every other field the same).
Args with_inputs(const Args& a, const at::Tensor& query, const at::Tensor& key,
                 const at::Tensor& value, const std::optional<at::Tensor>& atten_mask,
                 std::vector<int64_t> lens_kv) {
  Args b{query, key, value, a.pse_shift, atten_mask, a.actual_seq_lengths, std::move(lens_kv),
         a.has_seq, a.has_seq_kv, a.block_table, a.query_rope, a.key_rope, a.sink, a.num_heads,
         a.scale, a.pre_tokens, a.next_tokens, a.input_layout, a.num_key_value_heads,
         a.sparse_mode, a.inner_precise, a.block_size, a.softmax_lse_flag};
  b.kq = a.kq;
  b.vq = a.vq;
  b.float_out = a.float_out;
  b.p_quant = a.p_quant;
  b.dequant2 = a.dequant2;
  b.int8_mla = a.int8_mla;
  return b;
}

// run() with the output quantised: the attention writes its float32 output (decode straight
// from the cache in its own dtype; prefill computes in float32), which is then quantised.
// An int4 key/value cache (int32 words of eight codes, with antiquant factors) is unpacked to
// int8 codes first, one copy of the cache per call, and then takes the int8 antiquant path:
// the codes' values are the same, so is the arithmetic.
std::tuple<at::Tensor, at::Tensor> run_quantised(const char* op, const Args& a,
                                                 const std::optional<OutQuant>& q) {
  if (a.key.scalar_type() == at::kInt && a.value.scalar_type() == at::kInt && a.kq.scale.has_value()) {
    const at::Tensor key = quant::int4_words_to_codes(op, a.key);
    const at::Tensor value = quant::int4_words_to_codes(op, a.value);
    return run_quantised(op, with_inputs(a, a.query, key, value, a.atten_mask, a.actual_seq_lengths_kv), q);
  }
  if (!q.has_value() && a.p_quant == 0.0f) return run(op, a);
  Args b = a;
  b.float_out = true;
  auto [out, lse] = run(op, b);
  if (a.p_quant != 0.0f) {
    out.mul_(a.dequant2);  // full quantisation: float16 unless quantised again below
    if (!q.has_value()) return {out.to(at::kHalf), lse};
  }
  const Layouts l = parse_layout(op, a.input_layout);
  return {quantise_out(*q, out, l.out, a.num_heads), lse};
}

// torch_npu's pairing rules of the separate key/value antiquant factors: scales both or neither,
// offsets both or neither (and only with scales), key mode == value mode except key 0 / value 1.
void check_antiquant(const char* op, Args& a) {
  const Antiquant& k = a.kq;
  const Antiquant& v = a.vq;
  if (k.index < 0) {
    OPENNPU_CHECK_ARG(k.scale.has_value() == v.scale.has_value(), op,
                      k.scale.has_value() ? v.scale_name : k.scale_name,
                      "must be given together with '",
                      k.scale.has_value() ? k.scale_name : v.scale_name, "'");
    OPENNPU_CHECK_ARG(k.offset.has_value() == v.offset.has_value(), op,
                      k.offset.has_value() ? v.offset_name : k.offset_name,
                      "must be given together with '",
                      k.offset.has_value() ? k.offset_name : v.offset_name, "'");
  }
  OPENNPU_CHECK_ARG(k.scale.has_value() || !k.offset.has_value(), op, k.offset_name,
                    "needs '", k.scale_name, "' (an offset without a scale)");
  if (!k.scale.has_value()) return;
  OPENNPU_CHECK_ARG(k.mode == v.mode || (k.mode == 0 && v.mode == 1), op, v.mode_name,
                    "must equal ", k.mode_name, " (", k.mode, "), or be 1 with ", k.mode_name,
                    " 0, but got ", v.mode);
}

// softmax_lse of an .out call: float32 when returned; without the flag the output is a zeros(1)
// placeholder, and any floating tensor takes it (torch_npu's aclgraph tests pass a float16 one).
void copy_lse(at::Tensor& dst, const at::Tensor& lse, const char* op, bool flag) {
  if (flag || !dst.is_floating_point()) {
    copy_out(dst, lse, op, "softmax_lse");
    return;
  }
  if (!dst.sizes().equals(lse.sizes())) dst.resize_(lse.sizes());
  dst.copy_(lse);
}

// v1's full int8 quantisation: query, key and value int8 with dequant_scale1, quant_scale1 and
// dequant_scale2 (one factor each). Scores are (q . k) * dequant_scale1 * scale; softmax's exps
// become int8 codes of e * quant_scale1 before P V (AttentionProblem::p_quant); the output is
// (P codes . v) * dequant_scale2 / the row's sum of exps, float16 (or int8 through quant_scale2 /
// quant_offset2). The int8 codes are exact in float32 and so are their dot products (|sum| <
// 2^24 up to D = 1024), so the codes' products are computed as float32 attention. The dequant
// factors are float32, or int64 in npu_trans_quant_param's encoding (the float32's bits in the
// low 32 bits, quant::decode_int64_scale). As on Ascend: layouts BSH, BNSD, BSND and BNSD_BSND,
// and no antiquant factors; query_rope with an int8 query is v2's int8 MLA (query_dequant), not
// taken here.
struct FullQuant {
  bool on = false;
  double dequant1 = 1.0, dequant2 = 1.0;
  float quant1 = 0.0f;
};

double dequant_factor(const char* name, const at::Tensor& t, const at::Tensor& query) {
  check_same_device(kOp, name, t, "query", query);
  const at::ScalarType st = t.scalar_type();
  OPENNPU_CHECK_ARG(t.numel() == 1 && (st == at::kFloat || st == at::kLong || st == at::kUInt64),
                    kOp, name, "must hold one factor (per tensor), float32 or int64 / uint64 "
                    "(npu_trans_quant_param's encoding), but got a ", st, " tensor of shape ",
                    shape_str(t.sizes()));
  if (st == at::kFloat) return t.item<float>();
  return quant::decode_int64_scale(t.to(at::kCPU).view(at::kLong)).first.item<float>();
}

FullQuant full_quant(const Args& a, const std::optional<at::Tensor>& dequant_scale1,
                     const std::optional<at::Tensor>& quant_scale1,
                     const std::optional<at::Tensor>& dequant_scale2, bool antiquant) {
  FullQuant f;
  const bool int8_query = a.query.scalar_type() == at::kChar;
  const bool any = dequant_scale1.has_value() || quant_scale1.has_value() || dequant_scale2.has_value();
  if (!int8_query && !any) return f;
  const char* given = dequant_scale1.has_value() ? "dequant_scale1"
                      : quant_scale1.has_value() ? "quant_scale1" : "dequant_scale2";
  OPENNPU_CHECK_ARG(int8_query, kOp, given, "needs an int8 query, key and value (full "
                    "quantisation), but got a ", a.query.scalar_type(), " query");
  for (const auto& [name, t] : {std::pair<const char*, const std::optional<at::Tensor>*>{
                                    "dequant_scale1", &dequant_scale1},
                                {"quant_scale1", &quant_scale1}, {"dequant_scale2", &dequant_scale2}}) {
    OPENNPU_CHECK_ARG(t->has_value(), kOp, name, "is needed with an int8 query (full "
                      "quantisation: dequant_scale1, quant_scale1 and dequant_scale2)");
  }
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"key", &a.key},
                                {"value", &a.value}}) {
    OPENNPU_CHECK_ARG(t->scalar_type() == at::kChar, kOp, name, "must be int8 with an int8 query "
                      "(full quantisation), but got ", t->scalar_type());
  }
  OPENNPU_CHECK_ARG(!antiquant, kOp, "antiquant_scale", "does not apply with an int8 query (full "
                    "quantisation: key and value are dequantised by dequant_scale1 / "
                    "dequant_scale2)");
  OPENNPU_CHECK_ARG(!a.query_rope.has_value(), kOp, "query_rope",
                    "is not supported with an int8 query (int8 MLA) by opennpu");
  const std::string layout(a.input_layout);
  OPENNPU_CHECK_ARG(layout == "BSH" || layout == "BNSD" || layout == "BSND" || layout == "BNSD_BSND",
                    kOp, "input_layout", "must be BSH, BNSD, BSND or BNSD_BSND with an int8 query "
                    "(full quantisation, as on Ascend), but got '", layout, "'");
  const at::Tensor& q1 = *quant_scale1;
  check_same_device(kOp, "quant_scale1", q1, "query", a.query);
  OPENNPU_CHECK_ARG(q1.numel() == 1 && q1.scalar_type() == at::kFloat, kOp, "quant_scale1",
                    "must hold one float32 factor (per tensor), but got a ", q1.scalar_type(),
                    " tensor of shape ", shape_str(q1.sizes()));
  f.quant1 = q1.item<float>();
  OPENNPU_CHECK_ARG(f.quant1 > 0.0f && std::isfinite(f.quant1), kOp, "quant_scale1",
                    "must be a positive finite factor, but got ", f.quant1);
  f.dequant1 = dequant_factor("dequant_scale1", *dequant_scale1, a.query);
  f.dequant2 = dequant_factor("dequant_scale2", *dequant_scale2, a.query);
  f.on = true;
  return f;
}

// The shared prefix (key_shared_prefix / value_shared_prefix, batch 1, e.g. a system prompt's
// K/V): every batch b attends to [prefix[:P], key[b]], P = actual_shared_prefix_len (default the
// prefix's whole S). Built by concatenating along the sequence axis (one copy of K/V per call),
// so atten_mask, pse_shift, the sparse modes and actual_seq_lengths_kv (each + P) all see the
// concatenated sequence, as the docs' rule S2 >= P + key's S says. Not with a paged cache, the
// MLA rope inputs or per-token antiquant factors (torch_npu excludes the paged cache too).
// The shared prefix and left padding move or join K/V rows; per-token antiquant factors would
// have to move with them, so only per-channel ones (mode 0) are taken there.
void require_per_channel_antiquant(const char* arg, bool antiquant,
                                   const std::vector<int64_t>& modes) {
  if (!antiquant) return;
  for (int64_t mode : modes) {
    OPENNPU_CHECK_ARG(mode == 0, kOp, arg,
                      "takes only per-channel antiquant factors (mode 0), but got mode ", mode);
  }
}

struct SharedPrefix {
  at::Tensor key, value;  // undefined: no prefix
  std::vector<int64_t> lens_kv;
};

SharedPrefix with_shared_prefix(const at::Tensor& key, const at::Tensor& value,
                                const std::optional<at::Tensor>& key_prefix,
                                const std::optional<at::Tensor>& value_prefix,
                                at::OptionalSymIntArrayRef prefix_len,
                                at::OptionalSymIntArrayRef actual_seq_lengths_kv,
                                c10::string_view input_layout,
                                const std::optional<at::Tensor>& block_table,
                                const std::optional<at::Tensor>& key_rope,
                                const std::vector<int64_t>& antiquant_modes, bool antiquant) {
  SharedPrefix r;
  if (!key_prefix.has_value() && !value_prefix.has_value()) {
    OPENNPU_CHECK_ARG(!prefix_len.has_value(), kOp, "actual_shared_prefix_len",
                      "needs key_shared_prefix and value_shared_prefix");
    return r;
  }
  OPENNPU_CHECK_ARG(key_prefix.has_value() && value_prefix.has_value(), kOp,
                    key_prefix.has_value() ? "value_shared_prefix" : "key_shared_prefix",
                    "must be given together with ",
                    key_prefix.has_value() ? "key_shared_prefix" : "value_shared_prefix");
  OPENNPU_CHECK_ARG(!block_table.has_value(), kOp, "key_shared_prefix",
                    "is not supported with a paged cache (block_table), as on Ascend");
  OPENNPU_CHECK_ARG(!key_rope.has_value(), kOp, "key_shared_prefix",
                    "is not supported with query_rope / key_rope by opennpu");
  require_per_channel_antiquant("key_shared_prefix", antiquant, antiquant_modes);
  const L in = parse_layout(kOp, input_layout).in;
  OPENNPU_CHECK_ARG(in == L::BSH || in == L::BSND || in == L::BNSD, kOp, "key_shared_prefix",
                    "needs input_layout BSH, BSND or BNSD (or their _BNSD / _BSND / _NBSD "
                    "forms), but got '", std::string(input_layout), "'");
  const int64_t seq = in == L::BNSD ? 2 : 1;
  for (const auto& [name, prefix, cache] :
       {std::tuple<const char*, const at::Tensor&, const at::Tensor&>{"key_shared_prefix", *key_prefix, key},
        {"value_shared_prefix", *value_prefix, value}}) {
    OPENNPU_CHECK_ARG(prefix.dim() == cache.dim() && prefix.size(0) == 1, kOp, name,
                      "must have ", cache.dim(), " dims with batch 1 (the key's layout), but got "
                      "shape ", prefix.sizes());
    OPENNPU_CHECK_ARG(prefix.scalar_type() == cache.scalar_type(), kOp, name,
                      "must have the key's / value's dtype ", cache.scalar_type(), ", but got ",
                      prefix.scalar_type());
    for (int64_t d = 1; d < cache.dim(); ++d) {
      OPENNPU_CHECK_ARG(d == seq || prefix.size(d) == cache.size(d), kOp, name,
                        "must match the cache's shape ", cache.sizes(), " except in batch (1) "
                        "and sequence, but got ", prefix.sizes());
    }
  }
  const int64_t prefix_s = key_prefix->size(seq);
  OPENNPU_CHECK_ARG(value_prefix->size(seq) == prefix_s, kOp, "value_shared_prefix",
                    "must have key_shared_prefix's sequence length ", prefix_s, ", but got ",
                    value_prefix->size(seq));
  int64_t p = prefix_s;
  if (prefix_len.has_value()) {
    OPENNPU_CHECK_ARG(prefix_len->size() == 1, kOp, "actual_shared_prefix_len",
                      "must hold one length, but got ", prefix_len->size());
    p = (*prefix_len)[0].guard_int(__FILE__, __LINE__);
    OPENNPU_CHECK_ARG(p >= 0 && p <= prefix_s, kOp, "actual_shared_prefix_len",
                      "must be in [0, ", prefix_s, "] (the prefix's sequence length), but got ", p);
  }
  const int64_t batch = key.size(0);
  auto joined = [&](const at::Tensor& prefix, const at::Tensor& cache) {
    std::vector<int64_t> shape(prefix.sizes().begin(), prefix.sizes().end());
    shape[0] = batch;
    shape[seq] = p;
    return at::cat({prefix.narrow(seq, 0, p).expand(shape), cache}, seq);
  };
  r.key = joined(*key_prefix, key);
  r.value = joined(*value_prefix, value);
  if (actual_seq_lengths_kv.has_value()) {
    for (const c10::SymInt& n : *actual_seq_lengths_kv) r.lens_kv.push_back(p + n.guard_int(__FILE__, __LINE__));
  }
  return r;
}

// Left padding (query_padding_size / kv_padding_size, one count each, with actual_seq_lengths /
// actual_seq_lengths_kv): batch b's rows sit right-aligned before `padding` trailing rows,
// [S - padding - len_b, S - padding), where Ascend's kernel starts copying them. Here each batch
// is rotated along the sequence so that its rows start at 0, the attention runs on those
// left-aligned rows with the same lengths (an explicit atten_mask rotated alike on both axes;
// the sparse modes' own masks already follow the lengths), and the output rows are rotated back
// (rows outside the window: the kernel's rows past a length). A negative count is taken as 0.
// Query padding applies only where Q_S > 1; with Q_S = 1 a kv window that would start before row
// 0 gives that batch an all-zero output (it sees no key), as on Ascend; with Q_S > 1 it is an
// error. Not with a paged cache or a shared prefix (as on Ascend), pse_shift, the MLA rope
// inputs or per-token antiquant factors.
struct LeftPadding {
  std::vector<int64_t> q_start, kv_start;  // per batch; empty: that side is not padded
  std::vector<int64_t> lens_kv;            // actual_seq_lengths_kv after the Q_S = 1 rule
  int64_t in_seq = 1, out_seq = 1;         // the sequence axis of the inputs / the output
};

int64_t padding_count(const char* name, const at::Tensor& t) {
  OPENNPU_CHECK_ARG(t.numel() == 1 && !t.is_floating_point() && !t.is_complex(), kOp, name,
                    "must hold one integer (the padding rows after every batch's rows), but got "
                    "a ", t.scalar_type(), " tensor of shape ", t.sizes());
  return std::max<int64_t>(0, t.item<int64_t>());
}

LeftPadding left_padding(const Args& a, const std::optional<at::Tensor>& query_padding_size,
                         const std::optional<at::Tensor>& kv_padding_size, bool prefix,
                         bool antiquant, const std::vector<int64_t>& antiquant_modes) {
  LeftPadding r;
  if (!query_padding_size.has_value() && !kv_padding_size.has_value()) return r;
  const char* name = query_padding_size.has_value() ? "query_padding_size" : "kv_padding_size";
  const Layouts l = parse_layout(kOp, a.input_layout);
  OPENNPU_CHECK_ARG((l.in == L::BSH || l.in == L::BSND || l.in == L::BNSD) &&
                        (l.out == L::BSH || l.out == L::BSND || l.out == L::BNSD),
                    kOp, name, "needs input_layout BSH, BSND, BNSD, BNSD_BSND, BSH_BNSD or "
                    "BSND_BNSD, but got '", std::string(a.input_layout), "'");
  OPENNPU_CHECK_ARG(!a.block_table.has_value(), kOp, name,
                    "is not supported with a paged cache (block_table), as on Ascend");
  OPENNPU_CHECK_ARG(!prefix, kOp, name, "is not supported with a shared prefix, as on Ascend");
  OPENNPU_CHECK_ARG(!a.pse_shift.has_value(), kOp, name, "is not supported with pse_shift by opennpu");
  OPENNPU_CHECK_ARG(!a.key_rope.has_value(), kOp, name,
                    "is not supported with query_rope / key_rope by opennpu");
  r.in_seq = l.in == L::BNSD ? 2 : 1;
  r.out_seq = l.out == L::BNSD ? 2 : 1;
  const int64_t batch = a.query.size(0), q_s = a.query.size(r.in_seq), kv_s = a.key.size(r.in_seq);
  auto lengths = [&](const char* pad, const char* lens_name, bool has, const std::vector<int64_t>& lens) {
    OPENNPU_CHECK_ARG(has, kOp, pad, "needs ", lens_name, " (the rows of each batch)");
    OPENNPU_CHECK_ARG(lens.size() == 1 || static_cast<int64_t>(lens.size()) == batch, kOp, lens_name,
                      "must hold 1 or ", batch, " lengths, but got ", lens.size());
    std::vector<int64_t> per_batch(batch);
    for (int64_t b = 0; b < batch; ++b) per_batch[b] = lens[lens.size() == 1 ? 0 : b];
    return per_batch;
  };
  if (query_padding_size.has_value() && q_s > 1) {
    const int64_t pad = padding_count("query_padding_size", *query_padding_size);
    for (int64_t len : lengths("query_padding_size", "actual_seq_lengths", a.has_seq, a.actual_seq_lengths)) {
      const int64_t start = q_s - pad - len;
      OPENNPU_CHECK_ARG(start >= 0, kOp, "query_padding_size",
                        "leaves no room for actual_seq_lengths: Q_S (", q_s, ") - padding (", pad,
                        ") - length (", len, ") must be >= 0");
      r.q_start.push_back(start);
    }
  }
  if (kv_padding_size.has_value()) {
    require_per_channel_antiquant("kv_padding_size", antiquant, antiquant_modes);
    const int64_t pad = padding_count("kv_padding_size", *kv_padding_size);
    for (int64_t len : lengths("kv_padding_size", "actual_seq_lengths_kv", a.has_seq_kv, a.actual_seq_lengths_kv)) {
      int64_t start = kv_s - pad - len;
      OPENNPU_CHECK_ARG(start >= 0 || q_s == 1, kOp, "kv_padding_size",
                        "leaves no room for actual_seq_lengths_kv: KV_S (", kv_s, ") - padding (",
                        pad, ") - length (", len, ") must be >= 0");
      if (start < 0) start = len = 0;  // Q_S = 1: the batch sees no key, its output is 0
      r.kv_start.push_back(start);
      r.lens_kv.push_back(len);
    }
  }
  return r;
}

// t with batch b rotated by -shift[b] along `dim` (row shift[b] first), or back with sign +1.
at::Tensor rotate_batches(const at::Tensor& t, const std::vector<int64_t>& shift, int64_t dim,
                          int64_t sign) {
  if (shift.empty() || std::all_of(shift.begin(), shift.end(), [](int64_t v) { return v == 0; })) return t;
  std::vector<at::Tensor> rows;
  for (int64_t b = 0; b < t.size(0); ++b) rows.push_back(at::roll(t.select(0, b), {-sign * shift[b]}, {dim - 1}));
  return at::stack(rows);
}

// An explicit mask ([Q_S, KV_S], [B or 1, Q_S, KV_S] or [B or 1, 1, Q_S, KV_S]) rotated per batch
// on both axes as the query and key rows are.
at::Tensor rotate_mask(const at::Tensor& mask, const LeftPadding& p, int64_t batch) {
  at::Tensor m = mask.dim() == 2 ? mask.unsqueeze(0) : mask;
  std::vector<int64_t> shape(m.sizes().begin(), m.sizes().end());
  shape[0] = batch;
  m = m.expand(shape);
  std::vector<at::Tensor> rows;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t qs = p.q_start.empty() ? 0 : p.q_start[b], ks = p.kv_start.empty() ? 0 : p.kv_start[b];
    rows.push_back(at::roll(m.select(0, b), {-qs, -ks}, {-2, -1}));
  }
  return at::stack(rows);
}

#define FIA_V1_PARAMS                                                                             \
  const at::Tensor &query, const at::Tensor &key, const at::Tensor &value,                        \
      const std::optional<at::Tensor>&pse_shift, const std::optional<at::Tensor>&atten_mask,      \
      at::OptionalSymIntArrayRef actual_seq_lengths,                                              \
      at::OptionalSymIntArrayRef actual_seq_lengths_kv,                                           \
      const std::optional<at::Tensor>&dequant_scale1,                                             \
      const std::optional<at::Tensor>&quant_scale1,                                               \
      const std::optional<at::Tensor>&dequant_scale2,                                             \
      const std::optional<at::Tensor>&quant_scale2,                                               \
      const std::optional<at::Tensor>&quant_offset2,                                              \
      const std::optional<at::Tensor>&antiquant_scale,                                            \
      const std::optional<at::Tensor>&antiquant_offset,                                           \
      const std::optional<at::Tensor>&key_antiquant_scale,                                        \
      const std::optional<at::Tensor>&key_antiquant_offset,                                       \
      const std::optional<at::Tensor>&value_antiquant_scale,                                      \
      const std::optional<at::Tensor>&value_antiquant_offset,                                     \
      const std::optional<at::Tensor>&block_table,                                                \
      const std::optional<at::Tensor>&query_padding_size,                                         \
      const std::optional<at::Tensor>&kv_padding_size,                                            \
      const std::optional<at::Tensor>&key_shared_prefix,                                          \
      const std::optional<at::Tensor>&value_shared_prefix,                                        \
      at::OptionalSymIntArrayRef actual_shared_prefix_len,                                        \
      const std::optional<at::Tensor>&query_rope, const std::optional<at::Tensor>&key_rope,       \
      const std::optional<at::Tensor>&key_rope_antiquant_scale, int64_t num_heads, double scale,  \
      int64_t pre_tokens, int64_t next_tokens, c10::string_view input_layout,                     \
      int64_t num_key_value_heads, int64_t sparse_mode, int64_t inner_precise,                    \
      int64_t block_size, int64_t antiquant_mode, int64_t key_antiquant_mode,                     \
      int64_t value_antiquant_mode, bool softmax_lse_flag

std::tuple<at::Tensor, at::Tensor> fia_v1(FIA_V1_PARAMS) {
  (void)key_rope_antiquant_scale;  // reserved by torch_npu
  for (const auto& [name, mode] : {std::pair<const char*, int64_t>{"antiquant_mode", antiquant_mode},
                                   {"key_antiquant_mode", key_antiquant_mode},
                                   {"value_antiquant_mode", value_antiquant_mode}}) {
    OPENNPU_CHECK_ARG(mode >= 0 && mode <= 5, kOp, name, "must be in [0, 5], but got ", mode);
  }
  const bool antiquant = antiquant_scale.has_value() || key_antiquant_scale.has_value() ||
                         value_antiquant_scale.has_value();
  const SharedPrefix prefixed = with_shared_prefix(
      key, value, key_shared_prefix, value_shared_prefix, actual_shared_prefix_len,
      actual_seq_lengths_kv, input_layout, block_table, key_rope,
      {antiquant_mode, key_antiquant_mode, value_antiquant_mode}, antiquant);
  const bool prefix = prefixed.key.defined();
  const std::optional<at::Tensor> no_sink;
  Args given{query, prefix ? prefixed.key : key, prefix ? prefixed.value : value, pse_shift,
         atten_mask, to_ints(actual_seq_lengths),
         prefix && actual_seq_lengths_kv.has_value() ? prefixed.lens_kv
                                                     : to_ints(actual_seq_lengths_kv),
         actual_seq_lengths.has_value(), actual_seq_lengths_kv.has_value(), block_table,
         query_rope, key_rope,
         no_sink, num_heads, scale, pre_tokens, next_tokens, input_layout,
         num_key_value_heads, sparse_mode, inner_precise, block_size,
         softmax_lse_flag};
  // The separate key/value factors win over the combined antiquant_scale (torch_npu's rule).
  if (key_antiquant_scale.has_value() || value_antiquant_scale.has_value() ||
      key_antiquant_offset.has_value() || value_antiquant_offset.has_value()) {
    given.kq = {key_antiquant_scale, key_antiquant_offset, key_antiquant_mode, -1,
            "key_antiquant_scale", "key_antiquant_offset", "key_antiquant_mode"};
    given.vq = {value_antiquant_scale, value_antiquant_offset, value_antiquant_mode, -1,
            "value_antiquant_scale", "value_antiquant_offset", "value_antiquant_mode"};
  } else if (antiquant_scale.has_value() || antiquant_offset.has_value()) {
    OPENNPU_CHECK_ARG(antiquant_mode == 0 || antiquant_mode == 1, kOp, "antiquant_mode",
                      "must be 0 (per channel / tensor) or 1 (per token) with antiquant_scale, "
                      "but got ", antiquant_mode);
    given.kq = {antiquant_scale, antiquant_offset, antiquant_mode, 0, "antiquant_scale",
                "antiquant_offset", "antiquant_mode"};
    given.vq = {antiquant_scale, antiquant_offset, antiquant_mode, 1, "antiquant_scale",
                "antiquant_offset", "antiquant_mode"};
  }
  check_antiquant(kOp, given);
  // Full quantisation: the int8 codes as float32 (kept alive here: Args holds references).
  const FullQuant fq = full_quant(given, dequant_scale1, quant_scale1, dequant_scale2, antiquant);
  const at::Tensor qf = fq.on ? query.to(at::kFloat) : at::Tensor();
  const at::Tensor kf = fq.on ? given.key.to(at::kFloat) : at::Tensor();
  const at::Tensor vf = fq.on ? given.value.to(at::kFloat) : at::Tensor();
  std::optional<Args> dequantised;
  if (fq.on) {
    dequantised.emplace(with_inputs(given, qf, kf, vf, atten_mask, given.actual_seq_lengths_kv));
    dequantised->scale = given.scale * fq.dequant1;
    dequantised->p_quant = fq.quant1;
    dequantised->dequant2 = fq.dequant2;
  }
  const Args& a = fq.on ? *dequantised : given;
  const LeftPadding pad = left_padding(a, query_padding_size, kv_padding_size, prefix, antiquant,
                                       {antiquant_mode, key_antiquant_mode, value_antiquant_mode});
  const bool padded = !pad.q_start.empty() || !pad.kv_start.empty();
  if (!padded) {
    return run_quantised(kOp, a, out_quant(kOp, "quant_scale2", "quant_offset2", quant_scale2,
                                           quant_offset2, a, at::kChar));
  }
  const at::Tensor q = rotate_batches(a.query, pad.q_start, pad.in_seq, 1);
  const at::Tensor k = rotate_batches(a.key, pad.kv_start, pad.in_seq, 1);
  const at::Tensor v = rotate_batches(a.value, pad.kv_start, pad.in_seq, 1);
  const std::optional<at::Tensor> mask =
      atten_mask.has_value() && (sparse_mode == 0 || sparse_mode == 1)
          ? std::optional<at::Tensor>(rotate_mask(*atten_mask, pad, query.size(0)))
          : atten_mask;
  const Args shifted =
      with_inputs(a, q, k, v, mask, pad.kv_start.empty() ? a.actual_seq_lengths_kv : pad.lens_kv);
  auto [out, lse] = run_quantised(kOp, shifted, out_quant(kOp, "quant_scale2", "quant_offset2",
                                                          quant_scale2, quant_offset2, shifted,
                                                          at::kChar));
  out = rotate_batches(out, pad.q_start, pad.out_seq, -1);
  if (softmax_lse_flag) lse = rotate_batches(lse, pad.q_start, 2, -1);
  return {out, lse};
}

std::tuple<at::Tensor&, at::Tensor&> fia_v1_out(FIA_V1_PARAMS,
                                                const std::optional<at::Tensor>& /*workspace*/,
                                                at::Tensor& attention_out,
                                                at::Tensor& softmax_lse) {
  auto [out, lse] = fia_v1(
      query, key, value, pse_shift, atten_mask, actual_seq_lengths, actual_seq_lengths_kv,
      dequant_scale1, quant_scale1, dequant_scale2, quant_scale2, quant_offset2, antiquant_scale,
      antiquant_offset, key_antiquant_scale, key_antiquant_offset, value_antiquant_scale,
      value_antiquant_offset, block_table, query_padding_size, kv_padding_size, key_shared_prefix,
      value_shared_prefix, actual_shared_prefix_len, query_rope, key_rope,
      key_rope_antiquant_scale, num_heads, scale, pre_tokens, next_tokens, input_layout,
      num_key_value_heads, sparse_mode, inner_precise, block_size, antiquant_mode,
      key_antiquant_mode, value_antiquant_mode, softmax_lse_flag);
  copy_out(attention_out, out, kOp, "attention_out");
  copy_lse(softmax_lse, lse, kOp, softmax_lse_flag);
  return {attention_out, softmax_lse};
}

// The CPU kernels need no workspace: an empty uint8 tensor.
at::Tensor fia_v1_workspace(FIA_V1_PARAMS) {
  (void)key; (void)pse_shift; (void)atten_mask; (void)actual_seq_lengths;
  (void)actual_seq_lengths_kv; (void)dequant_scale1; (void)quant_scale1; (void)dequant_scale2;
  (void)quant_scale2; (void)quant_offset2; (void)antiquant_scale; (void)antiquant_offset;
  (void)key_antiquant_scale; (void)key_antiquant_offset; (void)value_antiquant_scale;
  (void)value_antiquant_offset; (void)block_table; (void)query_padding_size;
  (void)kv_padding_size; (void)key_shared_prefix; (void)value_shared_prefix;
  (void)actual_shared_prefix_len; (void)query_rope; (void)key_rope; (void)key_rope_antiquant_scale;
  (void)num_heads; (void)scale; (void)pre_tokens; (void)next_tokens; (void)input_layout;
  (void)num_key_value_heads; (void)sparse_mode; (void)inner_precise; (void)block_size;
  (void)antiquant_mode; (void)key_antiquant_mode; (void)value_antiquant_mode;
  (void)softmax_lse_flag; (void)value;
  return at::empty({0}, query.options().dtype(at::kByte));
}

// attention_out's dtype: int8 with output quantisation, float16 from an int8 query (full
// quantisation; torch_npu gives int8 MLA query_rope's dtype), else query's.
std::tuple<at::Tensor, at::Tensor> infer_output(const char* op, const at::Tensor& query,
                                                const at::Tensor& value, c10::string_view layout,
                                                const std::optional<at::Tensor>& quant_scale,
                                                const std::optional<at::Tensor>& block_table,
                                                int64_t num_heads, int64_t num_key_value_heads,
                                                bool lse_flag,
                                                const std::optional<at::Tensor>& query_rope) {
  const Shapes sh = output_shapes(op, query, value, layout, block_table.has_value(), num_heads,
                                  num_key_value_heads, lse_flag);
  at::ScalarType dt = query.scalar_type();
  if (quant_scale.has_value()) {
    dt = at::kChar;
  } else if (dt == at::kChar) {
    dt = query_rope.has_value() ? query_rope->scalar_type() : at::kHalf;
  }
  return {at::zeros(sh.out, query.options().dtype(dt)),
          at::zeros(sh.lse, query.options().dtype(at::kFloat))};
}

std::tuple<at::Tensor, at::Tensor> fia_v1_infer_output(
    const at::Tensor& query, const at::Tensor& value, c10::string_view input_layout,
    const std::optional<at::Tensor>& quant_scale2, const std::optional<at::Tensor>& block_table,
    int64_t num_heads, int64_t num_key_value_heads, bool softmax_lse_flag,
    const std::optional<at::Tensor>& query_rope) {
  return infer_output("_npu_fused_infer_attention_score_infer_output", query, value,
                      input_layout, quant_scale2, block_table, num_heads, num_key_value_heads,
                      softmax_lse_flag, query_rope);
}

// v2's out_dtype: with quant_scale_out None (int8), int8, float8_e5m2, float8_e4m3fn or
// torch_npu.hifloat8 (290: uint8 codes, as torch_npu returns them); without it None or query's
// dtype (the output is never cast otherwise).
at::ScalarType v2_out_dtype(std::optional<int64_t> out_dtype, const at::Tensor& query,
                            const std::optional<at::Tensor>& quant_scale_out,
                            const std::optional<at::Tensor>& query_rope) {
  if (quant_scale_out.has_value()) {
    if (!out_dtype.has_value()) return at::kChar;
    if (*out_dtype == quant::kHif8DtypeCode) return at::kByte;
    for (const at::ScalarType t : {at::kChar, at::kFloat8_e5m2, at::kFloat8_e4m3fn}) {
      if (*out_dtype == static_cast<int64_t>(t)) return t;
    }
    OPENNPU_CHECK_ARG(false, kOpV2, "out_dtype",
                      "must be None, torch.int8, torch.float8_e5m2, torch.float8_e4m3fn or "
                      "torch_npu.hifloat8 (290) with quant_scale_out, but got ",
                      dtype_name(*out_dtype));
  }
  // an int8 query (int8 MLA, query_quant_mode 3): query_rope's dtype
  const at::ScalarType dt = query.scalar_type() == at::kChar && query_rope.has_value()
                                ? query_rope->scalar_type()
                                : query.scalar_type();
  OPENNPU_CHECK_ARG(!out_dtype.has_value() || *out_dtype == static_cast<int64_t>(dt), kOpV2,
                    "out_dtype", "must be None or the output's dtype (", dt,
                    ") without quant_scale_out (a quantised output needs its factors), but got ",
                    out_dtype.has_value() ? dtype_name(*out_dtype) : "None");
  return dt;
}

// v2's int8 MLA (query_quant_mode 3, Ascend's "全量化" MLA scenario): an int8 query with
// dequant_scale_query, one float32 factor per token and head (query's shape without D, or with
// a trailing 1), int8 key / value with their dequant_scale_key / dequant_scale_value (the
// antiquant factors of any int8 cache), query_rope / key_rope in bfloat16 / float16 and the
// output in query_rope's dtype. The scores are (q . k) * s_q[token, head] * s_k (+ rope part):
// the query's codes times their factor in float32 (one product per element, as the factor
// multiplies the int32 dot product on Ascend up to that rounding), the attention in float32,
// the output rounded once. No output quantisation or key / value offsets, as on Ascend.
struct QueryDequant {
  at::Tensor query, query_rope, key_rope;  // float32; undefined: not an int8 query
};

QueryDequant query_dequant(const at::Tensor& query, const std::optional<at::Tensor>& scale,
                           int64_t mode, const std::optional<at::Tensor>& query_rope,
                           const std::optional<at::Tensor>& key_rope,
                           const std::optional<at::Tensor>& quant_scale_out,
                           const std::optional<at::Tensor>& dequant_offset_key,
                           const std::optional<at::Tensor>& dequant_offset_value) {
  QueryDequant r;
  const bool int8 = query.scalar_type() == at::kChar;
  if (!int8 && !scale.has_value() && mode == 0) return r;
  OPENNPU_CHECK_ARG(int8, kOpV2, scale.has_value() ? "dequant_scale_query" : "query_quant_mode",
                    "needs an int8 query (int8 MLA), but got a ", query.scalar_type(), " query");
  OPENNPU_CHECK_ARG(mode == 3, kOpV2, "query_quant_mode",
                    "must be 3 (per token and head) with an int8 query, but got ", mode);
  OPENNPU_CHECK_ARG(scale.has_value(), kOpV2, "dequant_scale_query",
                    "is needed with an int8 query (its per-token, per-head factors)");
  OPENNPU_CHECK_ARG(query_rope.has_value() && key_rope.has_value(), kOpV2, "query_rope",
                    "is needed with an int8 query (int8 MLA: query_rope and key_rope in bfloat16 "
                    "or float16, the output in their dtype)");
  OPENNPU_CHECK_ARG(query_rope->scalar_type() == at::kBFloat16 ||
                        query_rope->scalar_type() == at::kHalf,
                    kOpV2, "query_rope", "must be bfloat16 or float16 with an int8 query, but got ",
                    query_rope->scalar_type());
  reject(kOpV2, "quant_scale_out", quant_scale_out, "output quantisation with an int8 query");
  reject(kOpV2, "dequant_offset_key", dequant_offset_key, "key offsets with an int8 query");
  reject(kOpV2, "dequant_offset_value", dequant_offset_value, "value offsets with an int8 query");
  const at::Tensor& s = *scale;
  check_same_device(kOpV2, "dequant_scale_query", s, "query", query);
  const auto rows = query.sizes().slice(0, query.dim() - 1);
  std::vector<int64_t> with_one(rows.begin(), rows.end());
  with_one.push_back(1);
  OPENNPU_CHECK_ARG(s.scalar_type() == at::kFloat && (s.sizes() == rows || s.sizes() == with_one),
                    kOpV2, "dequant_scale_query", "must be float32 with query's shape but its "
                    "head size (", shape_str(rows), ", one factor per token and head), but got ",
                    s.scalar_type(), " ", shape_str(s.sizes()));
  r.query = query.to(at::kFloat).mul_(s.reshape(with_one).to(at::kFloat));
  r.query_rope = query_rope->to(at::kFloat);
  r.key_rope = key_rope->to(at::kFloat);
  return r;
}

#define FIA_V2_PARAMS                                                                             \
  const at::Tensor &query, const at::Tensor &key, const at::Tensor &value,                        \
      const std::optional<at::Tensor>&query_rope, const std::optional<at::Tensor>&key_rope,       \
      const std::optional<at::Tensor>&pse_shift, const std::optional<at::Tensor>&atten_mask,      \
      at::OptionalSymIntArrayRef actual_seq_qlen, at::OptionalSymIntArrayRef actual_seq_kvlen,    \
      const std::optional<at::Tensor>&block_table,                                                \
      const std::optional<at::Tensor>&dequant_scale_query,                                        \
      const std::optional<at::Tensor>&dequant_scale_key,                                          \
      const std::optional<at::Tensor>&dequant_offset_key,                                         \
      const std::optional<at::Tensor>&dequant_scale_value,                                        \
      const std::optional<at::Tensor>&dequant_offset_value,                                       \
      const std::optional<at::Tensor>&dequant_scale_key_rope,                                     \
      const std::optional<at::Tensor>&quant_scale_out,                                            \
      const std::optional<at::Tensor>&quant_offset_out,                                           \
      const std::optional<at::Tensor>&quant_scale_p,                                              \
      const std::optional<at::Tensor>&learnable_sink, int64_t num_query_heads,                    \
      int64_t num_key_value_heads, double softmax_scale, int64_t pre_tokens, int64_t next_tokens, \
      c10::string_view input_layout, int64_t sparse_mode, int64_t block_size,                     \
      int64_t query_quant_mode, int64_t key_quant_mode, int64_t value_quant_mode,                 \
      int64_t inner_precise, bool return_softmax_lse, std::optional<int64_t> query_dtype,         \
      std::optional<int64_t> key_dtype, std::optional<int64_t> value_dtype,                       \
      std::optional<int64_t> query_rope_dtype, std::optional<int64_t> key_rope_dtype,             \
      std::optional<int64_t> key_shared_prefix_dtype,                                             \
      std::optional<int64_t> value_shared_prefix_dtype,                                           \
      std::optional<int64_t> dequant_scale_query_dtype,                                           \
      std::optional<int64_t> dequant_scale_key_dtype,                                             \
      std::optional<int64_t> dequant_scale_value_dtype,                                           \
      std::optional<int64_t> dequant_scale_key_rope_dtype, std::optional<int64_t> out_dtype

#define FIA_V2_ARGS                                                                               \
  query, key, value, query_rope, key_rope, pse_shift, atten_mask, actual_seq_qlen,                \
      actual_seq_kvlen, block_table, dequant_scale_query, dequant_scale_key, dequant_offset_key,  \
      dequant_scale_value, dequant_offset_value, dequant_scale_key_rope, quant_scale_out,         \
      quant_offset_out, quant_scale_p, learnable_sink, num_query_heads, num_key_value_heads,      \
      softmax_scale, pre_tokens, next_tokens, input_layout, sparse_mode, block_size,              \
      query_quant_mode, key_quant_mode, value_quant_mode, inner_precise, return_softmax_lse,      \
      query_dtype, key_dtype, value_dtype, query_rope_dtype, key_rope_dtype,                      \
      key_shared_prefix_dtype, value_shared_prefix_dtype, dequant_scale_query_dtype,              \
      dequant_scale_key_dtype, dequant_scale_value_dtype, dequant_scale_key_rope_dtype, out_dtype

std::tuple<at::Tensor, at::Tensor> fia_v2(FIA_V2_PARAMS) {
  // reserved by torch_npu (dequant_scale_key_rope and the *_dtype codes but out_dtype)
  (void)dequant_scale_key_rope; (void)query_dtype; (void)key_dtype; (void)value_dtype;
  (void)query_rope_dtype; (void)key_rope_dtype; (void)key_shared_prefix_dtype;
  (void)value_shared_prefix_dtype; (void)dequant_scale_query_dtype; (void)dequant_scale_key_dtype;
  (void)dequant_scale_value_dtype; (void)dequant_scale_key_rope_dtype;
  reject(kOpV2, "quant_scale_p", quant_scale_p, "quantised probabilities");
  const QueryDequant dq = query_dequant(query, dequant_scale_query, query_quant_mode, query_rope,
                                        key_rope, quant_scale_out, dequant_offset_key,
                                        dequant_offset_value);
  const bool int8_query = dq.query.defined();
  const std::optional<at::Tensor> qr_f = int8_query ? std::optional<at::Tensor>(dq.query_rope) : query_rope;
  const std::optional<at::Tensor> kr_f = int8_query ? std::optional<at::Tensor>(dq.key_rope) : key_rope;
  for (const auto& [name, mode] : {std::pair<const char*, int64_t>{"key_quant_mode", key_quant_mode},
                                   {"value_quant_mode", value_quant_mode}}) {
    OPENNPU_CHECK_ARG(mode >= 0 && mode <= 5, kOpV2, name, "must be in [0, 5], but got ", mode);
  }
  const at::ScalarType out_type = v2_out_dtype(out_dtype, query, quant_scale_out, query_rope);
  Args a{int8_query ? dq.query : query, key, value, pse_shift, atten_mask, to_ints(actual_seq_qlen),
         to_ints(actual_seq_kvlen), actual_seq_qlen.has_value(),
         actual_seq_kvlen.has_value(), block_table, qr_f, kr_f,
         learnable_sink, num_query_heads, softmax_scale, pre_tokens, next_tokens,
         input_layout, num_key_value_heads, sparse_mode, inner_precise,
         block_size, return_softmax_lse};
  a.kq = {dequant_scale_key, dequant_offset_key, key_quant_mode, -1, "dequant_scale_key",
          "dequant_offset_key", "key_quant_mode"};
  a.vq = {dequant_scale_value, dequant_offset_value, value_quant_mode, -1, "dequant_scale_value",
          "dequant_offset_value", "value_quant_mode"};
  a.int8_mla = int8_query;
  check_antiquant(kOpV2, a);
  if (int8_query) {
    OPENNPU_CHECK_ARG(key.scalar_type() == at::kChar && value.scalar_type() == at::kChar &&
                          dequant_scale_key.has_value() && dequant_scale_value.has_value(),
                      kOpV2, "key", "must be int8 with dequant_scale_key / dequant_scale_value "
                      "when the query is int8, but got ", key.scalar_type(), " key and ",
                      value.scalar_type(), " value");
    auto [out, lse] = run(kOpV2, a);  // float32 query: a float32 output
    return {out.to(out_type), lse};
  }
  return run_quantised(kOpV2, a, out_quant(kOpV2, "quant_scale_out", "quant_offset_out",
                                           quant_scale_out, quant_offset_out, a, out_type));
}

std::tuple<at::Tensor&, at::Tensor&> fia_v2_out(FIA_V2_PARAMS,
                                                const std::optional<at::Tensor>& /*workspace*/,
                                                at::Tensor& attention_out,
                                                at::Tensor& softmax_lse) {
  auto [out, lse] = fia_v2(FIA_V2_ARGS);
  copy_out(attention_out, out, kOpV2, "attention_out");
  copy_lse(softmax_lse, lse, kOpV2, return_softmax_lse);
  return {attention_out, softmax_lse};
}

// The CPU kernels need no workspace: an empty uint8 tensor.
at::Tensor fia_v2_workspace(FIA_V2_PARAMS) {
  (void)key; (void)value; (void)query_rope; (void)key_rope; (void)pse_shift; (void)atten_mask;
  (void)actual_seq_qlen; (void)actual_seq_kvlen; (void)block_table; (void)dequant_scale_query;
  (void)dequant_scale_key; (void)dequant_offset_key; (void)dequant_scale_value;
  (void)dequant_offset_value; (void)dequant_scale_key_rope; (void)quant_scale_out;
  (void)quant_offset_out; (void)quant_scale_p; (void)learnable_sink; (void)num_query_heads;
  (void)num_key_value_heads; (void)softmax_scale; (void)pre_tokens; (void)next_tokens;
  (void)input_layout; (void)sparse_mode; (void)block_size; (void)query_quant_mode;
  (void)key_quant_mode; (void)value_quant_mode; (void)inner_precise; (void)return_softmax_lse;
  (void)query_dtype; (void)key_dtype; (void)value_dtype; (void)query_rope_dtype;
  (void)key_rope_dtype; (void)key_shared_prefix_dtype; (void)value_shared_prefix_dtype;
  (void)dequant_scale_query_dtype; (void)dequant_scale_key_dtype; (void)dequant_scale_value_dtype;
  (void)dequant_scale_key_rope_dtype; (void)out_dtype;
  return at::empty({0}, query.options().dtype(at::kByte));
}

std::tuple<at::Tensor, at::Tensor> fia_v2_infer_output(
    const at::Tensor& query, const at::Tensor& value, std::optional<int64_t> /*query_dtype*/,
    std::optional<int64_t> /*value_dtype*/, c10::string_view input_layout,
    const std::optional<at::Tensor>& quant_scale_out, const std::optional<at::Tensor>& block_table,
    int64_t num_query_heads, int64_t num_key_value_heads, bool return_softmax_lse,
    const std::optional<at::Tensor>& query_rope, std::optional<int64_t> out_dtype) {
  const char* op = "_npu_fused_infer_attention_score_v2_infer_output";
  const Shapes sh = output_shapes(op, query, value, input_layout, block_table.has_value(),
                                  num_query_heads, num_key_value_heads, return_softmax_lse);
  const at::ScalarType dt = v2_out_dtype(out_dtype, query, quant_scale_out, query_rope);
  return {at::zeros(sh.out, query.options().dtype(dt)),
          at::zeros(sh.lse, query.options().dtype(at::kFloat))};
}

}  // namespace

TORCH_LIBRARY_IMPL(npu, CPU, m) {
  m.impl("npu_fused_infer_attention_score", &fia_v1);
  m.impl("npu_fused_infer_attention_score.out", &fia_v1_out);
  m.impl("_npu_fused_infer_attention_score_get_max_workspace", &fia_v1_workspace);
  m.impl("_npu_fused_infer_attention_score_infer_output", &fia_v1_infer_output);
  m.impl("npu_fused_infer_attention_score_v2", &fia_v2);
  m.impl("npu_fused_infer_attention_score_v2.out", &fia_v2_out);
  m.impl("_npu_fused_infer_attention_score_v2_get_max_workspace", &fia_v2_workspace);
  m.impl("_npu_fused_infer_attention_score_v2_infer_output", &fia_v2_infer_output);
}

#ifdef OPENNPU_WITH_CUDA
// The entry points for the decode calls the CUDA router (infer_attention_cuda.cu) sends here:
// their kernel is infer_decode's CUDA slot.
TORCH_LIBRARY_IMPL(opennpu, CUDA, m) {
  m.impl("_fia_decode", &fia_v1);
  m.impl("_fia_v2_decode", &fia_v2);
}
#endif

}  // namespace opennpu::attention
