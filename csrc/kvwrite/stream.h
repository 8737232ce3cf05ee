// Host: pool rows written by streaming (non-temporal) stores. In a pool much larger than the cache
// (a serving engine's: gigabytes) the row a store writes is almost never cached, and a plain store
// first reads each of its lines in (read-for-ownership); a streaming store writes the whole line
// without that read. So a K/V store (ops.cpp STREAMS: store_kv's formats, NVFP4 K/V, the fused
// RoPE K/V stores) whose tensors (inputs and pools) take at least a quarter of the last-level cache
// writes every whole, aligned 64-byte line of its rows this way (store_line / store_half_line in the
// SIMD lanes, stream_copy for row copies), the partial lines at a row's ends plainly, no write
// prefetch; each chunk of tokens ends with an sfence (streaming stores are weakly ordered). A smaller
// call keeps its rows cached. The MLA rows and V4 records (a few hundred bytes, mostly not
// line-aligned, a request's tokens in consecutive rows) never stream: it measured even to 1.2x
// slower. KVWRITE_CPU_STREAM_BYTES (read once) sets the footprint from which calls stream (0: always,
// -1: never). Same bytes either way; figures: bench/results/cpu-quant/NOTES.md.
#pragma once

#include "common.h"

#if !defined(__CUDA_ARCH__)
#include <atomic>
#include <cstdio>
#include <cstdlib>

#if !defined(__CUDACC__) && defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KVW_STREAM_X86 1
#else
#define KVW_STREAM_X86 0
#endif

namespace kvwrite {

// The calls streaming now, process-wide (StreamScope): while one runs, every lane streams, so a call
// running beside it may stream some rows too (same bytes; its chunks end with the same sfence).
inline std::atomic<int> streaming_calls{0};

__attribute__((noinline, cold)) inline i64 stream_threshold_detect() {
  if (!KVW_STREAM_X86) return -1;
  if (const char* e = std::getenv("KVWRITE_CPU_STREAM_BYTES"); e != nullptr && *e) return std::atoll(e);
  i64 llc = i64(32) << 20;  // the last-level cache one core shares (sysfs), 32 MiB where unknown
  if (FILE* f = std::fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r")) {
    long long size = 0;
    char unit = 'K';
    if (std::fscanf(f, "%lld%c", &size, &unit) >= 1 && size > 0) llc = unit == 'M' ? size << 20 : size << 10;
    std::fclose(f);
  }
  return llc / 4;
}
// The footprint (bytes of a call's tensors) from which a call streams, -1: never; read once.
inline i64 stream_threshold() {
  static const i64 t = stream_threshold_detect();
  return t;
}

// Whether the lanes stream whole lines now: while a streaming call runs.
__attribute__((always_inline)) inline bool stream_rows() {
  return KVW_STREAM_X86 && streaming_calls.load(std::memory_order_relaxed) > 0;
}

// A call's streaming: on for its lifetime where its footprint reaches stream_threshold().
struct StreamScope {
  bool on;
  explicit StreamScope(i64 footprint) : on(stream_threshold() >= 0 && footprint >= stream_threshold()) {
    if (on) streaming_calls.fetch_add(1, std::memory_order_relaxed);
  }
  ~StreamScope() {
    if (on) streaming_calls.fetch_sub(1, std::memory_order_relaxed);
  }
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;
};

#if KVW_STREAM_X86
// The whole lines of [dst + j, dst + n) from j (dst + j aligned): one 64-byte streaming store each
// where the CPU has AVX-512, else four 16-byte ones. Returns the end of the last whole line.
__attribute__((target("avx512f"))) inline size_t stream_lines_512(char* dst, const char* src, size_t j, size_t n) {
  for (; j + 64 <= n; j += 64) _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + j), _mm512_loadu_si512(src + j));
  return j;
}
inline size_t stream_lines(char* dst, const char* src, size_t j, size_t n) {
  static const bool wide = __builtin_cpu_supports("avx512f");
  if (wide) return stream_lines_512(dst, src, j, n);
  for (; j + 64 <= n; j += 64)
    for (int q = 0; q < 4; ++q)
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + j) + q, _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j) + q));
  return j;
}
#endif

// n bytes from src to dst: the whole 64-byte lines inside [dst, dst + n) by streaming stores, the
// partial ones at either end by memcpy (all of it by memcpy where stream_rows() is off).
inline void stream_copy(char* dst, const char* src, size_t n) {
#if KVW_STREAM_X86
  if (stream_rows() && n >= 64) {
    size_t j = (64 - (reinterpret_cast<uintptr_t>(dst) & 63)) & 63;
    memcpy(dst, src, j);
    j = stream_lines(dst, src, j, n);
    memcpy(dst + j, src + j, n - j);
    return;
  }
#endif
  memcpy(dst, src, n);
}

// The end of a run of streaming stores: they are ordered before anything this thread does next
// (unconditional: the count may have dropped since they were issued; without pending ones it is cheap).
inline void stream_fence() {
#if KVW_STREAM_X86
  _mm_sfence();
#endif
}

}  // namespace kvwrite
#endif  // !__CUDA_ARCH__
