// Integer weight codes to fp32, shared by the CPU kernels of npu_quant_matmul (its exact fp32
// GEMMs on codes) and npu_grouped_matmul (its weight-only dequantisation): int8 codes, and int32
// words of eight int4 codes (lowest bits first, sign-extended), as npu_convert_weight_to_int4pack
// packs them. Kernel-only (compiled once per instruction set, in CPU_CAPABILITY).
//
// The loops are plain element loops on purpose: GCC vectorises them at -O3 for the ISA of the
// compilation (sign extension, conversion, |v|, max and sum in 8 / 16 lanes); they are bound by
// memory, not arithmetic.
#pragma once

#include <algorithm>
#include <cstdint>

namespace opennpu::quant {
inline namespace CPU_CAPABILITY {

// Code k (0..7) of an int4 word, sign-extended: bits [4k, 4k + 4).
inline int32_t nibble(int32_t word, int k) {
  return static_cast<int32_t>(static_cast<uint32_t>(word) << (28 - 4 * k)) >> 28;
}

// dst[0, len) = float(src[0, len)) (int8 codes); returns sum |code| and raises amax.
inline int64_t int8_to_float(const int8_t* src, float* dst, int64_t len, int32_t& amax) {
  constexpr int64_t kBlock = int64_t{1} << 16;  // 128 * 2^16 < 2^31: no int32 overflow
  int64_t l1 = 0;
  for (int64_t i0 = 0; i0 < len; i0 += kBlock) {
    const int64_t i1 = std::min(len, i0 + kBlock);
    int32_t block = 0, block_max = 0;
    for (int64_t i = i0; i < i1; ++i) {
      const int32_t v = src[i];
      const int32_t a = v < 0 ? -v : v;
      dst[i] = static_cast<float>(v);
      block_max = std::max(block_max, a);
      block += a;
    }
    amax = std::max(amax, block_max);
    l1 += block;
  }
  return l1;
}

// dst[0, 8 words) = the int4 codes of words[0, words) as floats; returns sum |code| and raises
// amax.
inline int64_t int4_to_float(const int32_t* src, float* dst, int64_t words, int32_t& amax) {
  constexpr int64_t kBlock = int64_t{1} << 24;  // 8 * 8 * 2^24 < 2^31
  int64_t l1 = 0;
  for (int64_t i0 = 0; i0 < words; i0 += kBlock) {
    const int64_t i1 = std::min(words, i0 + kBlock);
    int32_t block = 0, block_max = 0;
    for (int64_t i = i0; i < i1; ++i) {
      for (int k = 0; k < 8; ++k) {
        const int32_t v = nibble(src[i], k);
        const int32_t a = v < 0 ? -v : v;
        dst[8 * i + k] = static_cast<float>(v);
        block_max = std::max(block_max, a);
        block += a;
      }
    }
    amax = std::max(amax, block_max);
    l1 += block;
  }
  return l1;
}

// One row of `cols` codes as floats: int8 [cols], or int32 words [cols / 8] (int4).
inline void codes_row_to_float(const void* codes, bool int4, int64_t cols, float* dst) {
  int32_t amax = 0;  // unused here
  if (int4) {
    int4_to_float(static_cast<const int32_t*>(codes), dst, cols / 8, amax);
  } else {
    int8_to_float(static_cast<const int8_t*>(codes), dst, cols, amax);
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace opennpu::quant
