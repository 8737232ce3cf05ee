// The engines' own cache operators on kvwrite's kernels without a Python frame: the vLLM plugin
// points the kernel of `_C::cpu_attn_reshape_and_cache` / `_C_cache_ops::reshape_and_cache_flash`
// at an EngineRoute (kvwrite.integrations.vllm), which runs vLLM's common call ("auto" caches in
// the input dtype, int64 slots, the layout the engine documents) straight on the raw store_kv
// kernel of the tensors' device. Every other call (fp8 caches, a shape or dtype off the common
// case, a backend other than auto / the device's, guard mode for a cache whose record row is not
// registered here, a CPU assert's pre-scan refusal) goes unchanged to the plugin's Python writer
// (the op `kvwrite_engine::<name>`), which validates and raises the named error: one message
// producer, as in api.h. Only tensor metadata is read: no host sync, CUDA-graph safe.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/DispatchKey.h>
#include <torch/library.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "api.h"

namespace kvwrite {
namespace engines {

using OptT = std::optional<at::Tensor>;

// The raw kernels of one device (filled by the translation unit that has them: ops.cpp for the
// CPU, cuda_ops.cpp for CUDA).
struct Runner {
  void (*store_kv)(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptT&,
                   const OptT&, const at::Tensor&, const OptT&, const OptT&, int64_t, int64_t, int64_t, int64_t,
                   const OptT&, const OptT&, const OptT&) = nullptr;
  at::Tensor (*claim_rows)(const at::Tensor&, const OptT&, const OptT&, int64_t, int64_t, int64_t, int64_t,
                           const OptT&, const OptT&, const OptT&, int64_t, int64_t, bool) = nullptr;
};

inline Runner& runner(c10::DeviceType d) {
  static Runner cpu, cuda, none;
  return d == c10::DeviceType::CPU ? cpu : d == c10::DeviceType::CUDA ? cuda : none;
}

constexpr int ANY_DEVICE = -1, NO_DEVICE = -2;

// The plugin's state: the check mode (KVWRITE_CHECK), the backend, and in guard mode each
// registered cache's record row (by data_ptr; the cache's shape the Python side checked its
// namespace for). Rows are cleared whenever the guard registers caches or grows its records.
struct State {
  std::atomic<int> check{CHECK_OFF};
  std::atomic<int> device{ANY_DEVICE};  // the device type the fast path runs on (backend "auto": any)
  std::mutex mu;
  std::unordered_map<const void*, std::pair<std::vector<int64_t>, at::Tensor>> rows;
  std::map<int64_t, std::unique_ptr<torch::Library>> libs;
  int64_t next = 0;
};

inline State& state() {
  static State s;
  return s;
}

inline OptT guard_row(const at::Tensor& cache) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.rows.find(cache.data_ptr());
  if (it == s.rows.end() || it->second.first != cache.sizes().vec()) return std::nullopt;
  return it->second.second;
}

// The common call of a vLLM K/V writer: key/value [N, H, D] in the caches' dtype, last dim
// dense, int64 slots [N] on the same device; `kc` / `vc` the canonical [P, S, H, D(, 1)] views.
inline bool common_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kc, const at::Tensor& vc,
                      const at::Tensor& slots) {
  const auto dt = key.scalar_type();
  if (dt != at::kBFloat16 && dt != at::kHalf && dt != at::kFloat) return false;
  if (value.scalar_type() != dt || kc.scalar_type() != dt || vc.scalar_type() != dt) return false;
  if (key.dim() != 3 || value.dim() != 3 || slots.dim() != 1 || slots.scalar_type() != at::kLong) return false;
  const auto dev = key.device();
  if (value.device() != dev || kc.device() != dev || vc.device() != dev || slots.device() != dev) return false;
  const int64_t n = key.size(0);
  if (value.size(0) != n || slots.size(0) != n || n > api::MAX_TOKENS) return false;
  if (key.stride(2) != 1 || value.stride(2) != 1 || slots.stride(0) != 1) return false;
  return kc.size(2) == key.size(1) && kc.size(3) == key.size(2) && vc.size(2) == value.size(1) &&
         vc.size(3) == value.size(2) && kc.size(0) == vc.size(0) && kc.size(1) == vc.size(1);
}

// Run store_kv on the canonical views; false: Python runs the call.
inline bool store(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kc, const at::Tensor& vc,
                  const at::Tensor& slots, const at::Tensor& cache) {
  const int want = state().device.load(std::memory_order_relaxed);
  if (want != ANY_DEVICE && want != int(key.device().type())) return false;
  const Runner& r = runner(key.device().type());
  if (!r.store_kv || !common_kv(key, value, kc, vc, slots)) return false;
  const int check = state().check.load(std::memory_order_relaxed);
  OptT errors;
  if (check == CHECK_GUARD && !(errors = guard_row(cache))) return false;
  if (key.size(0) == 0) return true;
  at::Tensor loc = slots;
  if (check != CHECK_OFF && key.size(0) > 1 && api::claims_on().load(std::memory_order_relaxed)) {
    at::Tensor out = r.claim_rows(loc, std::nullopt, errors, 0, 1, check, 0, std::nullopt, std::nullopt, std::nullopt,
                                  kc.size(0) * kc.size(1), kc.size(1), false);
    if (out.numel() != 0) loc = out;
  }
  r.store_kv(key, value, kc, vc, std::nullopt, std::nullopt, loc, std::nullopt, errors, 0, 1, check, 0, std::nullopt,
             std::nullopt, std::nullopt);
  return true;
}

inline bool auto_dtype(const c10::IValue& v) { return v.isString() && v.toStringRef() == "auto"; }

// `_C::cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa, k_scale,
// v_scale, kv_cache_dtype)`: caches [P, H, S, D], the key tile of a (page, head) column-major.
inline bool cpu_attn(torch::jit::Stack& s, size_t at) {
  const c10::IValue* a = &s[at];
  if (!a[0].isTensor() || !a[1].isTensor() || !a[2].isTensor() || !a[3].isTensor() || !a[4].isTensor()) return false;
  if (!a[5].isString() || !auto_dtype(a[8])) return false;
  const std::string& isa = a[5].toStringRef();
  if (isa != "vec" && isa != "vec16" && isa != "neon") return false;
  const at::Tensor &k = a[2].toTensor(), &v = a[3].toTensor();
  if (k.dim() != 4 || v.dim() != 4 || k.sizes() != v.sizes() || k.stride(3) != 1 || k.stride(2) != k.size(3) ||
      v.stride(3) != 1)
    return false;
  const at::Tensor kc = k.as_strided({k.size(0), k.size(2), k.size(1), k.size(3), 1},
                                     {k.stride(0), 1, k.stride(1), k.size(2), 1});
  return store(a[0].toTensor(), a[1].toTensor(), kc, v.transpose(1, 2),
               a[4].toTensor(), k);
}

// `_C_cache_ops::reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping,
// kv_cache_dtype, k_scale, v_scale)`: caches [P, S, H, D] (any stride permutation, last dim dense).
inline bool flash(torch::jit::Stack& s, size_t at) {
  const c10::IValue* a = &s[at];
  if (!a[0].isTensor() || !a[1].isTensor() || !a[2].isTensor() || !a[3].isTensor() || !a[4].isTensor()) return false;
  if (!auto_dtype(a[5])) return false;
  const at::Tensor &k = a[2].toTensor(), &v = a[3].toTensor();
  if (k.dim() != 4 || v.dim() != 4 || k.stride(3) != 1 || v.stride(3) != 1) return false;
  return store(a[0].toTensor(), a[1].toTensor(), k, v, a[4].toTensor(), k);
}

using Fast = bool (*)(torch::jit::Stack&, size_t);

inline Fast fast_path(const std::string& kind) {
  if (kind == "cpu_attn_reshape_and_cache") return &cpu_attn;
  if (kind == "reshape_and_cache_flash") return &flash;
  return nullptr;
}

// The kernel registered on the engine's operator: the fast path, else its Python writer.
struct EngineRoute final : c10::OperatorKernel {
  Fast fast;
  c10::OperatorHandle python;
  std::atomic<int64_t> calls{0};
  EngineRoute(Fast f, c10::OperatorHandle py) : fast(f), python(std::move(py)) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
    const size_t n = op.schema().arguments().size();
    bool done = false;
    try {
      done = fast(*stack, stack->size() - n);
    } catch (const c10::Error&) {
      done = false;  // a CPU assert's pre-scan (nothing written): Python raises the named error
    }
    if (done) {
      calls.fetch_add(1, std::memory_order_relaxed);
      torch::jit::drop(*stack, n);
      return;
    }
    python.callBoxed(stack);
  }
};

inline std::unordered_map<int64_t, EngineRoute*>& routes() {
  static std::unordered_map<int64_t, EngineRoute*> m;
  return m;
}

// kvwrite_ext::engine_route: point `qual`'s kernel for `key` at an EngineRoute of `kind` whose
// fallback is the operator `python`; returns a handle (engine_unroute puts the old kernel back).
inline int64_t route(const std::string& qual, const std::string& key, const std::string& kind,
                     const std::string& python) {
  const Fast f = fast_path(kind);
  TORCH_CHECK(f, "kvwrite: no C++ route for ", kind);
  const auto sep = qual.find("::");
  TORCH_CHECK(sep != std::string::npos, "kvwrite: operator name without a namespace: ", qual);
  const c10::OperatorHandle py = c10::Dispatcher::singleton().findSchemaOrThrow(python.c_str(), "");
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, qual.substr(0, sep),
                                              c10::parseDispatchKey(key), __FILE__, __LINE__);
  auto kernel = std::make_unique<EngineRoute>(f, py);
  EngineRoute* raw = kernel.get();
  lib->impl(qual.substr(sep + 2).c_str(), torch::CppFunction::makeFromBoxedFunctor(std::move(kernel)));
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  const int64_t h = s.next++;
  s.libs[h] = std::move(lib);
  routes()[h] = raw;
  return h;
}

inline void unroute(int64_t h) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  routes().erase(h);
  s.libs.erase(h);
}

inline int64_t calls(int64_t h) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = routes().find(h);
  return it == routes().end() ? 0 : it->second->calls.load();
}

// check: CHECK_*; device: the c10::DeviceType the fast path may run on, ANY_DEVICE (backend
// "auto") or NO_DEVICE (a Python backend: every call goes to Python)
inline void set_mode(int64_t check, int64_t device) {
  state().check = int(check);
  state().device = int(device);
}

// guard mode: `cache`'s stores record into `row` (one row of the guard's records)
inline void guard_row_set(const at::Tensor& cache, const at::Tensor& row) {
  TORCH_CHECK(row.scalar_type() == at::kLong && row.dim() == 1 && row.size(0) == slot::NUM_SLOTS &&
                  row.is_contiguous() && row.device() == cache.device(),
              "kvwrite: engine_guard_row: a record row is an int64 [", slot::NUM_SLOTS, "] tensor on the cache's device");
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.rows[cache.data_ptr()] = {cache.sizes().vec(), row};
}

inline void guard_rows_clear() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.rows.clear();
}

inline void define(torch::Library& m) {
  m.def("engine_route(str qual, str key, str kind, str python) -> int", &route);
  m.def("engine_unroute(int handle) -> ()", &unroute);
  m.def("engine_calls(int handle) -> int", &calls);
  m.def("engine_mode(int check, int device) -> ()", &set_mode);
  m.def("engine_guard_row(Tensor cache, Tensor row) -> ()", &guard_row_set);
  m.def("engine_guard_clear() -> ()", &guard_rows_clear);
}

}  // namespace engines
}  // namespace kvwrite
