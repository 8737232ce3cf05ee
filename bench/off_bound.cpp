// The cost of the cpu backend's off-mode bound (csrc/kvwrite/locs.h, KVWRITE_OFF_BOUND): the
// store_kv token loop of the CPU kernels (one thread), MHA Llama-3.1-8B layer (8 x 128 bf16),
// built twice by bench/off_bound.py, with and without the bound. Prints "N median_us" lines.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include "kvwrite/store_kv.h"

using namespace kvwrite;

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 50;
  const int H = 8, D = 128, PPS = 16;
  for (int ai = 2; ai < argc; ++ai) {
    const i64 n = std::atoll(argv[ai]);
    const i64 pages = 2 * ((n + PPS - 1) / PPS) + 1;
    std::vector<uint16_t> k(n * H * D), v(n * H * D), kc(pages * PPS * H * D), vc(pages * PPS * H * D);
    std::mt19937_64 rng(0);
    for (auto& x : k) x = uint16_t(rng());
    for (auto& x : v) x = uint16_t(rng());
    std::vector<i64> page_ids(pages - 1);
    std::iota(page_ids.begin(), page_ids.end(), 1);  // page 0 reserved for padding
    std::shuffle(page_ids.begin(), page_ids.end(), rng);
    std::vector<int64_t> loc(n);
    for (i64 i = 0; i < n; ++i) loc[i] = page_ids[i / PPS] * PPS + i % PPS;
    StoreKVParams p;
    p.H = H;
    p.in_dtype = p.cache_dtype = DType::BF16;
    for (auto [side, src, cache] : {std::make_tuple(&p.k, k.data(), kc.data()), std::make_tuple(&p.v, v.data(), vc.data())}) {
      side->src = reinterpret_cast<const char*>(src);
      side->s_tok = H * D;
      side->s_head = D;
      side->D = D;
      side->cache.base = reinterpret_cast<char*>(cache);
      side->cache.stride_page = PPS * H * D;
      side->cache.stride_entry = H * D;
      side->cache.stride_head = D;
      side->cache.pool_page_size = PPS;
      side->cache.elem_size = 2;
    }
    p.locs.loc = loc.data();
    p.locs.loc64 = true;
    p.locs.capacity = pages * PPS;
    p.locs.pool_page_size = PPS;
    p.locs.n = n;
    std::vector<double> us;
    dispatch_store_kv(p, CHECK_OFF, [&](auto token, i64) {
      using Token = typename decltype(token)::type;
      for (int r = 0; r < reps + 5; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        for (i64 i = 0; i < n; ++i) Token{}(p, i, 0, 1);
        const auto t1 = std::chrono::steady_clock::now();
        if (r >= 5) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      }
    });
    std::nth_element(us.begin(), us.begin() + us.size() / 2, us.end());
    std::printf("%lld %.2f %u\n", (long long)n, us[us.size() / 2], unsigned(kc[PPS * H * D] ^ vc[PPS * H * D]));
  }
  return 0;
}
