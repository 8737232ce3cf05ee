// The kvwrite_ext op library: its schemas (registry.h) and the CPU device policy (backend="cpu").
#include <ATen/Parallel.h>

#include <cstdlib>

#include "engines.h"  // api.h (torch, <sstream> ...), registry.h (host.h)

namespace kvwrite {

// Runs tokens [begin, end) of `p` in check mode C on this thread (tokens_cpu.h, generated units).
template <class P, int C>
void run_range(const P& p, i64 begin, i64 end);

namespace {

constexpr int64_t GRAIN = 64;  // tokens per parallel_for chunk

// kvwrite.facts.OPS (op code -> name), handed over when the extension loads (set_op_names).
std::vector<std::string> op_names;
std::string op_name(int op) {
  return op >= 0 && size_t(op) < op_names.size() ? op_names[op] : "op " + std::to_string(op);
}

i64 unpack(const i64* rec, int lo) {
  return i64((uint64_t(rec[lo + 1]) & 0xFFFFFFFFull) << 32 | (uint64_t(rec[lo]) & 0xFFFFFFFFull));
}

// An assert-mode scan's record: the caller's `errors` (kvwrite raises from it), else a local one.
struct Scan {
  i64 local[slot::NUM_SLOTS];
  i64* rec;
  i64 before;
  explicit Scan(i64* errors) : rec(errors != nullptr ? errors : local) {
    for (int s = 0; s < slot::NUM_SLOTS; ++s) local[s] = s == slot::COUNT ? 0 : EMPTY;
    before = rec[slot::COUNT];
  }
  i64 bad() const { return rec[slot::COUNT] - before; }
  // before any write, item(i) records item i if bad (one call: one epoch); true when one was
  template <class Item>
  bool scan(i64 n, Item&& item) {
    const i64 epoch = rec[slot::EPOCH];
    at::parallel_for(0, n, GRAIN, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) item(i);
    });
    rec[slot::EPOCH] = epoch + 1;
    return bad() != 0;
  }
};

// Assert mode on the CPU: every bad token (`resolve_i(i)`: token i's Resolved) recorded, a throw before any write.
template <class Resolve>
void assert_prescan(const LocArgs& a, Resolve&& resolve_i) {
  Scan s(a.errors);
  const i64* rec = s.rec;
  if (!s.scan(a.n, [&](i64 i) {
        const Resolved r = resolve_i(i);
        if (r.bad) record(s.rec, violation(a, i, r));
      }))
    return;
  const i64 token = rec[slot::META] >> 32, loc = unpack(rec, slot::LOC_LO);
  const i64 target = unpack(rec, slot::TARGET_LO), limit = unpack(rec, slot::LIMIT_LO);
  const int kind = int((rec[slot::META] & 0xFFFFFFFF) >> 8);
  std::ostringstream msg;
  msg << "kvwrite: store loc outside the pool (check=assert): " << op_name(a.op) << ": token " << token
      << " loc " << loc;
  if (kind == KIND_BATCH || kind == KIND_TABLE_SLOT || kind == KIND_TABLE_PAGE) {
    msg << " page table: kind " << kind << " index " << target << " outside its bound " << limit;
  } else if (kind == KIND_LOC_MAP) {
    msg << " is outside loc_map (length " << limit << ")";
  } else if (kind == KIND_POSITION) {
    msg << " has position " << target << ", outside the cos/sin cache [0, " << limit << ")";
  } else {
    msg << " (local " << target << ") page " << (target >= 0 ? target / a.pool_page_size : -1) << ", pool has "
        << limit / a.pool_page_size << " pages of " << a.pool_page_size << " rows (capacity " << limit << ")";
  }
  msg << "; " << s.bad() << " bad token(s)";
  TORCH_CHECK(false, msg.str());
}

// guard mode: the next call's epoch
void next_epoch(i64* errors, int64_t check) {
  if (check == CHECK_GUARD && errors != nullptr) errors[slot::EPOCH] += 1;
}

// Tokens per parallel_for chunk at `token_bytes` a token: one thread below 256 KiB a call (csrc/README.md).
int64_t grain_for(int64_t token_bytes) {
  static const int64_t bytes = [] {
    const char* e = std::getenv("KVWRITE_CPU_PARALLEL_BYTES");
    return e != nullptr && *e ? std::max<int64_t>(1, std::atoll(e)) : int64_t(256) << 10;
  }();
  const int64_t cost = std::max<int64_t>(1, token_bytes);
  return std::max<int64_t>(GRAIN, (bytes + cost - 1) / cost);
}

// The stores whose rows stream in a large call (stream.h): the K/V stores. The MLA rows and the V4
// records never do (even to 1.2x slower, bench/results/cpu-quant/NOTES.md).
template <class P>
constexpr bool STREAMS = std::is_same_v<P, StoreKVParams> || std::is_same_v<P, StoreKVQuantParams> ||
                         std::is_same_v<P, StoreKVNVFP4Params> || std::is_same_v<P, RopeStoreKVParams> ||
                         std::is_same_v<P, RopeStoreKVQuantParams>;

// One counter for every rope op and instantiation: the id keys rope_head_host's per-thread cos/sin
// row, so two calls (of any op) must never share one (a per-template counter did: stale rows).
std::atomic<uint64_t> rope_calls{0};

// The bench's floor: a plain per-row memcpy scatter, dst_j[loc[i]] = src_j[i] for each pair
// (rows contiguous, int64 loc in range: no checks beyond shapes), same threading policy; `stream`:
// the rows' whole lines by streaming stores (stream_copy, as a large call's stores write them).
void bench_memcpy_scatter(at::TensorList src, at::TensorList dst, const Tensor& loc, bool stream) {
  TORCH_CHECK(src.size() == dst.size() && loc.scalar_type() == at::kLong && loc.dim() == 1 && loc.is_contiguous(),
              "bench_memcpy_scatter: src/dst lists of equal length and a contiguous int64 loc");
  const int64_t n = loc.size(0);
  struct Pair {
    const char* s;
    char* d;
    int64_t row, d_stride, rows;
  };
  std::vector<Pair> pairs;
  int64_t bytes = 0;
  for (size_t j = 0; j < src.size(); ++j) {
    const Tensor &s = src[j], &d = dst[j];
    TORCH_CHECK(s.dim() >= 1 && s.size(0) == n && s.is_contiguous() && d.dim() >= 1,
                "bench_memcpy_scatter: src[", j, "] must be a contiguous [n, ...] tensor");
    const int64_t row = n > 0 ? s.numel() / n * s.element_size() : 0;
    TORCH_CHECK(d.stride(-1) == 1 && d.numel() / std::max<int64_t>(1, d.size(0)) * d.element_size() == row &&
                    (d.dim() == 1 || d[0].is_contiguous()),
                "bench_memcpy_scatter: dst[", j, "] rows must be contiguous and as wide as src rows");
    pairs.push_back({static_cast<const char*>(s.data_ptr()), static_cast<char*>(d.data_ptr()), row,
                     d.stride(0) * d.element_size(), d.size(0)});
    bytes += 2 * row;
  }
  const int64_t* l = loc.data_ptr<int64_t>();
  const StreamScope streaming(stream ? INT64_MAX : -1);
  at::parallel_for(0, n, grain_for(bytes), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      for (const Pair& q : pairs) {
        if (stream) stream_copy(q.d + l[i] * q.d_stride, q.s + i * q.row, size_t(q.row));
        else memcpy(q.d + l[i] * q.d_stride, q.s + i * q.row, size_t(q.row));
      }
    if (stream) stream_fence();
  });
}

// The threads a parallel region of `n` items runs on: torch's intra-op ones with OpenMP, else 1.
int64_t cpu_threads(int64_t n) {
  std::atomic<int64_t> seen{0};
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) { seen.fetch_or(int64_t(1) << (at::get_thread_num() & 63)); });
  return __builtin_popcountll(uint64_t(seen.load()));
}

// Page moves (kvwrite/pages.h), assert mode: the bad ids or locs recorded, a throw before any write.
[[noreturn]] void throw_assert(const char* op, const i64* rec, i64 count) {
  TORCH_CHECK(false, "kvwrite: store loc outside the pool (check=assert): ", op, ": item ", rec[slot::META] >> 32,
              " index ", unpack(rec, slot::TARGET_LO), " outside [0, ", unpack(rec, slot::LIMIT_LO), "); ", count,
              " bad item(s)");
}

// The CPU device policy of registry.h: a call's tokens on the host threads.
struct Cpu {
  static constexpr const char* NAME = "cpu";
  static constexpr c10::DeviceType TYPE = c10::DeviceType::CPU;

  // a call's tokens: the assert pre-scan, the chunks (run_range) in parallel above the threshold
  template <class P>
  static void run(P p, int64_t check, const Tensor&) {
    // the rope stores' copy unit from an aligned scratch row (dispatch reads its address; never read)
    if constexpr (HAS_SCRATCH<P>) p.scratch = reinterpret_cast<char*>(uintptr_t(64));
    const LocArgs& a = locs_of(p);
    if constexpr (ROPED<P>) p.rope.call = ++rope_calls;  // keys rope_head_host's cos/sin row to this call
    if (check == CHECK_ASSERT)
      assert_prescan(a, [&](i64 i) {
        if constexpr (ROPED<P>) {
          bool ok = false;
          const i64 pos = rope_position(p.rope, i, ok);
          return resolve_rope<CHECK_ASSERT>(a, p.rope, i, ok, pos);
        } else {
          return resolve<CHECK_ASSERT>(a, i);
        }
      });
    const StreamScope streaming(STREAMS<P> ? call_footprint : -1);  // a K/V store larger than the cache
    at::parallel_for(0, a.n, grain_for(token_bytes(p)), [&](int64_t b, int64_t e) {
      with_check(int(check), [&](auto c) { run_range<P, c.value>(p, b, e); });
    });
    next_epoch(a.errors, check);
  }

  // store_kv into a split head dim, plain copy: page by page, head by head (csrc/README.md); others per token
  static void run(StoreKVParams p, int64_t check, const Tensor& ref) {
    if ((!p.k.cache.split && !p.v.cache.split) || p.cache_dtype != p.in_dtype) return run<StoreKVParams>(p, check, ref);
    const LocArgs& a = p.locs;
    if (check == CHECK_ASSERT) assert_prescan(a, [&](i64 i) { return resolve<CHECK_ASSERT>(a, i); });
    thread_local std::vector<std::pair<i64, i64>> reused;  // (local row, token): N pairs
    auto& order = reused;  // this thread's vector, also in the lambdas the worker threads run
    order.clear();
    with_check(int(check), [&](auto c) {  // resolve (and record, guard) in token order as before
      for (i64 i = 0; i < a.n; ++i) {
        const Resolved r = resolve_checked<c.value>(a, i, true);
        if (r.write) order.emplace_back(r.row, i);
      }
    });
    // by row, then token: a page's tokens adjacent, a duplicated row's tokens in call order (the last wins)
    if (!std::is_sorted(order.begin(), order.end())) std::sort(order.begin(), order.end());
    const i64 n = i64(order.size()), pps = p.k.cache.pool_page_size;
    const auto page = [&](i64 j) { return page_of(order[size_t(j)].first, pps); };
    at::parallel_for(0, n, grain_for(token_bytes(p)), [&](int64_t b, int64_t e) {
      while (b > 0 && b < n && page(b) == page(b - 1)) ++b;  // a chunk owns the pages starting in it
      for (i64 g = b, end; g < e; g = end) {
        for (end = g + 1; end < n && page(end) == page(g); ++end) {}
        for (int h = 0; h < p.H; ++h) copy_page_head_host(p, h, order.data() + g, end - g);
      }
    });
    next_epoch(a.errors, check);
  }

  static void run(const CopyPagesParams& p, int64_t check, const Tensor&) {
    Scan s(p.errors);
    if (check == CHECK_ASSERT && s.scan(p.n, [&](i64 i) {
          const PairResolved r = resolve_pair<CHECK_ASSERT>(p, i);
          if (r.bad) record(s.rec, pair_violation(p, i, r));
        }))
      throw_assert(op_name(p.op).c_str(), s.rec, s.bad());
    with_check(int(check), [&](auto c) {
      at::parallel_for(0, p.n, grain_for(2 * p.unit_bytes()), [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          const PairResolved r = resolve_pair_checked<c.value>(p, i, true);
          if (r.write) copy_unit_host(p, p.src.unit_ptr(r.s, p.unit_rows), p.dst.unit_ptr(r.d, p.unit_rows));
        }
      });
    });
    next_epoch(p.errors, check);
  }

  static void run(SlotMappingParams p, int64_t check, const Tensor&) {
    Scan s(p.errors);
    const bool asserting = check == CHECK_ASSERT;
    if (asserting) p.errors = s.rec, check = CHECK_GUARD;  // run as guard into a record, then throw
    with_check(int(check), [&](auto c) {
      at::parallel_for(0, p.n, grain_for(64), [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) slot_token<c.value>(p, i);
      });
    });
    next_epoch(p.errors, check);
    if (asserting && s.bad() != 0) throw_assert(op_name(p.op).c_str(), s.rec, s.bad());
  }

  // The duplicate-row pre-pass (kvwrite/claims.h): guard's loc the store runs on; assert: empty, or a throw.
  static Tensor run(ClaimParams p, int64_t check, const Tensor& loc) {
    const i64 slots = claim_slots(p.a.n);
    thread_local std::vector<i64> keys, first;  // reused: no allocation per call once warm
    keys.assign(size_t(slots), FREE_ROW);
    first.resize(size_t(slots));
    p.keys = keys.data();
    p.mask = slots - 1;
    if (check == CHECK_GUARD) {
      i64 bad = 0;  // the usual call, no bad and no duplicate token: the store runs on its own loc
      if (claim_rows_host<CHECK_GUARD>(p, nullptr, first.data(), &bad) == 0 && bad == 0)
        return at::empty({0}, loc.options().dtype(at::kLong));
      keys.assign(size_t(slots), FREE_ROW);
      Tensor out = at::empty({p.a.n}, loc.options().dtype(at::kLong));
      p.out = out.data_ptr<int64_t>();
      claim_rows_host<CHECK_GUARD>(p, p.a.errors, first.data());
      return out;
    }
    if (claim_rows_host<CHECK_ASSERT>(p, nullptr, first.data()) == 0) return at::empty({0}, loc.options().dtype(at::kLong));
    Scan s(p.a.errors);
    keys.assign(size_t(slots), FREE_ROW);
    claim_rows_host<CHECK_ASSERT>(p, s.rec, first.data());
    TORCH_CHECK(false, "kvwrite: two tokens of one call write the same row (check=assert): ", op_name(p.a.op),
                ": token ", s.rec[slot::META] >> 32, " row ", unpack(s.rec, slot::TARGET_LO), "; ", s.bad(),
                " bad or duplicate token(s)");
  }
};

}  // namespace
}  // namespace kvwrite

TORCH_LIBRARY(kvwrite_ext, m) {
#define KVW_DEF(op, bind, schema) m.def(#op schema);
  KVW_OPS(KVW_DEF)
#undef KVW_DEF
  m.def("bench_memcpy_scatter(Tensor[] src, Tensor(a!)[] dst, Tensor loc, bool stream=False) -> ()");
  m.def("set_program(str name, str program) -> ()", &kvwrite::api::set_program);
  m.def("set_claims(bool on) -> ()", [](bool on) { kvwrite::api::claims_on = on; });
  m.def("cpu_threads(int n) -> int", &kvwrite::cpu_threads);
  m.def("cpu_stream_bytes() -> int", [] { return int64_t(kvwrite::stream_threshold()); });  // stream.h, -1: never
  m.def("set_op_names(str[] names) -> ()", [](std::vector<std::string> names) { kvwrite::op_names = std::move(names); });
  kvwrite::engines::define(m);
}

TORCH_LIBRARY_IMPL(kvwrite_ext, CPU, m) {
  kvwrite::engines::impl_device<kvwrite::Cpu>(m);
  m.impl("bench_memcpy_scatter", &kvwrite::bench_memcpy_scatter);
}

#ifdef KVWRITE_PYTHON_MODULE
// The ahead-of-time build (setup.py): the module kvwrite._C, whose import runs the registrations.
#include <Python.h>
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", "kvwrite C++/CUDA kernels (torch.ops.kvwrite_ext)", -1, nullptr};
  return PyModule_Create(&def);
}
#endif
