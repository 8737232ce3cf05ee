// The vLLM plugin's cache operators on kvwrite's store_kv kernels without a Python frame
// (csrc/README.md): an EngineRoute runs vLLM's common call, any other goes to its Python writer.
#pragma once

#include <c10/core/DispatchKey.h>

#include <functional>
#include <map>

#include "api.h"  // torch, the dispatcher, <atomic>, <mutex> ...

namespace kvwrite {
namespace engines {

// One device's raw store_kv on ready params (the route checked the call) and duplicate-row pre-pass.
struct Runner {
  void (*store_kv)(const StoreKVParams&, int64_t check, const at::Tensor& ref) = nullptr;  // ref: the key
  decltype(&reg::claim_rows<void>) claim_rows = nullptr;  // (one signature for every device)
};

inline Runner& runner(c10::DeviceType d) {
  static Runner cpu, cuda, none;
  return d == c10::DeviceType::CPU ? cpu : d == c10::DeviceType::CUDA ? cuda : none;
}

constexpr int ANY_DEVICE = -1, NO_DEVICE = -2;
struct EngineRoute;

// The plugin's state: check mode, backend, routes by handle, and (guard mode) each registered cache's
// record row by data_ptr and shape, cleared whenever the guard registers caches or grows its records.
struct State {
  std::atomic<int> check{CHECK_OFF};
  std::atomic<int> device{ANY_DEVICE};  // the device type the fast path runs on (backend "auto": any)
  std::mutex mu;
  std::unordered_map<const void*, std::pair<std::vector<int64_t>, at::Tensor>> rows;
  std::map<int64_t, std::pair<std::unique_ptr<torch::Library>, const EngineRoute*>> routes;
  int64_t next = 0;
};

inline State state;  // used at run time only

template <class F>
auto locked(F&& f) {
  std::lock_guard<std::mutex> lock(state.mu);
  return f(state);
}

// One cache of the engine as the kernel sees it: pages x rows x heads x feat strides (elements).
struct CacheView {
  int64_t pages, rows, heads, feat;
  PagedCache paged;
};

// [P, S, H, D] with any strides, last dim dense (vLLM's flash layout, and the value cache of its CPU
// attention as a transposed [P, H, S, D]).
inline CacheView psh(const at::Tensor& c, int d_page, int d_row, int d_head) {
  return {c.size(d_page), c.size(d_row), c.size(d_head), c.size(3), paged_dims(c, d_page, d_row, d_head)};
}

// The common call of a vLLM K/V writer (csrc/README.md).
inline bool common_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kc, const at::Tensor& vc,
                      const CacheView& k, const CacheView& v, const at::Tensor& slots) {
  const auto dt = key.scalar_type();
  if (dt != at::kBFloat16 && dt != at::kHalf && dt != at::kFloat) return false;
  if (value.scalar_type() != dt || kc.scalar_type() != dt || vc.scalar_type() != dt) return false;
  if (key.dim() != 3 || value.dim() != 3 || slots.dim() != 1 || slots.scalar_type() != at::kLong) return false;
  const auto dev = key.device();
  if (value.device() != dev || kc.device() != dev || vc.device() != dev || slots.device() != dev) return false;
  const int64_t n = key.size(0);
  if (value.size(0) != n || slots.size(0) != n || n > api::MAX_TOKENS) return false;
  if (key.stride(2) != 1 || value.stride(2) != 1 || (n > 1 && slots.stride(0) != 1)) return false;
  return k.heads == key.size(1) && k.feat == key.size(2) && v.heads == value.size(1) && v.feat == value.size(2) &&
         k.pages == v.pages && k.rows == v.rows;
}

// Run store_kv of the call's (key, value, key_cache, value_cache, slots) `a`; false: Python runs it.
inline bool store(const c10::IValue* a, const CacheView& k, const CacheView& v) {
  const at::Tensor &key = a[0].toTensor(), &value = a[1].toTensor(), &kc = a[2].toTensor(), &vc = a[3].toTensor();
  const at::Tensor& slots = a[4].toTensor();
  const int want = state.device.load(std::memory_order_relaxed);
  if (want != ANY_DEVICE && want != int(key.device().type())) return false;
  const Runner& r = runner(key.device().type());
  if (!r.store_kv || !common_kv(key, value, kc, vc, k, v, slots)) return false;
  const int check = state.check.load(std::memory_order_relaxed);
  OptTensor errors;  // guard mode: the key cache's registered record row
  if (check == CHECK_GUARD) {
    locked([&](State& s) {
      auto it = s.rows.find(kc.data_ptr());
      if (it != s.rows.end() && c10::IntArrayRef(it->second.first) == kc.sizes()) errors = it->second.second;
    });
    if (!errors) return false;
  }
  const int64_t n = key.size(0);
  if (n == 0) return true;
  at::Tensor loc = slots;
  if (check != CHECK_OFF && n > 1 && api::claims_on.load(std::memory_order_relaxed)) {
    at::Tensor out = r.claim_rows(loc, std::nullopt, errors, 0, 1, check, 0, std::nullopt, std::nullopt, std::nullopt,
                                  k.pages * k.rows, k.rows, false);
    if (out.numel() != 0) loc = out;
  }
  StoreKVParams p;
  p.in_dtype = p.cache_dtype = dtype_of(key);
  p.k = source_rows<KVSide>(key);
  p.k.cache = k.paged;
  p.v = source_rows<KVSide>(value);
  p.v.cache = v.paged;
  p.H = int(key.size(1));
  p.locs.loc = loc.data_ptr();
  p.locs.n = n;
  p.locs.errors = errors ? errors->data_ptr<int64_t>() : nullptr;
  p.locs.capacity = k.pages * k.rows;
  p.locs.pool_page_size = k.rows;
  if (key.is_cpu()) call_footprint = int64_t(key.nbytes() + value.nbytes() + kc.nbytes() + vc.nbytes());
  r.store_kv(p, check, key);
  return true;
}

inline bool auto_dtype(const c10::IValue& v) { return v.isString() && v.toStringRef() == "auto"; }

// `_C::cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa, k_scale,
// v_scale, kv_cache_dtype)`: caches [P, H, S, D]; the key tile of a (page, head) is column-major
// (feature d of row s at d * S + s: a split head dim of width 1, feature stride S).
inline bool cpu_attn(const c10::IValue* a) {
  if (!a[5].isString() || !auto_dtype(a[8])) return false;
  const std::string& isa = a[5].toStringRef();
  if (isa != "vec" && isa != "vec16" && isa != "neon") return false;
  const at::Tensor &k = a[2].toTensor(), &v = a[3].toTensor();
  if (k.dim() != 4 || v.dim() != 4 || k.sizes() != v.sizes() || k.stride(3) != 1 || k.stride(2) != k.size(3) ||
      v.stride(3) != 1)
    return false;
  CacheView kv = psh(k, 0, 2, 1);
  kv.paged.stride_entry = 1;
  kv.paged.split = 1;
  kv.paged.stride_split = k.size(2);
  return store(a, kv, psh(v, 0, 2, 1));
}

// `_C_cache_ops::reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping,
// kv_cache_dtype, k_scale, v_scale)`: caches [P, S, H, D] (any stride permutation, last dim dense).
inline bool flash(const c10::IValue* a) {
  if (!auto_dtype(a[5])) return false;
  const at::Tensor &k = a[2].toTensor(), &v = a[3].toTensor();
  if (k.dim() != 4 || v.dim() != 4 || k.stride(3) != 1 || v.stride(3) != 1) return false;
  return store(a, psh(k, 0, 1, 2), psh(v, 0, 1, 2));
}

using Fast = bool (*)(const c10::IValue*);

// The engine operator's kernel: the fast path (first five arguments tensors), else its Python writer.
struct EngineRoute final : c10::OperatorKernel {
  Fast fast;
  c10::OperatorHandle python;
  std::atomic<int64_t> calls{0};
  EngineRoute(Fast f, c10::OperatorHandle py) : fast(f), python(std::move(py)) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
    const c10::IValue* a = &(*stack)[stack->size() - op.schema().arguments().size()];
    if (api::ran(op, stack, [&] { return std::all_of(a, a + 5, std::mem_fn(&c10::IValue::isTensor)) && fast(a); }))
      calls.fetch_add(1, std::memory_order_relaxed);
    else
      python.callBoxed(stack);
  }
};

// kvwrite_ext::engine_route: point `qual`'s kernel for `key` at an EngineRoute of `kind` whose
// fallback is the operator `python`; returns a handle (engine_unroute puts the old kernel back).
inline int64_t route(const std::string& qual, const std::string& key, const std::string& kind,
                     const std::string& python) {
  const Fast f = kind == "cpu_attn_reshape_and_cache" ? &cpu_attn
                 : kind == "reshape_and_cache_flash" ? &flash : nullptr;
  TORCH_CHECK(f, "kvwrite: no C++ route for ", kind);
  const auto sep = qual.find("::");
  TORCH_CHECK(sep != std::string::npos, "kvwrite: operator name without a namespace: ", qual);
  const c10::OperatorHandle py = c10::Dispatcher::singleton().findSchemaOrThrow(python.c_str(), "");
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, qual.substr(0, sep),
                                              c10::parseDispatchKey(key), __FILE__, __LINE__);
  auto kernel = std::make_unique<EngineRoute>(f, py);
  const EngineRoute* raw = kernel.get();
  lib->impl(qual.substr(sep + 2).c_str(), torch::CppFunction::makeFromBoxedFunctor(std::move(kernel)));
  return locked([&](State& s) {
    s.routes[s.next] = {std::move(lib), raw};
    return s.next++;
  });
}

inline void define(torch::Library& m) {
  m.def("engine_route(str qual, str key, str kind, str python) -> int", &route);
  m.def("engine_unroute(int handle) -> ()", [](int64_t h) { locked([&](State& s) { s.routes.erase(h); }); });
  m.def("engine_calls(int handle) -> int", [](int64_t h) {
    return locked([&](State& s) { return s.routes.count(h) ? s.routes[h].second->calls.load() : int64_t(0); });
  });
  // check: CHECK_*; device: the c10::DeviceType the fast path may run on, ANY_DEVICE (backend
  // "auto") or NO_DEVICE (a Python backend: every call goes to Python)
  m.def("engine_mode(int check, int device) -> ()", [](int64_t check, int64_t device) {
    state.check = int(check);
    state.device = int(device);
  });
  // guard mode: `cache`'s stores record into `row` (one row of the guard's records)
  m.def("engine_guard_row(Tensor cache, Tensor row) -> ()", [](const at::Tensor& cache, const at::Tensor& row) {
    TORCH_CHECK(row.scalar_type() == at::kLong && row.dim() == 1 && row.size(0) == slot::NUM_SLOTS &&
                    row.is_contiguous() && row.device() == cache.device(),
                "kvwrite: engine_guard_row: a record row is an int64 [", slot::NUM_SLOTS,
                "] tensor on the cache's device");
    locked([&](State& s) { s.rows[cache.data_ptr()] = {cache.sizes().vec(), row}; });
  });
  m.def("engine_guard_clear() -> ()", [] { locked([](State& s) { s.rows.clear(); }); });
}

// A device policy's registrations (csrc/README.md).
template <class Dev>
void impl_device(torch::Library& m) {
#define KVW_IMPL(op, bind, schema) m.impl(#op, Raw<Dev>::op);
  KVW_OPS(KVW_IMPL)
#undef KVW_IMPL
  // the public ops' kernel on Dev's dispatch key, registered when each op's program arrives
  api::programs().registrars.push_back([](const std::string& op, const api::Slot& slot) {
    static std::vector<std::unique_ptr<torch::Library>> libs;  // alive as long as the registrations
    const auto key = Dev::TYPE == c10::DeviceType::CUDA ? c10::DispatchKey::CUDA : c10::DispatchKey::CPU;
    libs.push_back(std::make_unique<torch::Library>(torch::Library::IMPL, "kvwrite", key, __FILE__, __LINE__));
    libs.back()->impl(op.substr(9).c_str(),
                      torch::CppFunction::makeFromBoxedFunctor(std::make_unique<api::Kernel<Dev>>(slot)));
  });
  runner(Dev::TYPE) = {[](const StoreKVParams& p, int64_t check, const at::Tensor& ref) { Dev::run(p, check, ref); },
                       Raw<Dev>::claim_rows};
}

}  // namespace engines
}  // namespace kvwrite
