// The public ops torch.ops.kvwrite.* on the extension's side: argument validation and dispatch
// in C++ for backend "cpu" / "cuda" (ops.cpp / cuda_ops.cpp register `kvwrite::<op>` kernels for
// the CPU / CUDA keys through the `Run` policy of each).
//
// The schemas are defined in Python (kvwrite/ops/_library.py) so that torch.ops.kvwrite.* exist
// before the lazily built extension is loaded; until then (and with KVWRITE_EXT=0) their
// CompositeExplicitAutograd kernel is the Python implementation. Every check below mirrors the
// Python validation (kvwrite/validate.py, kvwrite/ops/*.py): same order, same exception type
// (TORCH_CHECK_VALUE -> ValueError, TORCH_CHECK_TYPE -> TypeError), same text. Calls this file
// does not handle itself are forwarded, unchanged, to the Python implementation (the twin op
// `kvwrite::<op>_py`): backend "torch" / "triton" / a backend that does not run here, guard mode
// without an errors tensor (the default per-device ErrorBuffer lives in Python), assert mode on
// the CPU (kvwrite raises OutOfBoundsWrite from the record), and the errors whose text needs
// Python's repr() (bad layout / check / kv_cache_dtype / scale_fmt strings, unknown dtypes).
// Only tensor metadata is read: no host sync, CUDA-graph safe.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/Exception.h>

#include <initializer_list>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>

#include "params.h"

namespace kvwrite {
namespace api {

using Str = c10::string_view;
using OptStr = std::optional<c10::string_view>;

// Thrown by a check that leaves the call to the Python implementation.
struct Forward {};

// Every public op's schema ends with the page-table tensors (kvwrite.PageTable: loc holds the
// positions). A call that passes them is validated and run by the Python path (for now).
#define KVW_TABLE_PARAMS                                                                       \
  const std::optional<at::Tensor>&batch_indices, const std::optional<at::Tensor>&kv_indices, \
      const std::optional<at::Tensor>&kv_indptr
#define KVW_TABLE batch_indices, kv_indices, kv_indptr

constexpr int64_t MAX_TOKENS = (int64_t(1) << 31) - 1;  // kvwrite.errors.MAX_TOKENS

// ---- Python's formatting of the values the messages show -----------------------------------

inline const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kDouble: return "float64";
    case at::kByte: return "uint8";
    case at::kChar: return "int8";
    case at::kShort: return "int16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kBool: return "bool";
    case at::kFloat8_e4m3fn: return "float8_e4m3fn";
    case at::kFloat8_e5m2: return "float8_e5m2";
    case at::kFloat8_e4m3fnuz: return "float8_e4m3fnuz";
    default: throw Forward{};  // let Python spell it
  }
}

inline std::string join(at::IntArrayRef s) {
  std::ostringstream o;
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  return o.str();
}
inline std::string py_tuple(at::IntArrayRef s) { return "(" + join(s) + (s.size() == 1 ? ",)" : ")"); }
inline std::string py_list(at::IntArrayRef s) { return "[" + join(s) + "]"; }

// ---- kvwrite.validate ------------------------------------------------------------------------

using Dtypes = std::initializer_list<at::ScalarType>;

inline bool has_dtype(const at::Tensor& t, Dtypes dtypes) {
  for (auto d : dtypes)
    if (t.scalar_type() == d) return true;
  return false;
}

// validate.tensor (the argument is a Tensor by the schema).
inline void tensor(const char* name, const at::Tensor& t, int64_t ndim, Dtypes dtypes,
                   const c10::Device* device) {
  const auto dims = t.sizes();
  TORCH_CHECK_VALUE(ndim < 0 || int64_t(dims.size()) == ndim, name, " must be ", ndim, "-D, got shape ",
                    py_tuple(dims));
  if (!has_dtype(t, dtypes)) {
    std::string names;
    for (auto d : dtypes) names += (names.empty() ? "" : ", ") + std::string(dtype_name(d));
    TORCH_CHECK_TYPE(false, name, " must have dtype in (", names, "), got torch.", dtype_name(t.scalar_type()));
  }
  TORCH_CHECK_VALUE(device == nullptr || t.device() == *device, name, " is on ", t.device().str(),
                    " but the inputs are on ", device->str());
  TORCH_CHECK_VALUE(dims.empty() || dims.back() <= 1 || t.stride(-1) == 1, name,
                    " must be contiguous in its last dim, got strides ", py_tuple(t.strides()));
}

constexpr int64_t ANY = -1;  // validate.shape's None

// validate.shape
inline void shape(const char* name, const at::Tensor& t, std::initializer_list<int64_t> expected,
                  const std::string& what) {
  const auto dims = t.sizes();
  bool ok = dims.size() == expected.size();
  size_t i = 0;
  for (auto e : expected) {
    if (!ok) break;
    ok = e == ANY || dims[i] == e;
    ++i;
  }
  if (ok) return;
  std::string want;
  for (auto e : expected) want += (want.empty() ? "" : ", ") + (e == ANY ? std::string("*") : std::to_string(e));
  TORCH_CHECK_VALUE(false, name, " must have shape [", want, "] (", what, "), got ", py_list(dims));
}

// validate.scale: fp32 [] / [1] (per tensor) or, if num_heads > 0, [H].
inline void scale(const char* name, const at::Tensor& t, int64_t num_heads, const c10::Device& device) {
  tensor(name, t, -1, {at::kFloat}, &device);
  const int64_t dim = t.dim();
  const bool ok = dim == 0 || (dim == 1 && (t.size(0) == 1 || (num_heads > 0 && t.size(0) == num_heads)));
  if (!ok) {
    std::string want = "[], [1]";
    if (num_heads > 0) want += " or [" + std::to_string(num_heads) + "] (one per head)";
    TORCH_CHECK_VALUE(false, name, " must have shape ", want, ", got ", py_list(t.sizes()));
  }
  TORCH_CHECK_VALUE(!(dim == 1 && t.size(0) > 1 && t.stride(0) != 1), name, " must be contiguous");
}

// ops._common.cache_geometry
inline void cache_geometry(const char* name, int64_t num_pages, int64_t pool_page_size) {
  TORCH_CHECK_VALUE(num_pages >= 1 && pool_page_size >= 1, name,
                    " must have at least one page of at least one row, got ", num_pages, " pages of ",
                    pool_page_size);
}

// validate.choice / check_mode: a bad value's message quotes Python's repr -> forward.
inline int64_t check_code(Str check) {
  if (check == "off") return CHECK_OFF;
  if (check == "assert") return CHECK_ASSERT;
  if (check == "guard") return CHECK_GUARD;
  throw Forward{};
}

inline bool is_hnd(Str layout) {
  if (layout == "NHD") return false;
  if (layout == "HND") return true;
  throw Forward{};
}

// The backend this kernel is: "auto" resolves to it (its device's first choice, and it is
// loaded); "torch", "triton", the other device's backend or a bad name go to Python.
inline void native(Str backend, const char* self) {
  if (backend != "auto" && backend != self) throw Forward{};
}

// What ops._common.prepare returns that the kernels need: the check code and the record.
struct Prepared {
  int64_t check;
  std::optional<at::Tensor> errors;
};

// ops._common.prepare (+ validate.loc, loc_map, dcp, check_mode).
inline Prepared prepare(const char* op, const c10::Device& device, int64_t n, const at::Tensor& loc,
                        const std::optional<at::Tensor>& loc_map, int64_t dcp_rank, int64_t dcp_size,
                        Str check, const std::optional<at::Tensor>& errors) {
  TORCH_CHECK_VALUE(n <= MAX_TOKENS, op, ": at most ", MAX_TOKENS, " tokens per call, got ", n);
  tensor("loc", loc, 1, {at::kInt, at::kLong}, &device);
  TORCH_CHECK_VALUE(loc.size(0) == n, "loc must have one entry per token (", n, "), got ", loc.size(0));
  TORCH_CHECK_VALUE(!(n > 1 && loc.stride(0) != 1), "loc must be contiguous, got stride ", loc.stride(0));
  if (loc_map.has_value()) {
    tensor("loc_map", *loc_map, 1, {at::kInt, at::kLong}, &device);
    TORCH_CHECK_VALUE(!(loc_map->size(0) > 1 && loc_map->stride(0) != 1), "loc_map must be contiguous, got stride ",
                      loc_map->stride(0));
  }
  TORCH_CHECK_VALUE(dcp_size >= 1, "dcp_size must be an int >= 1, got ", dcp_size);
  TORCH_CHECK_VALUE(0 <= dcp_rank && dcp_rank < dcp_size, "dcp_rank must be an int in [0, dcp_size=", dcp_size,
                    "), got ", dcp_rank);
  Prepared p{check_code(check), std::nullopt};
  if (!errors.has_value()) {
    if (p.check == CHECK_GUARD) throw Forward{};  // the default ErrorBuffer of the device
    return p;
  }
  const at::Tensor& e = *errors;
  // "errors must be a kvwrite.ErrorBuffer or None, got <type name>": Python names the type.
  if (!(e.scalar_type() == at::kLong && e.dim() == 1 && e.size(0) == slot::NUM_SLOTS)) throw Forward{};
  TORCH_CHECK_VALUE(e.device() == device, "errors is on ", e.device().str(), " but the inputs are on ",
                    device.str());
  if (p.check == CHECK_GUARD) p.errors = e;
  return p;
}

// Run the kernel. CPU assert mode (R::ASSERT_IN_PYTHON): the kernel's pre-scan (a compare per
// token, before any write) throws on a bad loc; that call goes to Python, which raises
// kvwrite.OutOfBoundsWrite with the record. No bad loc: the kernel ran here, at full speed.
template <class R, class F>
void run(const Prepared& p, F&& kernel) {
  if (R::ASSERT_IN_PYTHON && p.check == CHECK_ASSERT) {
    try {
      kernel();
    } catch (const c10::Error&) {
      throw Forward{};
    }
    return;
  }
  kernel();
}

// ---- forwarding to the Python implementation -----------------------------------------------

inline void push(torch::jit::Stack& s, const at::Tensor& t) { s.emplace_back(t); }
inline void push(torch::jit::Stack& s, const std::optional<at::Tensor>& t) { s.emplace_back(t); }
inline void push(torch::jit::Stack& s, Str v) { s.emplace_back(std::string(v)); }
inline void push(torch::jit::Stack& s, const OptStr& v) {
  if (v.has_value()) s.emplace_back(std::string(*v)); else s.emplace_back();
}
inline void push(torch::jit::Stack& s, int64_t v) { s.emplace_back(v); }

// Run `kvwrite::<name>_py` (the Python implementation) with the call's own arguments.
template <class... A>
void forward(const c10::OperatorHandle& op, const A&... args) {
  torch::jit::Stack stack;
  stack.reserve(sizeof...(A));
  (push(stack, args), ...);
  op.callBoxed(&stack);
}

inline c10::OperatorHandle python_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// ---- the ops ---------------------------------------------------------------------------------
//
// `R` is the device policy: R::NAME ("cpu" / "cuda"), R::ASSERT_IN_PYTHON, and the raw kernels
// R::store_kv(...) etc. with the kvwrite_ext signatures (canonical cache views, coded check/op).

template <class R>
void store_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& loc, Str layout, const std::optional<at::Tensor>& k_scale,
              const std::optional<at::Tensor>& v_scale, Str check, const std::optional<at::Tensor>& errors,
              const std::optional<at::Tensor>& loc_map, int64_t dcp_rank, int64_t dcp_size, Str backend, KVW_TABLE_PARAMS) {
  try {
    native(backend, R::NAME);
    if (batch_indices || kv_indices || kv_indptr) throw Forward{};  // page-table addressing: Python
    // ops.kv._check_tensors
    tensor("k", k, 3, {at::kFloat, at::kHalf, at::kBFloat16}, nullptr);
    const int64_t n = k.size(0), h = k.size(1), dk = k.size(2);
    const c10::Device device = k.device();
    tensor("v", v, 3, {k.scalar_type()}, &device);
    shape("v", v, {n, h, ANY}, "tokens, heads as k, head_dim_v");
    const bool hnd = is_hnd(layout);
    tensor("k_cache", k_cache, 4, {k.scalar_type(), at::kFloat8_e4m3fn, at::kFloat8_e5m2, at::kFloat8_e4m3fnuz},
           &device);
    tensor("v_cache", v_cache, 4, {k_cache.scalar_type()}, &device);
    const int64_t pages = k_cache.size(0), pps = k_cache.size(hnd ? 2 : 1);
    const char* dims = hnd ? "HND: num_pages, H, pool_page_size, D" : "NHD: num_pages, pool_page_size, H, D";
    if (hnd) {
      shape("k_cache", k_cache, {pages, h, pps, dk}, dims);
      shape("v_cache", v_cache, {pages, h, pps, v.size(2)}, dims);
    } else {
      shape("k_cache", k_cache, {pages, pps, h, dk}, dims);
      shape("v_cache", v_cache, {pages, pps, h, v.size(2)}, dims);
    }
    cache_geometry("k_cache", pages, pps);
    // ops.kv.prepare_store_kv
    const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn || k_cache.scalar_type() == at::kFloat8_e5m2 ||
                     k_cache.scalar_type() == at::kFloat8_e4m3fnuz;  // validate.FP8_MAX
    if (fp8) {
      TORCH_CHECK_VALUE(k_scale.has_value() && v_scale.has_value(), "k_scale and v_scale are required for a torch.",
                        dtype_name(k_cache.scalar_type()), " cache");
      scale("k_scale", *k_scale, h, device);
      scale("v_scale", *v_scale, h, device);
    } else {
      TORCH_CHECK_VALUE(!k_scale.has_value() && !v_scale.has_value(),
                        "k_scale/v_scale apply only to fp8 caches; the caches are torch.",
                        dtype_name(k_cache.scalar_type()));
    }
    const Prepared p = prepare("store_kv", device, n, loc, loc_map, dcp_rank, dcp_size, check, errors);
    if (n == 0) return;
    run<R>(p, [&] { R::store_kv(k, v, hnd ? k_cache.transpose(1, 2) : k_cache, hnd ? v_cache.transpose(1, 2) : v_cache, k_scale,
                v_scale, loc, loc_map, p.errors, dcp_rank, dcp_size, p.check, int64_t(OP_STORE_KV), std::nullopt, std::nullopt, std::nullopt); });
  } catch (const Forward&) {
    static const c10::OperatorHandle op = python_op("kvwrite::store_kv_py");
    forward(op, k, v, k_cache, v_cache, loc, layout, k_scale, v_scale, check, errors, loc_map, dcp_rank, dcp_size,
            backend, KVW_TABLE);
  }
}

// ops.mla.FORMATS: kernel mode, cache dtype (-1: the input dtype), per-tensor scale, scale cache.
struct MLAFormat {
  int mode;
  at::ScalarType cache_dtype;
  bool input_dtype, takes_scale, takes_scale_cache;
  int flags = 0;  // fp8_ds_mla option bits (DS_MLA_POW2, DS_MLA_RAW_ROPE)
};

inline MLAFormat mla_format(Str name) {
  if (name == "auto") return {MLA_COPY, at::kFloat, true, false, false};
  if (name == "fp8_e4m3") return {MLA_FP8, at::kFloat8_e4m3fn, false, true, false};
  if (name == "fp8_e5m2") return {MLA_FP8, at::kFloat8_e5m2, false, true, false};
  if (name == "fp8_e4m3fnuz") return {MLA_FP8, at::kFloat8_e4m3fnuz, false, true, false};
  if (name == "fp8_ds_mla") return {MLA_DS_MLA, at::kByte, false, false, false};
  if (name == "fp8_ds_mla+pow2") return {MLA_DS_MLA, at::kByte, false, false, false, DS_MLA_POW2};
  if (name == "fp8_ds_mla+input") return {MLA_DS_MLA, at::kByte, false, false, false, DS_MLA_RAW_ROPE};
  if (name == "fp8_ds_mla+pow2+input")
    return {MLA_DS_MLA, at::kByte, false, false, false, DS_MLA_POW2 | DS_MLA_RAW_ROPE};
  if (name == "nvfp4") return {MLA_NVFP4, at::kByte, false, false, true};
  throw Forward{};
}

template <class R>
void store_mla(const at::Tensor& kv_c, const at::Tensor& k_pe, const at::Tensor& kv_cache, const at::Tensor& loc,
               Str kv_cache_dtype, const std::optional<at::Tensor>& scale_, Str check,
               const std::optional<at::Tensor>& errors, const std::optional<at::Tensor>& loc_map, int64_t dcp_rank,
               int64_t dcp_size, Str backend, const std::optional<at::Tensor>& scale_cache,
               const std::optional<at::Tensor>& global_scale, KVW_TABLE_PARAMS) {
  try {
    native(backend, R::NAME);
    if (batch_indices || kv_indices || kv_indptr) throw Forward{};  // page-table addressing: Python
    tensor("kv_c", kv_c, 2, {at::kFloat, at::kHalf, at::kBFloat16}, nullptr);
    const int64_t n = kv_c.size(0), lora = kv_c.size(1);
    const c10::Device device = kv_c.device();
    tensor("k_pe", k_pe, 2, {kv_c.scalar_type()}, &device);
    shape("k_pe", k_pe, {n, ANY}, "tokens as kv_c, rope_dim");
    const int64_t rope = k_pe.size(1);
    const MLAFormat fmt = mla_format(kv_cache_dtype);
    const std::string fname = "'" + std::string(kv_cache_dtype) + "'";  // repr of a known name
    if (fmt.mode == MLA_NVFP4) {
      TORCH_CHECK_VALUE((lora + rope) % NVFP4_BLOCK == 0,
                        "kv_cache_dtype='nvfp4' needs kv_lora_rank + rope_dim to be a multiple of ", NVFP4_BLOCK,
                        ", got ", lora, " + ", rope);
    } else if (fmt.mode == MLA_DS_MLA) {
      TORCH_CHECK_VALUE(lora % DS_MLA_TILE == 0,
                        "kv_cache_dtype='fp8_ds_mla' needs kv_c's last dim (kv_lora_rank) to be a multiple of ",
                        DS_MLA_TILE, ", got ", lora);
      TORCH_CHECK_VALUE(!(fmt.flags & DS_MLA_RAW_ROPE) || kv_c.scalar_type() == at::kBFloat16 ||
                            kv_c.scalar_type() == at::kHalf,
                        "kv_cache_dtype=", fname, " stores the rope's own 16-bit pattern: kv_c and k_pe must be "
                        "bfloat16 or float16, got torch.", dtype_name(kv_c.scalar_type()));
    }
    tensor("kv_cache", kv_cache, 3, {fmt.input_dtype ? kv_c.scalar_type() : fmt.cache_dtype}, &device);
    const int64_t width = fmt.mode == MLA_DS_MLA ? lora + (lora / DS_MLA_TILE) * 4 + 2 * rope
                          : fmt.mode == MLA_NVFP4 ? (lora + rope) / 2
                                                  : lora + rope;
    shape("kv_cache", kv_cache, {ANY, ANY, width},
          "num_pages, pool_page_size, row of " + std::to_string(width) + " for kv_cache_dtype=" + fname +
              " with kv_lora_rank=" + std::to_string(lora) + ", rope_dim=" + std::to_string(rope));
    cache_geometry("kv_cache", kv_cache.size(0), kv_cache.size(1));
    if (fmt.takes_scale) {
      TORCH_CHECK_VALUE(scale_.has_value(), "scale is required for kv_cache_dtype=", fname);
      scale("scale", *scale_, 0, device);
    } else {
      TORCH_CHECK_VALUE(!scale_.has_value(), "scale applies only to kv_cache_dtype 'fp8_e4m3'/'fp8_e5m2'/'fp8_e4m3fnuz', not ",
                        fname);
    }
    if (fmt.takes_scale_cache) {
      TORCH_CHECK_VALUE(scale_cache.has_value(), "scale_cache is required for kv_cache_dtype=", fname);
      tensor("scale_cache", *scale_cache, 3, {at::kFloat8_e4m3fn}, &device);
      shape("scale_cache", *scale_cache, {kv_cache.size(0), kv_cache.size(1), (lora + rope) / NVFP4_BLOCK},
            "num_pages, pool_page_size as kv_cache, (kv_lora_rank + rope_dim)/" + std::to_string(NVFP4_BLOCK));
      if (global_scale.has_value()) scale("global_scale", *global_scale, 0, device);
    } else {
      TORCH_CHECK_VALUE(!scale_cache.has_value() && !global_scale.has_value(),
                        "scale_cache/global_scale apply only to kv_cache_dtype 'nvfp4', not ", fname);
    }
    const Prepared p = prepare("store_mla", device, n, loc, loc_map, dcp_rank, dcp_size, check, errors);
    if (n == 0) return;
    run<R>(p, [&] { R::store_mla(kv_c, k_pe, kv_cache, scale_, scale_cache, global_scale, int64_t(fmt.mode | fmt.flags), loc, loc_map, p.errors,
                 dcp_rank, dcp_size, p.check, int64_t(OP_STORE_MLA), std::nullopt, std::nullopt, std::nullopt); });
  } catch (const Forward&) {
    static const c10::OperatorHandle op = python_op("kvwrite::store_mla_py");
    forward(op, kv_c, k_pe, kv_cache, loc, kv_cache_dtype, scale_, check, errors, loc_map, dcp_rank, dcp_size,
            backend, scale_cache, global_scale, KVW_TABLE);
  }
}

template <class R>
void store_indexer_k(const at::Tensor& k, const at::Tensor& cache, const at::Tensor& loc, int64_t qbs,
                     OptStr scale_fmt, Str check, const std::optional<at::Tensor>& errors,
                     const std::optional<at::Tensor>& loc_map, Str backend, KVW_TABLE_PARAMS) {
  try {
    native(backend, R::NAME);
    if (batch_indices || kv_indices || kv_indptr) throw Forward{};  // page-table addressing: Python
    tensor("k", k, 2, {at::kFloat, at::kHalf, at::kBFloat16}, nullptr);
    const int64_t n = k.size(0), d = k.size(1);
    const c10::Device device = k.device();
    TORCH_CHECK_VALUE(qbs > 0, "quant_block_size must be a positive int, got ", qbs);
    TORCH_CHECK_VALUE(d % qbs == 0, "k's head dim (", d, ") must be a multiple of quant_block_size (", qbs, ")");
    if (scale_fmt.has_value() && *scale_fmt != "ue8m0") throw Forward{};
    tensor("cache", cache, 2, {at::kByte}, &device);
    const int64_t per_token = d + (d / qbs) * 4, row = cache.size(1);
    TORCH_CHECK_VALUE(row % per_token == 0 && row != 0, "cache's page of ", row,
                      " bytes is not a whole number of tokens of ", per_token, " bytes (D=", d, " e4m3 + ", d / qbs,
                      " fp32 scales): expected [num_pages, pool_page_size * ", per_token, "]");
    cache_geometry("cache", cache.size(0), row / per_token);
    const Prepared p = prepare("store_indexer_k", device, n, loc, loc_map, 0, 1, check, errors);
    if (n == 0) return;
    run<R>(p, [&] { R::store_indexer_k(k, cache, qbs, scale_fmt.has_value(), loc, loc_map, p.errors, 0, 1, p.check,
                       int64_t(OP_STORE_INDEXER_K), std::nullopt, std::nullopt, std::nullopt); });
  } catch (const Forward&) {
    static const c10::OperatorHandle op = python_op("kvwrite::store_indexer_k_py");
    forward(op, k, cache, loc, qbs, scale_fmt, check, errors, loc_map, backend, KVW_TABLE);
  }
}

template <class R>
void store_kv_nvfp4(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& k_scale_cache, const at::Tensor& v_scale_cache, const at::Tensor& loc,
                    const std::optional<at::Tensor>& k_global, const std::optional<at::Tensor>& v_global, Str layout,
                    Str check, const std::optional<at::Tensor>& errors, const std::optional<at::Tensor>& loc_map,
                    int64_t dcp_rank, int64_t dcp_size, Str backend, KVW_TABLE_PARAMS) {
  try {
    native(backend, R::NAME);
    if (batch_indices || kv_indices || kv_indptr) throw Forward{};  // page-table addressing: Python
    tensor("k", k, 3, {at::kFloat, at::kHalf, at::kBFloat16}, nullptr);
    const int64_t n = k.size(0), h = k.size(1), dk = k.size(2);
    const c10::Device device = k.device();
    tensor("v", v, 3, {k.scalar_type()}, &device);
    shape("v", v, {n, h, ANY}, "tokens, heads as k, head_dim_v");
    const int64_t dv = v.size(2);
    for (auto [name, d] : {std::pair<const char*, int64_t>{"k", dk}, {"v", dv}})
      TORCH_CHECK_VALUE(d % NVFP4_BLOCK == 0, name, " head_dim must be a multiple of ", NVFP4_BLOCK,
                        " for NVFP4 (one e4m3 scale per ", NVFP4_BLOCK, " elements), got ", d);
    const bool hnd = is_hnd(layout);
    const std::string dims = hnd ? "HND: num_pages, H, pool_page_size, " : "NHD: num_pages, pool_page_size, H, ";
    struct Cache {
      const char* name;
      const at::Tensor& t;
      at::ScalarType dtype;
      int64_t width;
      const char* what;
    };
    const std::string blk = std::to_string(NVFP4_BLOCK);
    const std::string d16 = "D/" + blk, dv16 = "Dv/" + blk;
    const Cache caches[] = {{"k_cache", k_cache, at::kByte, dk / 2, "D/2"},
                            {"v_cache", v_cache, at::kByte, dv / 2, "Dv/2"},
                            {"k_scale_cache", k_scale_cache, at::kFloat8_e4m3fn, dk / NVFP4_BLOCK, d16.c_str()},
                            {"v_scale_cache", v_scale_cache, at::kFloat8_e4m3fn, dv / NVFP4_BLOCK, dv16.c_str()}};
    int64_t pages = 0, pps = 0;
    bool first = true;
    for (const Cache& c : caches) {
      tensor(c.name, c.t, 4, {c.dtype}, &device);
      if (first) {
        pages = c.t.size(0);
        pps = c.t.size(hnd ? 2 : 1);
        first = false;
      }
      if (hnd)
        shape(c.name, c.t, {pages, h, pps, c.width}, dims + c.what);
      else
        shape(c.name, c.t, {pages, pps, h, c.width}, dims + c.what);
    }
    cache_geometry("k_cache", pages, pps);
    if (k_global.has_value()) scale("k_global_scale", *k_global, 0, device);
    if (v_global.has_value()) scale("v_global_scale", *v_global, 0, device);
    const Prepared p = prepare("store_kv_nvfp4", device, n, loc, loc_map, dcp_rank, dcp_size, check, errors);
    if (n == 0) return;
    auto canon = [&](const at::Tensor& t) { return hnd ? t.transpose(1, 2) : t; };
    run<R>(p, [&] { R::store_kv_nvfp4(k, v, canon(k_cache), canon(v_cache), canon(k_scale_cache), canon(v_scale_cache), k_global,
                      v_global, loc, loc_map, p.errors, dcp_rank, dcp_size, p.check, int64_t(OP_STORE_KV_NVFP4), std::nullopt, std::nullopt, std::nullopt); });
  } catch (const Forward&) {
    static const c10::OperatorHandle op = python_op("kvwrite::store_kv_nvfp4_py");
    forward(op, k, v, k_cache, v_cache, k_scale_cache, v_scale_cache, loc, k_global, v_global, layout, check, errors,
            loc_map, dcp_rank, dcp_size, backend, KVW_TABLE);
  }
}

}  // namespace api
}  // namespace kvwrite

// Register the public ops' kernels for one dispatch key with device policy R.
#define KVW_REGISTER_API(R)                                           \
  m.impl("store_kv", &kvwrite::api::store_kv<R>);                     \
  m.impl("store_mla", &kvwrite::api::store_mla<R>);                   \
  m.impl("store_indexer_k", &kvwrite::api::store_indexer_k<R>);       \
  m.impl("store_kv_nvfp4", &kvwrite::api::store_kv_nvfp4<R>)
