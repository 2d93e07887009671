// CPU kernel of the KV-cache family (compiled once per ISA; see common/cpu_dispatch.h): executes
// a RowPlan (kvcache.h). Pure data movement: each chunk is one memcpy (libc picks the widest
// vector moves of this CPU; small plans of 16-128-byte chunks go chunk column by chunk column,
// copy_tile), rows are spread over threads in blocks of about 32 KiB so that a
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

// Rows [r0, r1) of a plan of several kBytes chunks a row, chunk by chunk: chunk c of every row,
// then chunk c + 1 (fixed-size copies, inlined as vector moves). A 'PA_NZ' row's chunks lie a
// block-row apart (often a multiple of 4 KiB: all in one L1 set), while chunk c of consecutive
// tokens of a block are neighbours, so this order writes each chunk column sequentially. Two rows
// of a plan write either the same bytes or disjoint ones (repeated slots), so every destination
// byte is still written in row order: the last token wins, as in copy_row.
template <int64_t kBytes>
void copy_tile(const RowPlan& p, int64_t r0, int64_t r1) {
  for (int64_t c = 0; c < p.chunks; ++c) {
    for (int64_t r = r0; r < r1; ++r) {
      char* dst = p.dst + p.dst_off[r] + c * p.dst_chunk_stride;
      const int64_t so = p.src_off[r];
      if (so < 0) {
        std::memset(dst, 0, kBytes);
      } else {
        std::memcpy(dst, p.src + so + c * p.src_chunk_stride, kBytes);
      }
    }
  }
}

constexpr int64_t kTileRows = 16;
// Plans up to this many bytes go tile by tile, larger ones row by row: the tile order is the
// faster where the rows stay in cache (a decode step's few tokens), the row order once they
// stream from memory (a long prefill).
constexpr int64_t kTileMaxBytes = int64_t{2} << 20;

using CopyTileFn = void (*)(const RowPlan&, int64_t, int64_t);

// The tile copy for p, or null where p goes row by row.
CopyTileFn tile_copier(const RowPlan& p) {
  if (p.chunks == 1 || p.rows * p.chunks * p.chunk_bytes > kTileMaxBytes) return nullptr;
  switch (p.chunk_bytes) {
    case 16: return &copy_tile<16>;
    case 32: return &copy_tile<32>;
    case 64: return &copy_tile<64>;
    case 128: return &copy_tile<128>;
    default: return nullptr;
  }
}

void copy_rows(const RowPlan& p) {
  if (p.rows == 0 || p.chunks == 0 || p.chunk_bytes == 0) return;
  const CopyTileFn copy_tile = tile_copier(p);
  if (p.ordered) {
    if (copy_tile != nullptr) {
      for (int64_t r = 0; r < p.rows; r += kTileRows) {
        copy_tile(p, r, std::min(p.rows, r + kTileRows));
      }
      return;
    }
    for (int64_t r = 0; r < p.rows; ++r) copy_row(p, r);
    return;
  }
  const int64_t row_bytes = p.chunks * p.chunk_bytes;
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / std::max<int64_t>(row_bytes, 1));
  at::parallel_for(0, p.rows, grain, [&](int64_t begin, int64_t end) {
    if (copy_tile != nullptr) {
      for (int64_t r = begin; r < end; r += kTileRows) {
        copy_tile(p, r, std::min(end, r + kTileRows));
      }
      return;
    }
    for (int64_t r = begin; r < end; ++r) copy_row(p, r);
  });
}

}  // namespace

OPENNPU_REGISTER_CPU_SLOT(row_copy, &copy_rows);

}  // namespace CPU_CAPABILITY
}  // namespace opennpu::kvcache
