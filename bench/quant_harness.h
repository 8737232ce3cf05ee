// Helpers of the C++ store harnesses (bench/quant_bound.cpp, bench/quant_ab.cpp): the thread
// clock, bf16 rounding, and, included after the kvwrite headers (KVW_HD defined), a pool's
// PagedCache, the LocArgs of plain random locs and a check-off token loop over a body.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <random>
#include <vector>

namespace harness {

constexpr int PPS = 16;  // rows a page

inline double thread_us() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec * 1e6 + t.tv_nsec * 1e-3;
}

// bf16 bits of f, truncated (the harnesses' randn rows)
inline uint16_t bf16_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t(u >> 16);
}

// The cases' inputs: k and v, n rows of `elems` bf16 randn values each, and n random locs into a
// pool of `rows` = 4n + PPS rows (page 0 reserved, as kvwrite.bench.cases.random_locs).
struct Inputs {
  std::vector<uint16_t> k, v;
  std::vector<int64_t> loc;
  int64_t rows;
};
// outlier > 0: every 64th value times `outlier` (a tile with one large channel, as real K / V
// rows have: most of its codes then small, many e4m3 subnormals).
inline Inputs inputs(int64_t n, int64_t elems, float outlier = 0.0f) {
  std::mt19937_64 rng(0);
  std::normal_distribution<float> normal;
  Inputs in{std::vector<uint16_t>(n * elems), std::vector<uint16_t>(n * elems), std::vector<int64_t>(4 * n), 4 * n + PPS};
  for (auto* t : {&in.k, &in.v})
    for (size_t j = 0; j < t->size(); ++j) (*t)[j] = bf16_of(normal(rng) * (outlier > 0 && j % 64 == 0 ? outlier : 1.0f));
  for (int64_t i = 0; i < 4 * n; ++i) in.loc[i] = PPS + i;
  std::shuffle(in.loc.begin(), in.loc.end(), rng);
  in.loc.resize(n);
  return in;
}

#ifdef KVW_HD
// A pool of rows of `row` bytes back to back (page-major [pages, PPS, ...] rows are), heads of
// `head_elems` elements of `elem_size` bytes.
inline kvwrite::PagedCache cache_of(char* pool, int64_t row, int64_t head_elems, int elem_size) {
  kvwrite::PagedCache c;
  c.base = pool;
  c.stride_entry = row / elem_size;
  c.stride_page = PPS * c.stride_entry;
  c.stride_head = head_elems;
  c.pool_page_size = PPS;
  c.elem_size = elem_size;
  return c;
}

inline kvwrite::LocArgs loc_args(const int64_t* loc, int64_t n, int64_t rows) {
  kvwrite::LocArgs a;
  a.loc = loc;
  a.loc64 = true;
  a.capacity = rows;
  a.pool_page_size = PPS;
  a.n = n;
  return a;
}

// Every token of p through the body `dispatch` picks, check off, one lane.
template <class P, class Dispatch>
void run_tokens(const P& p, Dispatch&& dispatch) {
  dispatch(p, kvwrite::CHECK_OFF, [&](auto token, kvwrite::i64) {
    using Token = typename decltype(token)::type;
    for (kvwrite::i64 i = 0; i < p.locs.n; ++i) Token{}(p, i, 0, 1);
  });
}
#endif

}  // namespace harness
