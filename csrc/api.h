// The public ops torch.ops.kvwrite.* on the extension's side: ONE boxed kernel for every op, fed
// by the op's spec (kvwrite/ops/spec.py, `Op.program()`, handed over once when the extension
// loads through kvwrite_ext::set_program). The generic matcher below runs the spec's checks
// (shape letters unified across tensors, dtypes, devices, the addressing tail) as predicates;
// then the op's launcher (the op list, `Launch<R>::ops()`) calls the raw kernel for backend "cpu" / "cuda".
//
// Every call the matcher refuses, and every call this file does not run itself (backend "torch" /
// "triton" / the other device's, guard mode without an errors tensor, a CPU assert whose pre-scan
// found a bad loc, a kernel error), goes unchanged to the Python implementation (the twin op
// `kvwrite::<op>_py`), which raises the named error: one message producer, so the C++ and Python
// texts are equal by construction. Only tensor metadata is read: no host sync, CUDA-graph safe.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/where.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "expr.h"
#include "kvwrite/claims.h"
#include "registry.h"

namespace kvwrite {
namespace api {

using expr::UNBOUND;  // an env slot not bound yet
constexpr int64_t MAX_TOKENS = (int64_t(1) << 31) - 1;  // kvwrite.errors.MAX_TOKENS

inline std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  std::istringstream in(s);
  while (std::getline(in, cur, sep)) out.push_back(cur);
  return out;
}

// One dim of a tensor's shape spec: a letter (env slot, divided by div), a literal size, or any.
struct Dim {
  int slot = -1;
  int64_t div = 1;
  int64_t lit = -1;
};

// One step of an op's checks: a tensor ('T'), a dequant scale ('S'), an expression rule ('X',
// expr.h: every op rule, the spec's generic ones too).
struct Step {
  char kind = 'T';
  int arg = -1, name_slot = -1, heads = -1, ndim = -1;
  bool optional = false, layout = false, last_contiguous = true;
  std::vector<Dim> dims;
  std::vector<at::ScalarType> dtypes;
  std::vector<int> dtype_slots, binds;
  expr::Rule expr;  // an expression rule
};

// Where the generic launcher finds one argument of the op's raw kernel (spec.Op.raw_sources): the
// addressing tail's field ('t', TAIL_FIELDS), the op's argument ('a'; 'l': a cache in its
// canonical layout view; 'n': whether it is given), an env slot ('e'; 'b': as a bool).
struct Source {
  char kind;
  int index;
};

// An op's spec, parsed once (format: kvwrite.ops.spec.Op.program).
struct Program {
  std::string name;
  std::vector<std::string> args;
  std::unordered_map<std::string, int> arg_index, slot_index;
  int nslots = 0, op_code = 0;
  bool dcp_page = false, table_ok = false;
  std::string loc_arg = "loc";  // the addressing argument (a page move's dst pages / dst locs)
  char claims = 'r';             // the duplicate pre-pass: 'r' rows, 'p' page pairs, 'n' none (a gather)
  std::vector<Step> steps;
  std::optional<c10::OperatorHandle> python;
  // The raw kernel an op without a hand-written launcher runs (`raw <op> <source>...`, its index
  // in raw_names()) and where each of its arguments comes from.
  int raw_index = -1;
  std::vector<Source> sources;

  int arg(const std::string& n) const {
    auto it = arg_index.find(n);
    return it == arg_index.end() ? -1 : it->second;
  }
  int slot(const std::string& n) const {
    auto it = slot_index.find(n);
    TORCH_CHECK(it != slot_index.end(), "kvwrite: the spec of ", name, " has no slot ", n);
    return it->second;
  }
};

inline Program parse(const std::string& name, const std::string& text) {
  Program p;
  p.name = name;
  for (const std::string& line : split(text, '\n')) {
    const auto w = split(line, ' ');
    if (w.empty()) continue;
    if (w[0] == "args") {
      for (size_t i = 1; i < w.size(); ++i) p.arg_index[w[i]] = int(p.args.size()), p.args.push_back(w[i]);
    } else if (w[0] == "slots") {
      for (size_t i = 1; i < w.size(); ++i) p.slot_index[w[i]] = int(i - 1);
      p.nslots = int(w.size() - 1);
    } else if (w[0] == "op") {
      p.op_code = std::stoi(w[1]);
      p.dcp_page = w[2] == "1";
      p.table_ok = w[3] == "1";
    } else if (w[0] == "loc") {  // loc <arg> rows|pairs|read
      p.loc_arg = w[1];
      p.claims = w[2] == "pairs" ? 'p' : w[2] == "read" ? 'n' : 'r';
    } else if (w[0] == "T" || w[0] == "S") {  // T arg optional layout lastc ndim dims dtypes binds
      Step s;
      s.kind = w[0][0];
      s.arg = p.arg(w[1]);
      s.name_slot = p.slot(w[1]);
      s.optional = w[2] == "1";
      s.layout = w[3] == "1";
      s.last_contiguous = w[4] == "1";
      s.ndim = std::stoi(w[5]);
      if (s.kind == 'S') {
        if (w[6] != "-") s.heads = p.slot(w[6]);
      } else if (w[6] != "-") {
        for (const std::string& tok : split(w[6], ',')) {
          Dim d;
          if (tok == "*") {
          } else if (tok[0] == '#') {
            d.lit = std::stoll(tok.substr(1));
          } else {
            const auto parts = split(tok, '/');
            d.slot = p.slot(parts[0]);
            if (parts.size() > 1) d.div = std::stoll(parts[1]);
          }
          s.dims.push_back(d);
        }
      }
      if (w[7] != "-")
        for (const std::string& d : split(w[7], ',')) {
          if (d[0] == '=') {
            s.dtype_slots.push_back(p.slot(d.substr(1)));
          } else {
            auto t = expr::scalar_type(d);
            TORCH_CHECK(t.has_value(), "kvwrite: unknown dtype ", d, " in the spec of ", name);
            s.dtypes.push_back(*t);
          }
        }
      if (w[8] != "-")
        for (const std::string& b : split(w[8], ',')) s.binds.push_back(p.slot(b));
      p.steps.push_back(std::move(s));
    } else if (w[0] == "raw") {
      const auto& raws = raw_names();
      p.raw_index = int(std::find(raws.begin(), raws.end(), w[1]) - raws.begin());
      TORCH_CHECK(p.raw_index < int(raws.size()), "kvwrite: ", name, "'s raw kernel ", w[1], " is not a kvwrite_ext op");
      for (size_t i = 2; i < w.size(); ++i) p.sources.push_back({w[i][0], std::stoi(w[i].substr(1))});
    } else if (w[0] == "X") {
      Step s;
      s.kind = 'X';
      s.expr = expr::compile(line.substr(2), {[&p](const std::string& n) { return p.arg(n); },
                                              [&p](const std::string& n) {
                                                auto it = p.slot_index.find(n);
                                                return it == p.slot_index.end() ? -1 : it->second;
                                              }});
      p.steps.push_back(std::move(s));
    } else {
      TORCH_CHECK(false, "kvwrite: ", name, "'s program has an unknown line: ", line);
    }
  }
  return p;
}

// The programs by op name ("kvwrite::store_kv"), set when the extension loads.
inline std::unordered_map<std::string, std::shared_ptr<const Program>>& programs() {
  static std::unordered_map<std::string, std::shared_ptr<const Program>> m;
  return m;
}
inline std::mutex& programs_lock() {
  static std::mutex m;
  return m;
}

// The ops whose kernels api.h registers itself (hand-written launchers, Launch<R>::ops) and the
// registrations of one op's generic kernel per device (register_ops adds its device's).
inline std::set<std::string>& launched_by_hand() {
  static std::set<std::string> s;
  return s;
}
inline std::vector<void (*)(const std::string&)>& registrars() {
  static std::vector<void (*)(const std::string&)> r;
  return r;
}

inline void set_program(c10::string_view name, c10::string_view text) {
  auto p = std::make_shared<Program>(parse(std::string(name), std::string(text)));
  p->python = c10::Dispatcher::singleton().findSchemaOrThrow(("kvwrite::" + p->name + "_py").c_str(), "");
  const std::string full = "kvwrite::" + p->name;
  const bool generic = p->raw_index >= 0 && !launched_by_hand().count(full);
  std::lock_guard<std::mutex> g(programs_lock());
  programs()[full] = std::move(p);
  static std::set<std::string> registered;
  if (generic && registered.insert(full).second)
    for (auto reg : registrars()) reg(full);
}

inline std::shared_ptr<const Program> find_program(const std::string& name) {
  std::lock_guard<std::mutex> g(programs_lock());
  auto it = programs().find(name);
  return it == programs().end() ? nullptr : it->second;
}

// A call being matched: its arguments (the stack slice), the env of letters and dtypes, the device.
struct Call {
  const Program& p;
  at::ArrayRef<c10::IValue> a;
  std::vector<int64_t> env;
  std::optional<c10::Device> device;

  const c10::IValue& v(const std::string& n) const { return a[p.arg(n)]; }
  const at::Tensor& t(const std::string& n) const { return v(n).toTensor(); }
  std::optional<at::Tensor> opt(const std::string& n) const { return v(n).toOptional<at::Tensor>(); }
  int64_t& e(const std::string& n) { return env[p.slot(n)]; }
  bool none(const std::string& n) const { return v(n).isNone(); }
  bool on_device(const at::Tensor& t) const { return !device || t.device() == *device; }
};

inline bool contiguous_1d(const at::Tensor& t) { return t.dim() == 1 && (t.size(0) <= 1 || t.stride(0) == 1); }

// validate.tensor + validate.shape of one tensor step, binding its letters (predicate).
inline bool match_tensor(const Step& s, Call& c) {
  const c10::IValue& iv = c.a[s.arg];
  if (iv.isNone()) return s.optional;
  if (!iv.isTensor()) return false;
  const at::Tensor& t = iv.toTensor();
  const at::ScalarType st = t.scalar_type();
  bool ok = s.dtypes.empty() && s.dtype_slots.empty();
  for (auto d : s.dtypes) ok = ok || d == st;
  for (int d : s.dtype_slots) ok = ok || c.env[d] == int64_t(st);
  if (!ok || !c.on_device(t)) return false;
  if (s.kind == 'S') {  // validate.scale: [] / [1] / [H], contiguous
    const int64_t dim = t.dim();
    return dim == 0 || (dim == 1 && (t.size(0) == 1 || (s.heads >= 0 && t.size(0) == c.env[s.heads])) &&
                        (t.size(0) <= 1 || t.stride(0) == 1));
  }
  const auto shape = t.sizes();
  if (s.ndim >= 0 && int64_t(shape.size()) != s.ndim) return false;
  if (s.last_contiguous && !shape.empty() && shape.back() > 1 && t.stride(-1) != 1) return false;
  if (!c.device) c.device = t.device();
  c.env[s.name_slot] = int64_t(st);
  if (s.dims.empty()) return true;
  const bool hnd = s.layout && c.env[c.p.slot("layout")] >= 1;  // HND, cpu_attn: [P, H, S, D]
  auto canon = [&](size_t i) { return shape[hnd && (i == 1 || i == 2) ? 3 - i : i]; };
  for (int b : s.binds)
    for (size_t i = 0; i < s.dims.size(); ++i)
      if (s.dims[i].slot == b) c.env[b] = canon(i);
  for (size_t i = 0; i < s.dims.size(); ++i) {
    const Dim& d = s.dims[i];
    const int64_t want = d.lit >= 0 ? d.lit : d.slot >= 0 && c.env[d.slot] != UNBOUND ? c.env[d.slot] / d.div : -1;
    if (want >= 0 && canon(i) != want) return false;
  }
  for (size_t i = 0; i < s.dims.size(); ++i)
    if (s.dims[i].slot >= 0 && s.dims[i].div == 1 && c.env[s.dims[i].slot] == UNBOUND) c.env[s.dims[i].slot] = canon(i);
  return true;
}

// The addressing tail (ops._common.prepare + kvwrite.pagetable.table), as predicates.
struct Tail {
  at::Tensor loc;
  std::optional<at::Tensor> loc_map, errors, batch_indices, kv_indices, kv_indptr;
  int64_t dcp_rank = 0, dcp_size = 1, check = CHECK_OFF, op = 0;
};

inline bool index_tensor(const std::optional<at::Tensor>& t, const Call& c) {
  return !t || ((t->scalar_type() == at::kInt || t->scalar_type() == at::kLong) && contiguous_1d(*t) && c.on_device(*t));
}

inline std::optional<Tail> addressing(Call& c) {
  Tail t;
  const int64_t n = c.e("N");
  const c10::IValue& loc = c.v(c.p.loc_arg);
  if (n > MAX_TOKENS || !loc.isTensor() || !c.device) return std::nullopt;
  t.loc = loc.toTensor();
  if (!index_tensor(t.loc, c) || t.loc.size(0) != n) return std::nullopt;
  if (c.p.arg("loc_map") >= 0) t.loc_map = c.opt("loc_map");
  if (c.p.arg("dcp_rank") >= 0) t.dcp_rank = c.v("dcp_rank").toInt(), t.dcp_size = c.v("dcp_size").toInt();
  if (!index_tensor(t.loc_map, c) || t.dcp_size < 1 || t.dcp_rank < 0 || t.dcp_rank >= t.dcp_size) return std::nullopt;
  if (c.p.arg("kv_indptr") >= 0)  // the schema ends with the page-table tensors
    t.batch_indices = c.opt("batch_indices"), t.kv_indices = c.opt("kv_indices"), t.kv_indptr = c.opt("kv_indptr");
  if (t.batch_indices || t.kv_indices || t.kv_indptr) {
    if (!c.p.table_ok || !t.batch_indices || !t.kv_indices || !t.kv_indptr || t.loc_map || t.dcp_size != 1)
      return std::nullopt;
    if (!index_tensor(t.batch_indices, c) || !index_tensor(t.kv_indices, c) || !index_tensor(t.kv_indptr, c) ||
        t.batch_indices->size(0) != n || t.kv_indptr->size(0) < 1)
      return std::nullopt;
  }
  const std::string& check = c.v("check").toStringRef();
  t.check = check == "off" ? CHECK_OFF : check == "assert" ? CHECK_ASSERT : check == "guard" ? CHECK_GUARD : -1;
  if (t.check < 0) return std::nullopt;
  t.errors = c.opt("errors");
  if (t.errors) {
    const at::Tensor& e = *t.errors;
    if (!(e.scalar_type() == at::kLong && e.dim() == 1 && e.size(0) == slot::NUM_SLOTS) || !c.on_device(e))
      return std::nullopt;
  } else if (t.check == CHECK_GUARD) {
    return std::nullopt;  // the device's default ErrorBuffer lives in Python
  }
  if (t.check != CHECK_GUARD) t.errors = std::nullopt;
  t.op = c.p.op_code;
  return t;
}

// The raw kernels' common tail: loc, loc_map, errors, dcp_rank, dcp_size, check, op, page table.
#define KVW_TAIL_ARGS \
  t.loc, t.loc_map, t.errors, t.dcp_rank, t.dcp_size, t.check, t.op, t.batch_indices, t.kv_indices, t.kv_indptr

// ---- the op list: each op's launcher maps its arguments to the raw kernel's ------------------
//
// `R` is the device policy: R::NAME ("cpu" / "cuda") and the raw kernels R::store_kv(...) etc.
// (the kvwrite_ext signatures: canonical cache views, coded check and op, the common tail).

template <class R>
struct Launch {
  static at::Tensor cv(Call& c, const at::Tensor& x) { return c.e("layout") >= 1 ? x.transpose(1, 2) : x; }
  // The key cache's canonical view: cpu_attn's column-major (page, head) tile is a split head dim
  // [P, S, H, D, 1] with feature stride S (ops.kv.canonical_key).
  static at::Tensor cvk(Call& c, const at::Tensor& x) {
    if (c.e("layout") != 2) return cv(c, x);
    return x.as_strided({x.size(0), x.size(2), x.size(1), x.size(3), 1}, {x.stride(0), 1, x.stride(1), x.size(2), 1});
  }
  // Formats store_kv's and rope_store_kv's plain kernels take (copy, static fp8); the others run
  // their _quant kernels (int8 and dynamic scales).
  static bool plain_kv(Call& c) {
    return c.e("quant") == 0 || (c.e("quant") == 1 && c.e("k_cache") != int64_t(at::kChar));
  }
  // The fused RoPE stores' norm weights as fp32.
  static std::optional<at::Tensor> fp32(Call& c, const char* n) {
    auto w = c.opt(n);
    return w && w->scalar_type() != at::kFloat ? std::optional<at::Tensor>(w->to(at::kFloat)) : w;
  }
  static std::optional<at::Tensor> rows_view(Call& c, const char* n) {  // [P, S] scale caches as [P, S, 1]
    auto s = c.opt(n);
    return s && s->dim() == 2 ? std::optional<at::Tensor>(s->unsqueeze(-1)) : s;
  }
  // Pair i of a move reads gathered row i, or nothing (-1) when src[i] is outside [0, capacity).
  static at::Tensor live_ids(const at::Tensor& src, int64_t capacity) {
    if (!src.is_cpu()) return at::where(src.ge(0).logical_and_(src.lt(capacity)), at::arange(src.size(0), src.options()), -1);
    at::Tensor ids = src.to(at::kLong, false, true);  // a copy
    int64_t* p = ids.data_ptr<int64_t>();
    for (int64_t i = 0; i < ids.size(0); ++i) p[i] = p[i] >= 0 && p[i] < capacity ? i : -1;
    return ids;
  }
  using Fn = void (*)(Call&, const Tail&);
  // The ops whose arguments do not map onto one raw kernel by name, each with its launcher (a
  // format picks the raw kernel, or the caches need other views); every other op with a program
  // runs its raw kernel through `run_raw`.
  static const std::unordered_map<std::string, Fn>& ops() {
    static const std::unordered_map<std::string, Fn> m = {
      // plain_kv formats: the store_kv kernel; int8 and dynamic scales: store_kv_quant's; int4 its own.
      {"kvwrite::store_kv", [](Call& c, const Tail& t) {
        const int64_t quant = c.e("quant");
        const at::Tensor vc = cv(c, c.t("v_cache"));
        if (quant == 4)
          return R::store_kv_int4(c.t("k"), c.t("v"), cv(c, c.t("k_cache")), vc, c.t("k_scale_cache"),
                                  c.t("v_scale_cache"), KVW_TAIL_ARGS);
        if (plain_kv(c))
          return R::store_kv(c.t("k"), c.t("v"), cvk(c, c.t("k_cache")), vc, c.opt("k_scale"), c.opt("v_scale"),
                             KVW_TAIL_ARGS);
        R::store_kv_quant(c.t("k"), c.t("v"), cv(c, c.t("k_cache")), vc, c.opt("k_scale"), c.opt("v_scale"),
                          rows_view(c, "k_scale_cache"), rows_view(c, "v_scale_cache"), quant, c.e("rule"),
                          KVW_TAIL_ARGS);
      }},
      {"kvwrite::store_kv_head_major", [](Call& c, const Tail& t) {  // store_kv on the split-head-dim views
        R::store_kv(c.t("key"), c.t("value"), c.t("key_cache").permute({0, 3, 1, 2, 4}),
                    c.t("value_cache").permute({0, 3, 1, 2}).unsqueeze(-1), c.opt("k_scale"), c.opt("v_scale"),
                    KVW_TAIL_ARGS);
      }},
      {"kvwrite::rope_store_kv", [](Call& c, const Tail& t) {
        const int64_t quant = c.e("quant");
        const at::Tensor &pos = c.t("positions"), &q = c.t("q"), &k = c.t("k"), &v = c.t("v");
        const at::Tensor &cs = c.t("cos_sin_cache"), kc = cv(c, c.t("k_cache")), vc = cv(c, c.t("v_cache"));
        const auto qw = fp32(c, "q_norm_weight"), kw = fp32(c, "k_norm_weight");
        const double eps = c.v("norm_eps").toDouble();
        const bool neox = c.v("is_neox").toBool();
        if (plain_kv(c))
          return R::rope_store_kv(pos, q, k, v, cs, kc, vc, c.opt("k_scale"), c.opt("v_scale"), qw, kw, eps, neox,
                                  KVW_TAIL_ARGS);
        R::rope_store_kv_quant(pos, q, k, v, cs, kc, vc, c.opt("k_scale"), c.opt("v_scale"),
                               rows_view(c, "k_scale_cache"), rows_view(c, "v_scale_cache"), quant, c.e("rule"), qw,
                               kw, eps, neox, KVW_TAIL_ARGS);
      }},
      // move_rows (ops.pages.move): the source rows gathered first, then copied as one-row units.
      {"kvwrite::move_rows", [](Call& c, const Tail& t) {
        const at::Tensor cache = pool4(c.t("cache")), src = c.t("src_loc");
        const int64_t n = src.size(0), capacity = cache.size(0) * cache.size(1);
        const at::Tensor rows = at::empty({n, 1, cache.size(2), cache.size(3)}, cache.options());
        R::gather(cache, rows.squeeze(1), src, std::nullopt, t.errors, 0, 1, t.check, t.op, std::nullopt, std::nullopt,
                  std::nullopt);
        R::copy_pages(rows, cache, live_ids(src, capacity), t.loc, t.errors, t.check, t.op);
      }},
    };
    return m;
  }
};


// The tail's fields by index: loc, loc_map, errors, dcp_rank, dcp_size, check, op, the page table
// (spec.TAIL_FIELDS).
inline c10::IValue tail_field(const Tail& t, int i) {
  switch (i) {
    case 0: return t.loc;
    case 1: return t.loc_map;
    case 2: return t.errors;
    case 3: return t.dcp_rank;
    case 4: return t.dcp_size;
    case 5: return t.check;
    case 6: return t.op;
    case 7: return t.batch_indices;
    case 8: return t.kv_indices;
    default: return t.kv_indptr;
  }
}

// The generic launcher: the op's raw kernel with each argument from its source (resolve_raw).
template <class R>
void run_raw(Call& c, const Tail& t) {
  thread_local std::vector<c10::IValue> s;  // no allocation per call; no tensor held past it
  struct Clear {
    std::vector<c10::IValue>& v;
    ~Clear() { v.clear(); }
  } clear{s};
  for (const Source& src : c.p.sources) {
    switch (src.kind) {
      case 't': s.push_back(tail_field(t, src.index)); break;
      case 'l': {
        const auto x = c.a[src.index].toOptional<at::Tensor>();
        s.emplace_back(x ? std::optional<at::Tensor>(Launch<R>::cv(c, *x)) : std::nullopt);
        break;
      }
      case 'n': s.emplace_back(!c.a[src.index].isNone()); break;
      case 'e': s.emplace_back(c.env[src.index]); break;
      case 'b': s.emplace_back(c.env[src.index] != 0); break;
      default: s.push_back(c.a[src.index]);
    }
  }
  R::boxed(size_t(c.p.raw_index), s);
}

// The duplicate-row pre-pass (kvwrite/claims.h, kvwrite/ops/claims.py) of every op in assert /
// guard mode, before its launcher: the store then runs on its result (guard: bad and duplicate
// tokens set to -1; a page table's rows as plain locs). A throw (CPU assert: a duplicate; a pool
// the env does not name) hands the call to Python, which raises the named error.
// On unless the bench switches it off for its baseline (kvwrite_ext::set_claims, ops.claims.disabled).
inline std::atomic<bool>& claims_on() {
  static std::atomic<bool> on{true};
  return on;
}

template <class R>
void claim(Call& c, Tail& t) {
  // one token writes one row: nothing to claim (its bad loc, if any, is the store's own check)
  if (!claims_on().load(std::memory_order_relaxed) || c.e("N") < 2) return;
  const int64_t pps = c.e("S"), pages = c.e("P");
  TORCH_CHECK(pps >= 1 && pages >= 1, "kvwrite: ", c.p.name, ": no pool geometry for the duplicate check");
  at::Tensor out = R::claim_rows(t.loc, t.loc_map, t.errors, t.dcp_rank, t.dcp_size, t.check, t.op, t.batch_indices,
                                 t.kv_indices, t.kv_indptr, pages * pps, pps, c.p.dcp_page);
  if (out.numel() == 0) return;  // assert mode without a duplicate: the store's own checks
  t.loc = std::move(out);
  t.batch_indices = t.kv_indices = t.kv_indptr = std::nullopt;
}

// Match the call against its spec and run it here; false: Python runs it.
template <class R>
bool run_here(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const std::string& name = op.schema().name();
  const auto p = find_program(name);
  if (!p || p->args.size() != op.schema().arguments().size()) return false;
  Call c{*p, torch::jit::last(*stack, p->args.size()), std::vector<int64_t>(p->nslots, UNBOUND), std::nullopt};
  const c10::IValue& backend = c.v("backend");
  if (!backend.isString() || (backend.toStringRef() != "auto" && backend.toStringRef() != R::NAME)) return false;
  for (const Step& s : p->steps)
    if (!(s.kind == 'X' ? s.expr(c.a, c.env) : match_tensor(s, c))) return false;
  std::optional<Tail> t = addressing(c);
  if (!t) return false;
  if (c.e("N") > 0) {
    // a page move's (src, dst) pairs: the Python pre-pass (kvwrite.reference.claims.unique_pairs)
    if (t->check != CHECK_OFF && p->claims == 'p' && c.e("N") >= 2) return false;
    if (t->check != CHECK_OFF && p->claims == 'r') claim<R>(c, *t);
    const auto& hand = Launch<R>::ops();
    const auto it = hand.find(name);
    if (it != hand.end()) {
      it->second(c, *t);
    } else if (p->raw_index >= 0) {
      run_raw<R>(c, *t);
    } else {
      return false;
    }
  }
  return true;
}

// The kernel of every public op for one dispatch key. A kernel error (a CPU assert's pre-scan,
// which throws before any write) also goes to Python, which raises OutOfBoundsWrite.
template <class R>
void boxed(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  bool done = false;
  try {
    done = run_here<R>(op, stack);
  } catch (const c10::Error&) {
    done = false;
  }
  if (done) {
    torch::jit::drop(*stack, op.schema().arguments().size());
    return;
  }
  const auto p = find_program(op.schema().name());
  const c10::OperatorHandle py =
      p ? *p->python : c10::Dispatcher::singleton().findSchemaOrThrow((op.schema().name() + "_py").c_str(), "");
  py.callBoxed(stack);
}

// One op's generic kernel on R's dispatch key, registered when its program arrives (set_program).
template <class R>
void register_generic(const std::string& op) {
  static std::vector<std::unique_ptr<torch::Library>> libs;  // alive as long as the registrations
  const c10::DispatchKey key = std::string(R::NAME) == "cuda" ? c10::DispatchKey::CUDA : c10::DispatchKey::CPU;
  libs.push_back(std::make_unique<torch::Library>(torch::Library::IMPL, "kvwrite", key, __FILE__, __LINE__));
  libs.back()->impl(op.substr(9).c_str(), torch::CppFunction::makeFromBoxedFunction<&boxed<R>>());
}

template <class R>
void register_ops(torch::Library& m) {
  for (const auto& kv : Launch<R>::ops()) {
    launched_by_hand().insert(kv.first);
    m.impl(kv.first.substr(9).c_str(), torch::CppFunction::makeFromBoxedFunction<&boxed<R>>());
  }
  registrars().push_back(&register_generic<R>);
}

}  // namespace api
}  // namespace kvwrite
