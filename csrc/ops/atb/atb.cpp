// torch.ops.atb: the ATB (Ascend Transformer Boost) ops that torch_npu exposes as
// torch_npu._npu_reshape_and_cache, _npu_paged_attention, _npu_flash_attention, ... and that
// vllm-ascend calls. Schemas are op-plugin's (csrc/library.cpp). No kernel of its own: each op
// validates ATB's arguments under its own name and runs an existing family's kernel:
//   _npu_reshape_and_cache(_siso), npu_paged_cache_load(.out)  -> kvcache (row-copy plans)
//   _npu_paged_attention                                        -> the decode kernel of
//                                                                  npu_fused_infer_attention_score
//   _npu_flash_attention                                        -> npu_fusion_attention's forward
//   _npu_rotary_embedding                                       -> npu_rotary_mul's kernel
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <optional>
#include <tuple>
#include <vector>

#include "common/checks.h"
#include "common/dtype.h"
#include "ops/attention/attention.h"
#include "ops/attention/infer_attention.h"
#include "ops/kvcache/kvcache.h"
#include "ops/rotary/rotary.h"

namespace opennpu::atb {
namespace {

using attention::AttentionPlan;
using attention::AttentionProblem;
using attention::DecodeProblem;
using attention::KeyInterval;
using attention::KvRows;
using attention::SeqView;

void check_index(const char* op, const char* name, const at::Tensor& t) {
  OPENNPU_CHECK_ARG(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, op, name,
                    "must be int32 or int64, but got ", t.scalar_type());
}

std::vector<int64_t> values_of(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kLong).contiguous();
  const int64_t* p = c.const_data_ptr<int64_t>();
  return {p, p + c.numel()};
}

void check_half_or_float(const char* op, const char* name, const at::Tensor& t) {
  const auto s = t.scalar_type();
  OPENNPU_CHECK_ARG(s == at::kHalf || s == at::kBFloat16 || s == at::kFloat, op, name,
                    "must be float16, bfloat16 or float32, but got ", s);
}

// A [T, heads, d] view of t given as [T, heads, d] or [T, heads * d] (the dims ATB accepts),
// with a contiguous last dim (a copy where it is not).
at::Tensor heads_view(const char* op, const char* name, const at::Tensor& t, int64_t tokens,
                      int64_t heads, int64_t d_or_neg) {
  bool ok = t.dim() == 3 || t.dim() == 2;
  ok = ok && t.size(0) == tokens;
  if (ok && t.dim() == 3) ok = t.size(1) == heads && (d_or_neg < 0 || t.size(2) == d_or_neg);
  if (ok && t.dim() == 2) {
    ok = heads > 0 && t.size(1) % heads == 0 && (d_or_neg < 0 || t.size(1) == heads * d_or_neg);
  }
  OPENNPU_CHECK_ARG(ok, op, name, "must be [", tokens, ", ", heads, ", ",
                    d_or_neg < 0 ? std::string("head_size") : std::to_string(d_or_neg), "] or [",
                    tokens, ", ", heads, " * head_size], but got shape ", shape_str(t.sizes()));
  at::Tensor v = t.dim() == 3 ? t : t.view({tokens, heads, t.size(1) / heads});
  return v.stride(-1) == 1 ? v : v.contiguous();
}

void check_scale(const char* op, double scale) {
  OPENNPU_CHECK_ARG(std::isfinite(scale), op, "scale_value", "must be finite, but got ", scale);
}

void check_heads(const char* op, int64_t num_heads, int64_t num_kv_heads) {
  OPENNPU_CHECK_ARG(num_heads > 0, op, "num_heads", "must be positive, but got ", num_heads);
  OPENNPU_CHECK_ARG(num_kv_heads > 0 && num_heads % num_kv_heads == 0, op, "num_kv_heads",
                    "must be positive and divide num_heads (", num_heads, "), but got ",
                    num_kv_heads);
}

// ----------------------------------------------------------------------------------------------
// _npu_reshape_and_cache(_siso): vLLM's reshape_and_cache. ATB picks the NZ cache configuration
// from the caches' storage format; opennpu keeps values in their logical layout, so the layout
// follows from the cache's shape ('Norm' [blocks, block_size, heads, D], else the NZ blocking
// [blocks, heads * D / 16 (int8: 32), block_size, 16 (32)]).

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_indices) {
  const char* op = "_npu_reshape_and_cache";
  OPENNPU_CHECK_ARG(key.dim() == 3, op, "key", "must be 3-D [tokens, kv_heads, head_size], but got ",
                    "shape ", shape_str(key.sizes()));
  OPENNPU_CHECK_ARG(value.dim() == 3 && value.size(0) == key.size(0), op, "value",
                    "must be 3-D [tokens, kv_heads, head_size_v] with the tokens of 'key' (",
                    key.size(0), "), but got shape ", shape_str(value.sizes()));
  check_same_device(op, "value", value, "key", key);
  OPENNPU_CHECK_ARG(key_cache.dim() == 4 && value_cache.dim() == 4 &&
                        key_cache.size(0) == value_cache.size(0),
                    op, "value_cache", "must be 4-D with the blocks of 'key_cache' ",
                    shape_str(key_cache.sizes()), ", but got ", shape_str(value_cache.sizes()));
  kvcache::scatter_tokens(op, "key", key, "key_cache", key_cache, slot_indices);
  kvcache::scatter_tokens(op, "value", value, "value_cache", value_cache, slot_indices);
}

void reshape_and_cache_siso(const at::Tensor& key, at::Tensor& key_cache,
                            const at::Tensor& slot_indices) {
  const char* op = "_npu_reshape_and_cache_siso";
  OPENNPU_CHECK_ARG(key.dim() == 3, op, "key", "must be 3-D [tokens, kv_heads, head_size], but got ",
                    "shape ", shape_str(key.sizes()));
  kvcache::scatter_tokens(op, "key", key, "key_cache", key_cache, slot_indices);
}

// ----------------------------------------------------------------------------------------------
// npu_paged_cache_load: npu_gather_pa_kv_cache under ATB's names.

std::tuple<at::Tensor&, at::Tensor&> paged_cache_load_out(
    const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_table,
    const at::Tensor& context_lens, const std::optional<at::Tensor>& seq_starts, bool cumsum,
    at::Tensor& key, at::Tensor& value) {
  kvcache::gather_tokens("npu_paged_cache_load", key_cache, value_cache, block_table,
                         context_lens, key, value, seq_starts, cumsum);
  return {key, value};
}

std::tuple<at::Tensor, at::Tensor> paged_cache_load(
    const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_table,
    const at::Tensor& context_lens, const std::optional<at::Tensor>& seq_starts, bool cumsum) {
  const char* op = "npu_paged_cache_load";
  check_index(op, "context_lens", context_lens);
  OPENNPU_CHECK_ARG(context_lens.dim() == 1 && (!cumsum || context_lens.size(0) >= 1), op,
                    "context_lens", "must be 1-D (", cumsum ? "batch + 1 cumulative ends"
                                                            : "one length per sequence",
                    "), but got shape ", shape_str(context_lens.sizes()));
  OPENNPU_CHECK_ARG(key_cache.dim() == 4 && value_cache.dim() == 4, op, "key_cache",
                    "must be 4-D [num_blocks, block_size, num_heads, head_size] with a 4-D "
                    "value_cache, but got ", shape_str(key_cache.sizes()), " and ",
                    shape_str(value_cache.sizes()));
  const std::vector<int64_t> lens = values_of(context_lens);
  int64_t tokens = 0;
  if (cumsum) {
    tokens = lens.back() - lens.front();
  } else {
    for (size_t i = 0; i < lens.size(); ++i) {
      OPENNPU_CHECK_ARG(lens[i] >= 0, op, "context_lens", "must hold lengths >= 0, but sequence ",
                        i, " has ", lens[i]);
      tokens += lens[i];
    }
  }
  OPENNPU_CHECK_ARG(tokens >= 0, op, "context_lens",
                    "must be non-decreasing (cumulative ends), but got a total of ", tokens);
  at::Tensor key = at::zeros({tokens, key_cache.size(2), key_cache.size(3)}, key_cache.options());
  at::Tensor value =
      at::zeros({tokens, value_cache.size(2), value_cache.size(3)}, value_cache.options());
  kvcache::gather_tokens(op, key_cache, value_cache, block_table, context_lens, key, value,
                         seq_starts, cumsum);
  return {key, value};
}

// ----------------------------------------------------------------------------------------------
// _npu_paged_attention: one query row per sequence (token) against its paged KV cache, on the
// decode kernel of npu_fused_infer_attention_score (reads K/V in place through the block table,
// fp32 online softmax, GQA groups share each K/V row, the output rounded once).

struct PagedArgs {
  at::Tensor q;            // [T, N, D], last dim contiguous
  at::Tensor kc, vc;       // [blocks, block_size, KVN, D | Dv], last dim contiguous
  at::Tensor table;        // int32 [T, max_blocks], contiguous
  std::vector<int64_t> lens;
  int64_t tokens = 0, N = 0, KVN = 0, D = 0, Dv = 0, block_size = 0;
};

PagedArgs check_paged(const char* op, const at::Tensor& query, const at::Tensor& key_cache,
                      const at::Tensor& value_cache, int64_t num_kv_heads, int64_t num_heads,
                      double scale_value, const at::Tensor& block_table,
                      const at::Tensor& context_lens, const at::Tensor& out) {
  PagedArgs a;
  check_heads(op, num_heads, num_kv_heads);
  check_scale(op, scale_value);
  check_half_or_float(op, "query", query);
  OPENNPU_CHECK_ARG(query.dim() == 2 || query.dim() == 3, op, "query",
                    "must be [tokens, num_heads, head_size] or [tokens, num_heads * head_size], "
                    "but got shape ", shape_str(query.sizes()));
  a.tokens = query.size(0);
  a.N = num_heads;
  a.KVN = num_kv_heads;
  a.q = heads_view(op, "query", query, a.tokens, a.N, -1);
  a.D = a.q.size(2);
  OPENNPU_CHECK_ARG(a.D > 0, op, "query", "must have a head size > 0, but got shape ",
                    shape_str(query.sizes()));
  for (const auto& [name, c] : {std::pair<const char*, const at::Tensor&>{"key_cache", key_cache},
                                {"value_cache", value_cache}}) {
    check_same_device(op, name, c, "query", query);
    OPENNPU_CHECK_ARG(c.scalar_type() == query.scalar_type(), op, name,
                      "must have the dtype of 'query' (", query.scalar_type(), "), but got ",
                      c.scalar_type());
    const bool k = c.is_same(key_cache);
    OPENNPU_CHECK_ARG(c.dim() == 4 && c.size(2) == a.KVN && (!k || c.size(3) == a.D) &&
                          c.size(0) == key_cache.size(0) && c.size(1) == key_cache.size(1),
                      op, name, "must be [num_blocks, block_size, num_kv_heads = ", a.KVN, ", ",
                      k ? std::to_string(a.D) + " (query's head size)" : std::string("head_size_v"),
                      "] with the blocks of 'key_cache' (the NZ layout is not implemented), but "
                      "got shape ", shape_str(c.sizes()));
  }
  a.block_size = key_cache.size(1);
  a.Dv = value_cache.size(3);
  const auto last_contig = [](const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); };
  a.kc = last_contig(key_cache);
  a.vc = last_contig(value_cache);

  check_index(op, "block_table", block_table);
  check_same_device(op, "block_table", block_table, "query", query);
  OPENNPU_CHECK_ARG(block_table.dim() == 2 && block_table.size(0) == a.tokens, op, "block_table",
                    "must be 2-D [tokens = ", a.tokens, ", max_blocks], but got shape ",
                    shape_str(block_table.sizes()));
  check_index(op, "context_lens", context_lens);  // a host (CPU) tensor on Ascend
  OPENNPU_CHECK_ARG(context_lens.dim() == 1 && context_lens.size(0) == a.tokens, op,
                    "context_lens", "must be 1-D with one length per token (", a.tokens,
                    "), but got shape ", shape_str(context_lens.sizes()));
  a.lens = values_of(context_lens);
  a.table = block_table.to(at::kInt).contiguous();
  const int64_t cols = block_table.size(1), blocks = key_cache.size(0);
  const int32_t* tp = a.table.const_data_ptr<int32_t>();
  for (int64_t b = 0; b < a.tokens; ++b) {
    const int64_t len = a.lens[b];
    OPENNPU_CHECK_ARG(len >= 0 && len <= cols * a.block_size, op, "context_lens",
                      "must hold lengths in [0, max_blocks * block_size] = [0, ",
                      cols * a.block_size, "], but token ", b, " has ", len);
    for (int64_t j = 0; j < (len + a.block_size - 1) / a.block_size; ++j) {
      const int64_t id = tp[b * cols + j];
      OPENNPU_CHECK_ARG(id >= 0 && id < blocks, op, "block_table",
                        "must hold block ids in [0, num_blocks = ", blocks, ") for the blocks "
                        "that context_lens covers, but row ", b, " column ", j, " has ", id);
    }
  }
  check_same_device(op, "out", out, "query", query);
  OPENNPU_CHECK_ARG(out.scalar_type() == query.scalar_type(), op, "out",
                    "must have the dtype of 'query' (", query.scalar_type(), "), but got ",
                    out.scalar_type());
  const bool out_ok = (out.dim() == 3 && out.sizes().equals({a.tokens, a.N, a.Dv})) ||
                      (out.dim() == 2 && out.sizes().equals({a.tokens, a.N * a.Dv}));
  OPENNPU_CHECK_ARG(out_ok, op, "out", "must be [", a.tokens, ", ", a.N, ", ", a.Dv, "] or [",
                    a.tokens, ", ", a.N * a.Dv, "] (tokens, num_heads, value_cache's head size), "
                    "but got shape ", shape_str(out.sizes()));
  return a;
}

// `body(dst)` on a [T, N, d] view of out (given as [T, N, d] or [T, N * d]) with a contiguous
// last dim, or on a contiguous copy that is then copied into out.
template <typename Body>
void into_heads(at::Tensor& out, int64_t tokens, int64_t heads, Body&& body) {
  const int64_t d = out.dim() == 3 ? out.size(2) : out.size(1) / heads;
  if (out.stride(-1) == 1 || d <= 1) {
    at::Tensor dst = out.dim() == 3 ? out
                                    : out.as_strided({tokens, heads, d},
                                                     {out.stride(0), d * out.stride(1), 1});
    if (dst.stride(-1) == 1) {
      body(dst);
      return;
    }
  }
  at::Tensor tmp = at::empty({tokens, heads, d}, out.options());
  body(tmp);
  out.copy_(tmp.view(out.sizes()));
}

void paged_attention(const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, int64_t num_kv_heads, int64_t num_heads,
                     double scale_value, const at::Tensor& block_table,
                     const at::Tensor& context_lens, at::Tensor& out,
                     const std::optional<at::Tensor>& workspace) {
  const char* op = "_npu_paged_attention";
  const PagedArgs a = check_paged(op, query, key_cache, value_cache, num_kv_heads, num_heads,
                                  scale_value, block_table, context_lens, out);
  (void)workspace;  // ATB's scratch; the CPU kernel allocates its own
  if (a.tokens == 0 || a.Dv == 0) return;
  AttentionProblem p;
  p.batch = a.tokens;
  p.heads_q = a.N;
  p.heads_kv = a.KVN;
  p.head_dim = a.D;
  p.head_dim_v = a.Dv;
  p.scale = scale_value;
  p.q_start.assign(a.tokens, 0);
  p.kv_start.assign(a.tokens, 0);
  p.q_len.resize(a.tokens);
  p.kv_len = a.lens;
  p.stats_rows_per_head = 1;
  for (int64_t b = 0; b < a.tokens; ++b) p.q_len[b] = a.lens[b] > 0 ? 1 : 0;
  p.q = SeqView{a.q.stride(0), a.q.stride(1), 0};
  DecodeProblem d;
  d.p = &p;
  d.q = a.q.const_data_ptr();
  const auto rows = [](const at::Tensor& c) {
    KvRows r;
    r.base = c.const_data_ptr();
    r.stride_blk = c.stride(0);
    r.stride_s = c.stride(1);
    r.stride_n = c.stride(2);
    return r;
  };
  d.cache.k = rows(a.kc);
  d.cache.v = rows(a.vc);
  d.cache.block_table = a.table.const_data_ptr<int32_t>();
  d.cache.table_stride = a.table.size(1);
  d.cache.block_size = a.block_size;
  d.visible.resize(a.tokens);
  for (int64_t b = 0; b < a.tokens; ++b) {
    d.visible[b] = a.lens[b] > 0 ? KeyInterval{0, a.lens[b] - 1} : KeyInterval{0, -1};
  }
  into_heads(out, a.tokens, a.N, [&](at::Tensor& dst) {
    for (int64_t b = 0; b < a.tokens; ++b) {
      if (a.lens[b] == 0) dst.select(0, b).zero_();  // no key: zeros
    }
    p.out = SeqView{dst.stride(0), dst.stride(1), 0};
    attention::infer_decode.get(op, query)(d, query.scalar_type(), dst.data_ptr());
  });
}

at::Tensor paged_attention_get_workspace(const at::Tensor& query, const at::Tensor& key_cache,
                                         const at::Tensor& value_cache, int64_t num_kv_heads,
                                         int64_t num_heads, double scale_value,
                                         const at::Tensor& block_table,
                                         const at::Tensor& context_lens, at::Tensor& out) {
  check_paged("_npu_paged_attention_get_workspace", query, key_cache, value_cache, num_kv_heads,
              num_heads, scale_value, block_table, context_lens, out);
  return at::empty({0}, query.options().dtype(at::kByte));  // the CPU kernel needs none
}

// ----------------------------------------------------------------------------------------------
// _npu_flash_attention: ATB SelfAttention PA_ENCODER (prefill). Sequences packed along tokens
// (TND), seq_len[b] query = key rows each, an additive mask [max_s, max_s] (or per batch) added
// to scale * Q K^T. Runs npu_fusion_attention's forward: -inf entries of the mask become its
// boolean mask (masked keys are skipped), the finite ones its pse.

void flash_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                     const at::Tensor& mask, const at::Tensor& seq_len, double scale_value,
                     int64_t num_heads, int64_t num_kv_heads, at::Tensor& out) {
  const char* op = "_npu_flash_attention";
  check_heads(op, num_heads, num_kv_heads);
  check_scale(op, scale_value);
  OPENNPU_CHECK_ARG(scale_value != 0.0, op, "scale_value", "must be nonzero");
  check_floating(op, "query", query);
  OPENNPU_CHECK_ARG(query.dim() == 2 || query.dim() == 3, op, "query",
                    "must be [tokens, num_heads, head_size] or [tokens, num_heads * head_size], "
                    "but got shape ", shape_str(query.sizes()));
  const int64_t T = query.size(0), N = num_heads, KVN = num_kv_heads;
  const at::Tensor q = heads_view(op, "query", query, T, N, -1);
  const int64_t D = q.size(2);
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"key", key},
                                {"value", value}, {"out", out}}) {
    check_same_device(op, name, t, "query", query);
    OPENNPU_CHECK_ARG(t.scalar_type() == query.scalar_type(), op, name,
                      "must have the dtype of 'query' (", query.scalar_type(), "), but got ",
                      t.scalar_type());
  }
  const at::Tensor k = heads_view(op, "key", key, T, KVN, D);
  const at::Tensor v = heads_view(op, "value", value, T, KVN, -1);
  const int64_t Dv = v.size(2);
  const bool out_ok = (out.dim() == 3 && out.sizes().equals({T, N, Dv})) ||
                      (out.dim() == 2 && out.sizes().equals({T, N * Dv}));
  OPENNPU_CHECK_ARG(out_ok, op, "out", "must be [", T, ", ", N, ", ", Dv, "] or [", T, ", ",
                    N * Dv, "] (tokens, num_heads, value's head size), but got shape ",
                    shape_str(out.sizes()));
  check_index(op, "seq_len", seq_len);  // a host (CPU) tensor on Ascend
  OPENNPU_CHECK_ARG(seq_len.dim() == 1, op, "seq_len", "must be 1-D [batch], but got shape ",
                    shape_str(seq_len.sizes()));
  const std::vector<int64_t> lens = values_of(seq_len);
  const int64_t batch = static_cast<int64_t>(lens.size());
  AttentionProblem p;
  p.batch = batch;
  p.heads_q = N;
  p.heads_kv = KVN;
  p.head_dim = D;
  p.head_dim_v = Dv;
  p.scale = scale_value;
  p.tnd = true;
  p.stats_token_major = true;
  p.stats_rows_per_head = T;
  int64_t sum = 0, max_s = 0;
  for (int64_t b = 0; b < batch; ++b) {
    OPENNPU_CHECK_ARG(lens[b] >= 0 && lens[b] <= T - sum, op, "seq_len",
                      "must hold lengths >= 0 whose sum is at most the token count ", T,
                      ", but sequence ", b, " has ", lens[b], " after ", sum, " tokens");
    p.q_start.push_back(sum);
    p.q_len.push_back(lens[b]);
    sum += lens[b];
    max_s = std::max(max_s, lens[b]);
  }
  p.kv_start = p.q_start;
  p.kv_len = p.q_len;

  // The mask: [S, S], [B | 1, S, S] or [B | 1, 1 | N, S, S], S >= the longest sequence.
  check_same_device(op, "mask", mask, "query", query);
  OPENNPU_CHECK_ARG(mask.is_floating_point(), op, "mask",
                    "must be a floating additive mask, but got ", mask.scalar_type());
  bool mask_ok = mask.dim() >= 2 && mask.dim() <= 4 && mask.size(-1) >= max_s &&
                 mask.size(-2) >= max_s;
  if (mask_ok && mask.dim() >= 3) mask_ok = mask.size(0) == 1 || mask.size(0) == batch;
  if (mask_ok && mask.dim() == 4) mask_ok = mask.size(1) == 1 || mask.size(1) == N;
  OPENNPU_CHECK_ARG(mask_ok, op, "mask",
                    "must be [S, S], [batch | 1, S, S] or [batch | 1, 1 | num_heads, S, S] with S "
                    ">= the longest sequence (", max_s, ") and batch = ", batch,
                    ", but got shape ", shape_str(mask.sizes()));
  const at::ScalarType acc = acc_dtype(query);
  const at::Tensor mf = mask.to(acc).contiguous();
  const at::Tensor neg = mf.isneginf();
  const bool has_neg = neg.any().item<bool>();
  const at::Tensor finite = has_neg ? mf.masked_fill(neg, 0) : mf;
  const bool has_pse = finite.ne(0).any().item<bool>();
  at::Tensor um, pse;
  const auto strides = [&](const at::Tensor& t, int64_t& sb, int64_t& sn, int64_t& si) {
    sb = t.dim() >= 3 && t.size(0) > 1 ? t.stride(0) : 0;
    sn = t.dim() == 4 && t.size(1) > 1 ? t.stride(1) : 0;
    si = t.stride(-2);
  };
  if (has_neg) {
    um = neg.to(at::kByte).contiguous();
    p.user_mask = um.const_data_ptr<uint8_t>();
    strides(um, p.mask_stride_b, p.mask_stride_n, p.mask_stride_i);
  }
  if (has_pse) {
    // The kernel computes scale * (Q K^T + pse): pse = mask / scale.
    pse = finite.div(scale_value).contiguous();
    p.pse = pse.const_data_ptr();
    strides(pse, p.pse_stride_b, p.pse_stride_n, p.pse_stride_i);
  }

  const AttentionPlan plan = attention::attention_plan.get(op, query)(
      op, query.scalar_type(), D, Dv, /*check_forced_tiles=*/false);
  p.tiles = plan.tiles;
  p.pv = plan.pv;
  const auto conv = [&](const at::Tensor& t) {
    const at::Tensor c = t.to(plan.compute);
    return c.stride(-1) == 1 ? c : c.contiguous();
  };
  const at::Tensor qx = conv(q), kx = conv(k), vx = conv(v);
  const auto tnd = [](const at::Tensor& t) { return SeqView{0, t.stride(1), t.stride(0)}; };
  p.q = tnd(qx);
  p.k = tnd(kx);
  p.v = tnd(vx);
  at::Tensor out_c = at::zeros({T, N, Dv}, query.options().dtype(plan.compute));
  p.out = tnd(out_c);
  const at::ScalarType st = acc == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor smax = at::empty({T, N, 8}, query.options().dtype(st));
  at::Tensor ssum = at::empty({T, N, 8}, query.options().dtype(st));
  if (sum > 0 && Dv > 0) {
    smax.fill_(-std::numeric_limits<double>::infinity());
    ssum.zero_();
    attention::attention_fwd.get(op, qx)(p, qx, kx, vx, out_c, smax, ssum);
  }
  out.copy_(out.dim() == 3 ? out_c : out_c.view(out.sizes()));
}

// ----------------------------------------------------------------------------------------------
// _npu_rotary_embedding: vLLM's rotary_embedding in place. cos_sin_cache [max_pos, rot_dim]
// holds cos | sin halves; the first rot_dim elements of every head of query and key rotate
// (neox: halves, else interleaved pairs), the rest stay.

// x holds tokens x heads x head_size elements (checked by the caller).
void rotate_in_place(const char* op, at::Tensor& x, int64_t tokens, int64_t head_size,
                     const at::Tensor& r1, const at::Tensor& r2, rotary::Mode mode) {
  if (x.numel() == 0) return;
  const int64_t heads = x.numel() / (tokens * head_size);
  const int64_t rot = r1.size(-1);
  at::Tensor base = x.is_contiguous() ? x.view({tokens, heads, head_size})
                                      : x.contiguous().view({tokens, heads, head_size});
  const at::Tensor part = base.narrow(2, 0, rot);
  rotary::RowLayout layout;
  layout.sizes = {tokens, heads};
  layout.x_strides = {part.stride(0), part.stride(1)};
  layout.r1_strides = {r1.stride(0), 0};
  layout.r2_strides = {r2.stride(0), 0};
  if (rot == head_size) {  // whole rows, contiguous: the kernel rotates them in place
    rotary::rotary_fwd.get(op, x)(part, r1, r2, layout, mode, base);
  } else {
    at::Tensor res = at::empty({tokens, heads, rot}, x.options());
    rotary::rotary_fwd.get(op, x)(part, r1, r2, layout, mode, res);
    base.narrow(2, 0, rot).copy_(res);
  }
  if (!x.is_contiguous()) x.copy_(base.view(x.sizes()));
}

void rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                      int64_t head_size, const at::Tensor& cos_sin_cache, bool is_neox_style) {
  const char* op = "_npu_rotary_embedding";
  check_index(op, "positions", positions);
  check_floating(op, "query", query);
  check_same_device(op, "query", query, "positions", positions);
  check_same_device(op, "key", key, "positions", positions);
  check_same_device(op, "cos_sin_cache", cos_sin_cache, "positions", positions);
  OPENNPU_CHECK_ARG(key.scalar_type() == query.scalar_type(), op, "key",
                    "must have the dtype of 'query' (", query.scalar_type(), "), but got ",
                    key.scalar_type());
  OPENNPU_CHECK_ARG(cos_sin_cache.is_floating_point() && cos_sin_cache.dim() == 2 &&
                        cos_sin_cache.size(1) % 2 == 0 && cos_sin_cache.size(1) > 0,
                    op, "cos_sin_cache",
                    "must be a floating 2-D [max_position, rot_dim] tensor (cos | sin halves, "
                    "rot_dim even), but got ", cos_sin_cache.scalar_type(), " ",
                    shape_str(cos_sin_cache.sizes()));
  const int64_t rot = cos_sin_cache.size(1);
  OPENNPU_CHECK_ARG(head_size >= rot, op, "head_size",
                    "must be at least cos_sin_cache's rot_dim (", rot, "), but got ", head_size);
  const int64_t tokens = positions.numel();
  const at::Tensor pos = positions.reshape({-1}).to(at::kLong);
  if (tokens > 0) {
    const int64_t lo = pos.min().item<int64_t>(), hi = pos.max().item<int64_t>();
    OPENNPU_CHECK_ARG(lo >= 0 && hi < cos_sin_cache.size(0), op, "positions",
                      "must hold positions in [0, max_position = ", cos_sin_cache.size(0),
                      "), but got values in [", lo, ", ", hi, "]");
  }
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"query", query},
                                {"key", key}}) {
    OPENNPU_CHECK_ARG(tokens == 0 ? t.numel() == 0 || t.size(0) == 0
                                  : t.numel() % (tokens * head_size) == 0 && t.numel() > 0,
                      op, name, "must hold positions.numel() (", tokens, ") x heads x head_size (",
                      head_size, ") elements, but got shape ", shape_str(t.sizes()));
  }
  if (tokens == 0) return;
  const at::Tensor cs = cos_sin_cache.index_select(0, pos).to(acc_dtype(query));
  const at::Tensor c = cs.narrow(1, 0, rot / 2), s = cs.narrow(1, rot / 2, rot / 2);
  const at::Tensor r1 = (is_neox_style ? at::cat({c, c}, 1) : c.repeat_interleave(2, 1)).contiguous();
  const at::Tensor r2 = (is_neox_style ? at::cat({s, s}, 1) : s.repeat_interleave(2, 1)).contiguous();
  const rotary::Mode mode = is_neox_style ? rotary::Mode::kHalf : rotary::Mode::kInterleave;
  rotate_in_place(op, query, tokens, head_size, r1, r2, mode);
  rotate_in_place(op, key, tokens, head_size, r1, r2, mode);
}

}  // namespace

TORCH_LIBRARY_IMPL(atb, CPU, m) {
  m.impl("_npu_reshape_and_cache", &reshape_and_cache);
  m.impl("_npu_reshape_and_cache_siso", &reshape_and_cache_siso);
  m.impl("npu_paged_cache_load", &paged_cache_load);
  m.impl("npu_paged_cache_load.out", &paged_cache_load_out);
  m.impl("_npu_paged_attention", &paged_attention);
  m.impl("_npu_paged_attention_get_workspace", &paged_attention_get_workspace);
  m.impl("_npu_flash_attention", &flash_attention);
  m.impl("_npu_rotary_embedding", &rotary_embedding);
}

}  // namespace opennpu::atb
