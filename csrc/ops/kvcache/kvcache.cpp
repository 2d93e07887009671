// Entry points of the KV-cache family: validation, index -> byte-offset plans, CPU registration.
#include "ops/kvcache/kvcache.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "common/checks.h"

namespace opennpu::kvcache {

KernelSlots<CopyRowsFn> row_copy;

namespace {

void check_index(const char* op, const char* name, const at::Tensor& t) {
  OPENNPU_CHECK_ARG(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, op, name,
                    "must be int32 or int64, but got ", t.scalar_type());
}

// The values of an int32 / int64 tensor of any layout, row-major.
std::vector<int64_t> values_of(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kLong).contiguous();
  const int64_t* p = c.const_data_ptr<int64_t>();
  return {p, p + c.numel()};
}

// dims [from, dim) of t are laid out contiguously (each row of them is one block of bytes).
bool rows_contiguous(const at::Tensor& t, int64_t from) {
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= from; --d) {
    if (t.size(d) != 1 && t.stride(d) != expected) return false;
    expected *= t.size(d);
  }
  return true;
}

int64_t numel_from(const at::Tensor& t, int64_t from) {
  int64_t n = 1;
  for (int64_t d = from; d < t.dim(); ++d) n *= t.size(d);
  return n;
}

// True when some value of `v` (negatives ignored) occurs twice.
bool has_duplicates(std::vector<int64_t> v) {
  v.erase(std::remove_if(v.begin(), v.end(), [](int64_t x) { return x < 0; }), v.end());
  std::sort(v.begin(), v.end());
  return std::adjacent_find(v.begin(), v.end()) != v.end();
}

RowPlan make_plan(const at::Tensor& src, at::Tensor& dst, int64_t chunks, int64_t chunk_bytes,
                  int64_t src_chunk_stride, int64_t dst_chunk_stride, bool ordered) {
  RowPlan plan;
  plan.src = static_cast<const char*>(src.const_data_ptr());
  plan.dst = static_cast<char*>(dst.data_ptr());
  plan.chunks = chunks;
  plan.chunk_bytes = chunk_bytes;
  plan.src_chunk_stride = src_chunk_stride;
  plan.dst_chunk_stride = dst_chunk_stride;
  plan.ordered = ordered;
  return plan;
}

void run(const char* op, const at::Tensor& dst, RowPlan& plan, const std::vector<int64_t>& src_off,
         const std::vector<int64_t>& dst_off) {
  plan.rows = static_cast<int64_t>(dst_off.size());
  plan.src_off = src_off.data();
  plan.dst_off = dst_off.data();
  if (plan.rows > 0) row_copy.get(op, dst)(plan);
}

// Runs `body` on `out` if its rows (dims from `from` on, and the last dim) are laid out as the
// plan needs, else on a contiguous copy that is copied back.
template <typename Body>
void with_row_layout(at::Tensor& out, int64_t from, Body&& body) {
  if (rows_contiguous(out, from)) {
    body(out);
    return;
  }
  at::Tensor tmp = out.contiguous();
  body(tmp);
  out.copy_(tmp);
}

// ----------------------------------------------------------------------------------------------
// npu_scatter_nd_update

void scatter_nd_into(const char* op, at::Tensor& self, const at::Tensor& indices,
                     const at::Tensor& updates) {
  check_index(op, "indices", indices);
  check_same_device(op, "indices", indices, "self", self);
  check_same_device(op, "updates", updates, "self", self);
  OPENNPU_CHECK_ARG(updates.scalar_type() == self.scalar_type(), op, "updates",
                    "must have the dtype of 'self' (", self.scalar_type(), "), but got ",
                    updates.scalar_type());
  OPENNPU_CHECK_ARG(indices.dim() >= 1 && indices.size(-1) >= 1 &&
                        indices.size(-1) <= self.dim(),
                    op, "indices",
                    "must have a last dim (the index depth) of 1 to self.dim() = ", self.dim(),
                    ", but got shape ", shape_str(indices.sizes()));
  OPENNPU_CHECK_STRICT(indices.dim() >= 2, op, "indices", "must have at least 2 dims, but got ",
                       indices.dim());
  OPENNPU_CHECK_STRICT(self.dim() <= 8, op, "self", "must have 1 to 8 dims, but got ", self.dim());
  const int64_t depth = indices.size(-1);
  std::vector<int64_t> expected(indices.sizes().begin(), indices.sizes().end() - 1);
  expected.insert(expected.end(), self.sizes().begin() + depth, self.sizes().end());
  OPENNPU_CHECK_ARG(updates.sizes().equals(expected), op, "updates",
                    "must have shape indices.shape[:-1] + self.shape[", depth, ":] = ",
                    shape_str(expected), ", but got ", shape_str(updates.sizes()));

  const int64_t rows = indices.numel() / depth;
  const int64_t slice = numel_from(self, depth);
  if (rows == 0 || slice == 0) return;
  const std::vector<int64_t> idx = values_of(indices);
  std::vector<int64_t> linear(rows);
  for (int64_t r = 0; r < rows; ++r) {
    int64_t l = 0;
    for (int64_t k = 0; k < depth; ++k) {
      const int64_t i = idx[r * depth + k];
      OPENNPU_CHECK_ARG(i >= 0 && i < self.size(k), op, "indices",
                        "must hold indices into 'self' (dim ", k, " of size ", self.size(k),
                        "), but row ", r, " has ", i);
      l = l * self.size(k) + i;
    }
    linear[r] = l;
  }
  const bool ordered = has_duplicates(linear);  // repeated indices: the last update wins
  const at::Tensor src = updates.contiguous();
  with_row_layout(self, 0, [&](at::Tensor& dst) {
    const int64_t es = dst.element_size();
    std::vector<int64_t> src_off(rows), dst_off(rows);
    for (int64_t r = 0; r < rows; ++r) {
      src_off[r] = r * slice * es;
      dst_off[r] = linear[r] * slice * es;
    }
    RowPlan plan = make_plan(src, dst, 1, slice * es, 0, 0, ordered);
    run(op, dst, plan, src_off, dst_off);
  });
}

at::Tensor& npu_scatter_nd_update_(at::Tensor& self, const at::Tensor& indices,
                                   const at::Tensor& updates) {
  scatter_nd_into("npu_scatter_nd_update_", self, indices, updates);
  return self;
}

at::Tensor npu_scatter_nd_update(const at::Tensor& self, const at::Tensor& indices,
                                 const at::Tensor& updates) {
  at::Tensor out = self.clone(at::MemoryFormat::Contiguous);
  scatter_nd_into("npu_scatter_nd_update", out, indices, updates);
  return out;
}

// ----------------------------------------------------------------------------------------------
// Paged KV cache: cache_mode 'Norm' keeps a token's row whole in [num_blocks, block_size, ...]
// (vLLM's layout); 'PA_NZ' splits it into chunks of last_dim elements, chunk c at
// cache[block, c, offset, :] of a [num_blocks, H / last_dim, block_size, last_dim] cache.

enum class CacheLayout { kNorm, kNz };

CacheLayout parse_cache_mode(const char* op, const std::optional<c10::string_view>& mode) {
  if (!mode.has_value() || *mode == "Norm") return CacheLayout::kNorm;
  if (*mode == "PA_NZ") return CacheLayout::kNz;
  TORCH_CHECK(false, op, ": argument 'cache_mode' must be 'Norm', 'PA_NZ' or None, but got '",
              std::string(*mode), "'");
}

// Geometry of one cache tensor for tokens of H elements.
struct CacheGeometry {
  int64_t num_blocks, block_size;
  int64_t chunks, chunk_elems;
  int64_t block_stride, offset_stride, chunk_stride;  // elements
};

bool fits(const at::Tensor& cache, CacheLayout layout, int64_t h) {
  if (cache.dim() != 4) return false;
  return layout == CacheLayout::kNorm ? cache.size(2) * cache.size(3) == h
                                      : cache.size(1) * cache.size(3) == h;
}

CacheGeometry geometry(const at::Tensor& cache, CacheLayout layout) {
  if (layout == CacheLayout::kNorm) {
    return {cache.size(0), cache.size(1), 1, cache.size(2) * cache.size(3), cache.stride(0),
            cache.stride(1), 0};
  }
  return {cache.size(0), cache.size(2), cache.size(1), cache.size(3), cache.stride(0),
          cache.stride(2), cache.stride(1)};
}

void check_cache(const char* op, const char* name, const at::Tensor& cache, const char* tok_name,
                 const at::Tensor& tok, CacheLayout layout) {
  check_same_device(op, name, cache, tok_name, tok);
  OPENNPU_CHECK_ARG(cache.scalar_type() == tok.scalar_type(), op, name,
                    "must have the dtype of '", tok_name, "' (", tok.scalar_type(),
                    "), but got ", cache.scalar_type());
  const int64_t h = numel_from(tok, 1);
  OPENNPU_CHECK_ARG(fits(cache, layout, h), op, name,
                    layout == CacheLayout::kNorm
                        ? "must be a 4-D 'Norm' cache [num_blocks, block_size, a, b] with a * b = "
                        : "must be a 4-D 'PA_NZ' cache [num_blocks, a, block_size, b] with a * b = ",
                    h, " (the elements per token of '", tok_name, "' ", shape_str(tok.sizes()),
                    "), but got ", shape_str(cache.sizes()));
}

// Both caches fit their tokens and share their blocks; returns key_cache's geometry.
CacheGeometry check_cache_pair(const char* op, const at::Tensor& key_cache,
                               const at::Tensor& value_cache, const at::Tensor& key,
                               const at::Tensor& value, CacheLayout layout) {
  check_cache(op, "key_cache", key_cache, "key", key, layout);
  check_cache(op, "value_cache", value_cache, "value", value, layout);
  const CacheGeometry gk = geometry(key_cache, layout), gv = geometry(value_cache, layout);
  OPENNPU_CHECK_ARG(gk.num_blocks == gv.num_blocks && gk.block_size == gv.block_size, op,
                    "value_cache", "must have the blocks of 'key_cache' ",
                    shape_str(key_cache.sizes()), ", but got ", shape_str(value_cache.sizes()));
  return gk;
}

// slot_mapping's values, each below the cache's capacity (negative: skip the token).
std::vector<int64_t> checked_slots(const char* op, const at::Tensor& slot_mapping,
                                   const CacheGeometry& g) {
  const std::vector<int64_t> slots = values_of(slot_mapping);
  const int64_t capacity = g.num_blocks * g.block_size;
  for (size_t t = 0; t < slots.size(); ++t) {
    OPENNPU_CHECK_ARG(slots[t] < capacity, op, "slot_mapping",
                      "must hold slots in [0, num_blocks * block_size) = [0, ", capacity,
                      ") (negative: skip the token), but token ", t, " has ", slots[t]);
  }
  return slots;
}

// The layout of a cache's rows the plan needs: 'Norm' rows (dims 2, 3) contiguous, 'PA_NZ'
// chunks (dim 3) contiguous.
int64_t row_dims_from(CacheLayout layout) { return layout == CacheLayout::kNorm ? 2 : 3; }

void scatter_cache(const char* op, const at::Tensor& tok, at::Tensor& cache,
                   const std::vector<int64_t>& slots, bool ordered, CacheLayout layout) {
  const at::Tensor src = rows_contiguous(tok, 1) ? tok : tok.contiguous();
  with_row_layout(cache, row_dims_from(layout), [&](at::Tensor& dst) {
    const CacheGeometry g = geometry(dst, layout);
    const int64_t es = dst.element_size();
    std::vector<int64_t> src_off, dst_off;
    src_off.reserve(slots.size());
    dst_off.reserve(slots.size());
    for (size_t t = 0; t < slots.size(); ++t) {
      if (slots[t] < 0) continue;  // padding tokens
      const int64_t block = slots[t] / g.block_size, offset = slots[t] % g.block_size;
      src_off.push_back(static_cast<int64_t>(t) * src.stride(0) * es);
      dst_off.push_back((block * g.block_stride + offset * g.offset_stride) * es);
    }
    RowPlan plan = make_plan(src, dst, g.chunks, g.chunk_elems * es, g.chunk_elems * es,
                             g.chunk_stride * es, ordered);
    run(op, dst, plan, src_off, dst_off);
  });
}

void scatter_pa_kv_cache_into(const char* op, const at::Tensor& key, const at::Tensor& value,
                              at::Tensor& key_cache, at::Tensor& value_cache,
                              const at::Tensor& slot_mapping,
                              const std::optional<at::Tensor>& compress_lens,
                              const std::optional<at::Tensor>& compress_seq_offsets,
                              const std::optional<at::Tensor>& seq_lens,
                              const std::optional<c10::string_view>& cache_mode) {
  const CacheLayout layout = parse_cache_mode(op, cache_mode);
  for (const auto& [name, t] : {std::pair<const char*, const std::optional<at::Tensor>&>{
                                    "compress_lens", compress_lens},
                                {"compress_seq_offsets", compress_seq_offsets},
                                {"seq_lens", seq_lens}}) {
    TORCH_CHECK(!t.has_value() || !t->defined(), op, ": argument '", name,
                "' (the compression scenario: 4-D key and value) is not implemented by opennpu; "
                "pass None");
  }
  OPENNPU_CHECK_ARG(key.dim() == 3, op, "key",
                    "must be 3-D [tokens, num_heads, head_size] (4-D key is the compression "
                    "scenario, not implemented by opennpu), but got shape ",
                    shape_str(key.sizes()));
  OPENNPU_CHECK_ARG(value.dim() == 3 && value.size(0) == key.size(0) &&
                        value.size(1) == key.size(1),
                    op, "value", "must be 3-D [tokens, num_heads, head_size] with the tokens and "
                    "heads of 'key' ", shape_str(key.sizes()), ", but got shape ",
                    shape_str(value.sizes()));
  check_same_device(op, "value", value, "key", key);
  check_index(op, "slot_mapping", slot_mapping);
  check_same_device(op, "slot_mapping", slot_mapping, "key", key);
  OPENNPU_CHECK_ARG(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0), op,
                    "slot_mapping", "must be 1-D with one slot per token (", key.size(0),
                    "), but got shape ", shape_str(slot_mapping.sizes()));
  const CacheGeometry gk = check_cache_pair(op, key_cache, value_cache, key, value, layout);
  OPENNPU_CHECK_STRICT(key.scalar_type() == value.scalar_type(), op, "value",
                       "must have the dtype of 'key' (", key.scalar_type(), "), but got ",
                       value.scalar_type());

  const std::vector<int64_t> slots = checked_slots(op, slot_mapping, gk);
  const bool ordered = has_duplicates(slots);  // repeated slots: the last token wins
  if (key.numel() > 0) scatter_cache(op, key, key_cache, slots, ordered, layout);
  if (value.numel() > 0) scatter_cache(op, value, value_cache, slots, ordered, layout);
}

void npu_scatter_pa_kv_cache(const at::Tensor& key, const at::Tensor& value,
                             at::Tensor& key_cache, at::Tensor& value_cache,
                             const at::Tensor& slot_mapping,
                             const std::optional<at::Tensor>& compress_lens,
                             const std::optional<at::Tensor>& compress_seq_offsets,
                             const std::optional<at::Tensor>& seq_lens,
                             std::optional<c10::string_view> cache_mode) {
  scatter_pa_kv_cache_into("npu_scatter_pa_kv_cache", key, value, key_cache, value_cache,
                           slot_mapping, compress_lens, compress_seq_offsets, seq_lens, cache_mode);
}

std::tuple<at::Tensor, at::Tensor> npu_scatter_pa_kv_cache_functional(
    const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
    const at::Tensor& value_cache, const at::Tensor& slot_mapping,
    const std::optional<at::Tensor>& compress_lens,
    const std::optional<at::Tensor>& compress_seq_offsets,
    const std::optional<at::Tensor>& seq_lens, std::optional<c10::string_view> cache_mode) {
  at::Tensor k = key_cache.clone(at::MemoryFormat::Contiguous);
  at::Tensor v = value_cache.clone(at::MemoryFormat::Contiguous);
  scatter_pa_kv_cache_into("npu_scatter_pa_kv_cache_functional", key, value, k, v, slot_mapping,
                           compress_lens, compress_seq_offsets, seq_lens, cache_mode);
  return {k, v};
}

// ----------------------------------------------------------------------------------------------
// npu_gather_pa_kv_cache: the tokens of each sequence, in order, out of its blocks.

CacheLayout gather_layout(const char* op, const at::Tensor& key_cache, const at::Tensor& key) {
  const int64_t h = numel_from(key, 1);
  const bool norm = fits(key_cache, CacheLayout::kNorm, h);
  const bool nz = fits(key_cache, CacheLayout::kNz, h);
  OPENNPU_CHECK_ARG(norm || nz, op, "key_cache",
                    "must be a 4-D cache [num_blocks, block_size, a, b] ('Norm') or "
                    "[num_blocks, a, block_size, b] ('PA_NZ') with a * b = ",
                    h, " (the elements per token of 'key' ", shape_str(key.sizes()),
                    "), but got ", shape_str(key_cache.sizes()));
  return norm ? CacheLayout::kNorm : CacheLayout::kNz;  // both fit: 'Norm'
}

void gather_cache(const char* op, const at::Tensor& cache, at::Tensor& out,
                  const std::vector<int64_t>& blocks, const std::vector<int64_t>& offsets,
                  CacheLayout layout) {
  const CacheGeometry g = geometry(cache, layout);
  const at::Tensor src = rows_contiguous(cache, row_dims_from(layout)) ? cache : cache.contiguous();
  const CacheGeometry gs = geometry(src, layout);
  with_row_layout(out, 1, [&](at::Tensor& dst) {
    const int64_t es = dst.element_size();
    std::vector<int64_t> src_off(blocks.size()), dst_off(blocks.size());
    for (size_t t = 0; t < blocks.size(); ++t) {
      src_off[t] = blocks[t] < 0 ? -1
                                 : (blocks[t] * gs.block_stride + offsets[t] * gs.offset_stride) * es;
      dst_off[t] = static_cast<int64_t>(t) * dst.stride(0) * es;
    }
    RowPlan plan = make_plan(src, dst, g.chunks, g.chunk_elems * es, gs.chunk_stride * es,
                             g.chunk_elems * es, false);
    run(op, dst, plan, src_off, dst_off);
  });
}

void gather_pa_kv_cache_into(const char* op, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, at::Tensor& key, at::Tensor& value,
                             const std::optional<at::Tensor>& seq_offset,
                             bool is_seq_lens_cumsum) {
  OPENNPU_CHECK_ARG(key.dim() >= 2, op, "key", "must have at least 2 dims [tokens, ...], but got ",
                    shape_str(key.sizes()));
  OPENNPU_CHECK_ARG(value.dim() >= 2 && value.size(0) == key.size(0), op, "value",
                    "must have the tokens of 'key' (", key.size(0), ") in dim 0, but got shape ",
                    shape_str(value.sizes()));
  check_same_device(op, "value", value, "key", key);
  const CacheLayout layout = gather_layout(op, key_cache, key);
  const CacheGeometry gk = check_cache_pair(op, key_cache, value_cache, key, value, layout);
  check_index(op, "block_tables", block_tables);
  check_index(op, "seq_lens", seq_lens);
  check_same_device(op, "block_tables", block_tables, "key", key);
  check_same_device(op, "seq_lens", seq_lens, "key", key);
  OPENNPU_CHECK_ARG(seq_lens.dim() == 1 && (!is_seq_lens_cumsum || seq_lens.size(0) >= 1), op,
                    "seq_lens", "must be 1-D (", is_seq_lens_cumsum ? "batch + 1 cumulative ends"
                                                                   : "one length per sequence",
                    "), but got shape ", shape_str(seq_lens.sizes()));
  const int64_t batch = is_seq_lens_cumsum ? seq_lens.size(0) - 1 : seq_lens.size(0);
  OPENNPU_CHECK_ARG(block_tables.dim() == 2 && block_tables.size(0) == batch, op, "block_tables",
                    "must be 2-D [batch, max_blocks] with batch = ", batch,
                    ", but got shape ", shape_str(block_tables.sizes()));
  std::vector<int64_t> offsets_in;
  if (seq_offset.has_value() && seq_offset->defined()) {
    check_index(op, "seq_offset", *seq_offset);
    check_same_device(op, "seq_offset", *seq_offset, "key", key);
    OPENNPU_CHECK_ARG(seq_offset->dim() == 1 && seq_offset->size(0) == batch, op, "seq_offset",
                      "must be 1-D with one offset per sequence (", batch, "), but got shape ",
                      shape_str(seq_offset->sizes()));
    offsets_in = values_of(*seq_offset);
  }
  const std::vector<int64_t> lens_in = values_of(seq_lens);
  const std::vector<int64_t> table = values_of(block_tables);
  const int64_t max_blocks = block_tables.size(1);
  const int64_t tokens = key.size(0);

  // Output row t <- (block, offset), block -1 = zeros: a table entry past the table's end or
  // outside [0, num_blocks). Rows past the sum of the lengths are left as they are.
  std::vector<int64_t> blocks, offs;
  for (int64_t i = 0; i < batch && static_cast<int64_t>(blocks.size()) < tokens; ++i) {
    const int64_t len = is_seq_lens_cumsum ? lens_in[i + 1] - lens_in[i] : lens_in[i];
    OPENNPU_CHECK_ARG(len >= 0, op, "seq_lens",
                      is_seq_lens_cumsum ? "must be non-decreasing (cumulative ends)"
                                         : "must hold lengths >= 0",
                      ", but sequence ", i, " has length ", len);
    int64_t start = 0;
    if (!offsets_in.empty()) {
      OPENNPU_CHECK_ARG(offsets_in[i] >= 0, op, "seq_offset", "must hold offsets >= 0, but ",
                        "sequence ", i, " has ", offsets_in[i]);
      start = offsets_in[i] / gk.block_size;
    }
    for (int64_t j = 0; j < len && static_cast<int64_t>(blocks.size()) < tokens; ++j) {
      const int64_t slot = start + j / gk.block_size;
      const int64_t b = slot < max_blocks ? table[i * max_blocks + slot] : -1;
      blocks.push_back(b >= 0 && b < gk.num_blocks ? b : -1);
      offs.push_back(j % gk.block_size);
    }
  }
  if (numel_from(key, 1) > 0) gather_cache(op, key_cache, key, blocks, offs, layout);
  if (numel_from(value, 1) > 0) gather_cache(op, value_cache, value, blocks, offs, layout);
}

void npu_gather_pa_kv_cache(const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            at::Tensor& key, at::Tensor& value,
                            const std::optional<at::Tensor>& seq_offset,
                            bool is_seq_lens_cumsum) {
  gather_pa_kv_cache_into("npu_gather_pa_kv_cache", key_cache, value_cache, block_tables,
                          seq_lens, key, value, seq_offset, is_seq_lens_cumsum);
}

std::tuple<at::Tensor, at::Tensor> npu_gather_pa_kv_cache_functional(
    const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_tables,
    const at::Tensor& seq_lens, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& seq_offset, bool is_seq_lens_cumsum) {
  at::Tensor k = key.clone(at::MemoryFormat::Contiguous);
  at::Tensor v = value.clone(at::MemoryFormat::Contiguous);
  gather_pa_kv_cache_into("npu_gather_pa_kv_cache_functional", key_cache, value_cache,
                          block_tables, seq_lens, k, v, seq_offset, is_seq_lens_cumsum);
  return {k, v};
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// Shared with the ATB ops (ops/atb/atb.cpp): the same plans under the caller's name.

void scatter_tokens(const char* op, const char* tok_name, const at::Tensor& tok,
                    const char* cache_name, at::Tensor& cache, const at::Tensor& slot_mapping) {
  OPENNPU_CHECK_ARG(tok.dim() >= 2, op, tok_name, "must have at least 2 dims [tokens, ...], but got ",
                    "shape ", shape_str(tok.sizes()));
  check_index(op, "slot_mapping", slot_mapping);
  check_same_device(op, "slot_mapping", slot_mapping, tok_name, tok);
  OPENNPU_CHECK_ARG(slot_mapping.dim() == 1 && slot_mapping.size(0) == tok.size(0), op,
                    "slot_mapping", "must be 1-D with one slot per token (", tok.size(0),
                    "), but got shape ", shape_str(slot_mapping.sizes()));
  const CacheLayout layout = gather_layout(op, cache, tok);  // 'Norm' where both fit
  check_cache(op, cache_name, cache, tok_name, tok, layout);
  const CacheGeometry g = geometry(cache, layout);
  const std::vector<int64_t> slots = checked_slots(op, slot_mapping, g);
  if (tok.numel() > 0) scatter_cache(op, tok, cache, slots, has_duplicates(slots), layout);
}

void gather_tokens(const char* op, const at::Tensor& key_cache, const at::Tensor& value_cache,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& key,
                   at::Tensor& value, const std::optional<at::Tensor>& seq_offset,
                   bool is_seq_lens_cumsum) {
  gather_pa_kv_cache_into(op, key_cache, value_cache, block_tables, seq_lens, key, value,
                          seq_offset, is_seq_lens_cumsum);
}

TORCH_LIBRARY_IMPL(npu, CPU, m) {
  m.impl("npu_scatter_nd_update", &npu_scatter_nd_update);
  m.impl("npu_scatter_nd_update_", &npu_scatter_nd_update_);
  m.impl("npu_scatter_pa_kv_cache", &npu_scatter_pa_kv_cache);
  m.impl("npu_scatter_pa_kv_cache_functional", &npu_scatter_pa_kv_cache_functional);
  m.impl("npu_gather_pa_kv_cache", &npu_gather_pa_kv_cache);
  m.impl("npu_gather_pa_kv_cache_functional", &npu_gather_pa_kv_cache_functional);
}

}  // namespace opennpu::kvcache
