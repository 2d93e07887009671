// CPU kernel of the KV-cache family (compiled once per ISA; see common/cpu_dispatch.h): executes
// a RowPlan (kvcache.h). Pure data movement: each chunk is one memcpy (libc picks the widest
// vector moves of this CPU), rows are spread over threads in blocks of about 32 KiB so that a
// decode step's few tokens still run on one thread without the cost of waking the others.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "ops/kvcache/kvcache.h"

namespace opennpu::kvcache {
inline namespace CPU_CAPABILITY {
namespace {

constexpr int64_t kGrainBytes = 32 << 10;

void copy_row(const RowPlan& p, int64_t r) {
  char* dst = p.dst + p.dst_off[r];
  const int64_t so = p.src_off[r];
  if (so < 0) {
    for (int64_t c = 0; c < p.chunks; ++c) std::memset(dst + c * p.dst_chunk_stride, 0, p.chunk_bytes);
    return;
  }
  const char* src = p.src + so;
  for (int64_t c = 0; c < p.chunks; ++c) {
    std::memcpy(dst + c * p.dst_chunk_stride, src + c * p.src_chunk_stride, p.chunk_bytes);
  }
}

void copy_rows(const RowPlan& p) {
  if (p.rows == 0 || p.chunks == 0 || p.chunk_bytes == 0) return;
  if (p.ordered) {
    for (int64_t r = 0; r < p.rows; ++r) copy_row(p, r);
    return;
  }
  const int64_t row_bytes = p.chunks * p.chunk_bytes;
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / std::max<int64_t>(row_bytes, 1));
  at::parallel_for(0, p.rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) copy_row(p, r);
  });
}

}  // namespace

OPENNPU_REGISTER_CPU_SLOT(row_copy, &copy_rows);

}  // namespace CPU_CAPABILITY
}  // namespace opennpu::kvcache
