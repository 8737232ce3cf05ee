// The public ops torch.ops.kvwrite.*: ONE boxed kernel for every op, fed by its spec (csrc/README.md);
// a call it refuses or does not run goes unchanged to the Python twin `kvwrite::<op>_py`.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <unordered_map>

#include "expr.h"  // ATen Tensor, <algorithm>, <optional>, <string>, <vector>
#include "kvwrite/claims.h"
#include "registry.h"

namespace kvwrite {
namespace api {

using expr::UNBOUND;  // an env slot not bound yet
constexpr int64_t MAX_TOKENS = (int64_t(1) << 31) - 1;  // kvwrite.errors.MAX_TOKENS
constexpr int TAIL_FIELDS = 10;  // the addressing tail's fields, spec.TAIL_FIELDS (a raw source 't<i>')

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

// One step of an op's checks: a tensor ('T'), a dequant scale ('S'), an expression rule ('X').
struct Step {
  char kind = 'T';
  int arg = -1, name_slot = -1, heads = -1, ndim = -1;
  bool optional = false, layout = false, last_contiguous = true;
  std::vector<Dim> dims;
  std::vector<at::ScalarType> dtypes;
  std::vector<int> dtype_slots, binds;
  expr::Rule expr;  // an expression rule
};

// Where the generic launcher finds one argument of the op's raw kernel (spec.Op.raw_sources, run_raw).
struct Source {
  char kind;
  int index;
};

// One raw kernel of an op (`raw <op> <source>... [if <expr>]`): its index in RAW_NAMES.
struct RawCall {
  int index = -1;
  std::vector<Source> sources;
  std::optional<expr::Rule> when;
};

// An op's spec, parsed once (format: kvwrite.ops.spec.Op.program).
struct Program {
  std::string name, text;
  std::vector<std::string> args;
  std::unordered_map<std::string, int> arg_index, slot_index;
  int nslots = 0, op_code = 0;
  bool dcp_page = false, table_ok = false;
  std::string loc_arg = "loc";  // the addressing argument (a page move's dst pages / dst locs)
  char claims = 'r';             // the duplicate pre-pass: 'r' rows, 'p' page pairs, 'n' none (a gather)
  std::vector<Step> steps;
  std::optional<c10::OperatorHandle> python;
  std::vector<RawCall> raws;  // in the spec's order: the first whose condition holds runs
  int layout = -1;            // the env slot of the caches' layout (cache_view), -1 without one
  // What every call reads, by index (parse sets them): its arguments (-1: the op has none) and slots.
  int backend = -1, check = -1, errors = -1, loc = -1, loc_map = -1, dcp_rank = -1, dcp_size = -1,
      batch_indices = -1, kv_indices = -1, kv_indptr = -1, N = -1, P = -1, S = -1;

  static int find(const std::unordered_map<std::string, int>& m, const std::string& n) {
    auto it = m.find(n);
    return it == m.end() ? -1 : it->second;
  }
  int arg(const std::string& n) const { return find(arg_index, n); }
  int slot(const std::string& n) const {
    TORCH_CHECK(find(slot_index, n) >= 0, "kvwrite: the spec of ", name, " has no slot ", n);
    return find(slot_index, n);
  }
};

inline Program parse(const std::string& name, const std::string& text) {
  Program p;
  p.name = name;
  const expr::Names names{[&p](const std::string& n) { return p.arg(n); },
                          [&p](const std::string& n) { return Program::find(p.slot_index, n); }};
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
      Step s{w[0][0], p.arg(w[1]), p.slot(w[1]), -1, std::stoi(w[5]), w[2] == "1", w[3] == "1", w[4] == "1"};
      if (s.kind == 'S') {
        if (w[6] != "-") s.heads = p.slot(w[6]);
      } else if (w[6] != "-") {
        for (const std::string& tok : split(w[6], ',')) {
          const auto parts = split(tok, '/');
          s.dims.push_back(tok == "*"      ? Dim{}
                           : tok[0] == '#' ? Dim{-1, 1, std::stoll(tok.substr(1))}
                                           : Dim{p.slot(parts[0]), parts.size() > 1 ? std::stoll(parts[1]) : 1});
        }
      }
      if (w[7] != "-")
        for (const std::string& d : split(w[7], ',')) {
          const auto t = expr::scalar_type(d);
          TORCH_CHECK(d[0] == '=' || t, "kvwrite: unknown dtype ", d, " in the spec of ", name);
          if (d[0] == '=') s.dtype_slots.push_back(p.slot(d.substr(1)));
          else s.dtypes.push_back(*t);
        }
      if (w[8] != "-")
        for (const std::string& b : split(w[8], ',')) s.binds.push_back(p.slot(b));
      p.steps.push_back(std::move(s));
    } else if (w[0] == "raw") {  // raw <op> <source>... [if <expr>]: the condition compiled once, here
      const size_t cond = line.find(" if ");
      const auto r = split(line.substr(0, cond), ' ');
      RawCall rc;
      rc.index = int(std::find(std::begin(RAW_NAMES), std::end(RAW_NAMES), r[1]) - std::begin(RAW_NAMES));
      TORCH_CHECK(rc.index < int(std::size(RAW_NAMES)), "kvwrite: ", name, "'s raw kernel ", r[1],
                  " is not a kvwrite_ext op");
      for (size_t i = 2; i < r.size(); ++i) {
        rc.sources.push_back({r[i][0], std::stoi(r[i].substr(1))});
        TORCH_CHECK(r[i][0] != 't' || (rc.sources.back().index >= 0 && rc.sources.back().index < TAIL_FIELDS),
                    "kvwrite: ", name, "'s raw source ", r[i], " names no field of the addressing tail");
      }
      if (cond != std::string::npos) rc.when = expr::compile(line.substr(cond + 4), names);
      p.raws.push_back(std::move(rc));
    } else if (w[0] == "X") {
      p.steps.push_back(Step{'X'});
      p.steps.back().expr = expr::compile(line.substr(2), names);
    } else {
      TORCH_CHECK(false, "kvwrite: ", name, "'s program has an unknown line: ", line);
    }
  }
  p.layout = names.slot("layout");
  for (auto [field, arg] : {std::pair{&p.backend, "backend"}, {&p.check, "check"}, {&p.errors, "errors"},
                            {&p.loc, p.loc_arg.c_str()}, {&p.loc_map, "loc_map"}, {&p.dcp_rank, "dcp_rank"},
                            {&p.dcp_size, "dcp_size"}, {&p.batch_indices, "batch_indices"},
                            {&p.kv_indices, "kv_indices"}, {&p.kv_indptr, "kv_indptr"}})
    *field = p.arg(arg);
  TORCH_CHECK(p.backend >= 0 && p.check >= 0 && p.errors >= 0 && p.loc >= 0, "kvwrite: the spec of ", name,
              " lacks backend, check, errors or its loc argument ", p.loc_arg);
  p.N = p.slot("N"), p.P = p.slot("P"), p.S = p.slot("S");
  return p;
}

// One op's program: the current one, which its kernel reads on every call without a lock or a
// lookup, and every earlier one, alive for the calls that may still run on it (a program is
// replaced only when its text changes).
struct Slot {
  std::atomic<const Program*> current{nullptr};
  std::vector<std::unique_ptr<const Program>> all;
};

// The programs by op name ("kvwrite::store_kv"), set when the extension loads, and the devices'
// registrations of an op's generic kernel (engines::impl_device adds its device's).
struct Programs {
  std::mutex mu;
  std::unordered_map<std::string, Slot> by_name;  // a Slot never moves (its kernels hold it)
  std::vector<void (*)(const std::string&, const Slot&)> registrars;
  std::set<std::string> registered;
};
inline Programs& programs() {
  static Programs p;
  return p;
}

inline void set_program(c10::string_view name, c10::string_view text) {
  const std::string full = "kvwrite::" + std::string(name);
  Programs& all = programs();
  {
    std::lock_guard<std::mutex> g(all.mu);
    const Program* now = all.by_name[full].current.load();
    if (now != nullptr && now->text == text) return;  // sent again as is (spec.send_programs)
  }
  auto p = std::make_unique<Program>(parse(std::string(name), std::string(text)));
  p->text = std::string(text);
  p->python = c10::Dispatcher::singleton().findSchemaOrThrow((full + "_py").c_str(), "");
  const bool generic = !p->raws.empty();
  std::lock_guard<std::mutex> g(all.mu);
  Slot& slot = all.by_name[full];
  slot.current.store(p.get(), std::memory_order_release);
  slot.all.push_back(std::move(p));
  if (generic && all.registered.insert(full).second)
    for (auto reg : all.registrars) reg(full, slot);
}

// A call being matched: its arguments (the stack slice), the env of letters and dtypes, the device.
struct Call {
  const Program& p;
  at::ArrayRef<c10::IValue> a;
  std::vector<int64_t>& env;
  std::optional<c10::Device> device;

  std::optional<at::Tensor> opt(int i) const { return i < 0 ? std::nullopt : a[i].toOptional<at::Tensor>(); }
  bool on_device(const at::Tensor& t) const { return !device || t.device() == *device; }
};

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
  const bool hnd = s.layout && c.env[c.p.layout] >= 1;  // HND, cpu_attn: [P, H, S, D]
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

// The tail's field i (spec.TAIL_FIELDS' order): only the fields a raw kernel takes are copied.
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
    default: return t.kv_indptr;  // parse refuses an index >= TAIL_FIELDS
  }
}

inline bool index_tensor(const std::optional<at::Tensor>& t, const Call& c) {
  return !t || ((t->scalar_type() == at::kInt || t->scalar_type() == at::kLong) && t->dim() == 1 &&
                (t->size(0) <= 1 || t->stride(0) == 1) && c.on_device(*t));
}

inline std::optional<Tail> addressing(Call& c) {
  Tail t;
  const Program& p = c.p;
  const int64_t n = c.env[p.N];
  const c10::IValue& loc = c.a[p.loc];
  if (n > MAX_TOKENS || !loc.isTensor() || !c.device) return std::nullopt;
  t.loc = loc.toTensor();
  if (!index_tensor(t.loc, c) || t.loc.size(0) != n) return std::nullopt;
  t.loc_map = c.opt(p.loc_map);
  if (p.dcp_rank >= 0) t.dcp_rank = c.a[p.dcp_rank].toInt(), t.dcp_size = c.a[p.dcp_size].toInt();
  if (!index_tensor(t.loc_map, c) || t.dcp_size < 1 || t.dcp_rank < 0 || t.dcp_rank >= t.dcp_size) return std::nullopt;
  if (p.kv_indptr >= 0)  // the schema ends with the page-table tensors
    t.batch_indices = c.opt(p.batch_indices), t.kv_indices = c.opt(p.kv_indices), t.kv_indptr = c.opt(p.kv_indptr);
  if (t.batch_indices || t.kv_indices || t.kv_indptr) {
    if (!p.table_ok || !t.batch_indices || !t.kv_indices || !t.kv_indptr || t.loc_map || t.dcp_size != 1)
      return std::nullopt;
    if (!index_tensor(t.batch_indices, c) || !index_tensor(t.kv_indices, c) || !index_tensor(t.kv_indptr, c) ||
        t.batch_indices->size(0) != n || t.kv_indptr->size(0) < 1)
      return std::nullopt;
  }
  const std::string& check = c.a[p.check].toStringRef();
  t.check = check == "off" ? CHECK_OFF : check == "assert" ? CHECK_ASSERT : check == "guard" ? CHECK_GUARD : -1;
  if (t.check < 0) return std::nullopt;
  t.errors = c.opt(p.errors);
  if (t.errors) {
    const at::Tensor& e = *t.errors;
    if (!(e.scalar_type() == at::kLong && e.dim() == 1 && e.size(0) == slot::NUM_SLOTS) || !c.on_device(e))
      return std::nullopt;
  } else if (t.check == CHECK_GUARD) {
    return std::nullopt;  // the device's default ErrorBuffer lives in Python
  }
  if (t.check != CHECK_GUARD) t.errors = std::nullopt;
  t.op = p.op_code;
  return t;
}

// A cache argument in its raw kernel's view: 'l' ops.kv.canonical, 'k' ops.kv.canonical_key (cpu_attn's
// column-major tiles), 'h' ops.kv_head_major.canonical_head_major (key 5-D, value 4-D).
inline at::Tensor cache_view(char kind, const Call& c, const at::Tensor& x) {
  if (kind == 'h') return x.dim() == 5 ? x.permute({0, 3, 1, 2, 4}) : x.permute({0, 3, 1, 2}).unsqueeze(-1);
  const int64_t layout = c.p.layout < 0 ? 0 : c.env[c.p.layout];
  if (kind == 'k' && layout == 2)
    return x.as_strided({x.size(0), x.size(2), x.size(1), x.size(3), 1}, {x.stride(0), 1, x.stride(1), x.size(2), 1});
  return layout >= 1 ? x.transpose(1, 2) : x;
}

// The generic launcher: raw kernel `r` with each argument from its source (spec.Op.raw_sources).
template <class Dev>
void run_raw(Call& c, const Tail& t, const RawCall& r) {
  thread_local std::vector<c10::IValue> s;  // no allocation per call; no tensor held past it
  const auto clear = c10::make_scope_exit([&] { s.clear(); });
  for (const Source& src : r.sources) {
    switch (src.kind) {
      case 't': s.push_back(tail_field(t, src.index)); break;
      case 'l':
      case 'k':
      case 'h': {
        const auto x = c.a[src.index].toOptional<at::Tensor>();
        s.emplace_back(x ? std::optional<at::Tensor>(cache_view(src.kind, c, *x)) : std::nullopt);
        break;
      }
      case 'n': s.emplace_back(!c.a[src.index].isNone()); break;
      case 'e': s.emplace_back(c.env[src.index]); break;
      case 'b': s.emplace_back(c.env[src.index] != 0); break;
      default: s.push_back(c.a[src.index]);
    }
  }
  Raw<Dev>::boxed(size_t(r.index), s);
}

// The duplicate-row pre-pass (csrc/README.md); off only for the bench's baseline (set_claims).
inline std::atomic<bool> claims_on{true};

// Match the call against its spec and run it here; false: Python runs it.
template <class Dev>
bool run_here(const Program& p, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (p.args.size() != op.schema().arguments().size()) return false;
  thread_local std::vector<int64_t> env;  // no allocation per call (a raw kernel never re-enters here)
  env.assign(size_t(p.nslots), UNBOUND);
  Call c{p, torch::jit::last(*stack, p.args.size()), env, std::nullopt};
  const c10::IValue& backend = c.a[p.backend];
  if (!backend.isString() || (backend.toStringRef() != "auto" && backend.toStringRef() != Dev::NAME)) return false;
  for (const Step& s : p.steps)
    if (!(s.kind == 'X' ? s.expr(c.a, c.env) : match_tensor(s, c))) return false;
  std::optional<Tail> t = addressing(c);
  if (!t) return false;
  // the format's raw kernel: the first whose condition holds (none: Python runs it)
  const auto raw = std::find_if(p.raws.begin(), p.raws.end(),
                                [&](const RawCall& r) { return !r.when || (*r.when)(c.a, c.env); });
  if (raw == p.raws.end()) return false;
  const int64_t n = c.env[p.N];
  if (n <= 0) return true;
  // a page move's (src, dst) pairs: the Python pre-pass (kvwrite.reference.claims.unique_pairs)
  if (t->check != CHECK_OFF && p.claims == 'p' && n >= 2) return false;
  // one token writes one row: nothing to claim (its bad loc, if any, is the store's own check)
  if (t->check != CHECK_OFF && p.claims == 'r' && n >= 2 && claims_on.load(std::memory_order_relaxed)) {
    const int64_t pps = c.env[p.S], pages = c.env[p.P];
    TORCH_CHECK(pps >= 1 && pages >= 1, "kvwrite: ", p.name, ": no pool geometry for the duplicate check");
    at::Tensor out = Raw<Dev>::claim_rows(t->loc, t->loc_map, t->errors, t->dcp_rank, t->dcp_size, t->check, t->op,
                                          t->batch_indices, t->kv_indices, t->kv_indptr, pages * pps, pps, p.dcp_page);
    if (out.numel() != 0) {  // else assert mode without a duplicate: the store's own checks
      t->loc = std::move(out);
      t->batch_indices = t->kv_indices = t->kv_indptr = std::nullopt;
    }
  }
  run_raw<Dev>(c, *t, *raw);
  return true;
}

// Runs here() on the call: true (its arguments dropped) when it ran, false when it did not or
// threw a c10::Error before any write (a CPU assert's pre-scan): the caller's Python twin runs it.
template <class F>
bool ran(const c10::OperatorHandle& op, torch::jit::Stack* stack, F&& here) {
  bool done = false;
  try {
    done = here();
  } catch (const c10::Error&) {
  }
  if (done) torch::jit::drop(*stack, op.schema().arguments().size());
  return done;
}

// The kernel of every public op for one device, registered when the op's program arrived.
template <class Dev>
struct Kernel final : c10::OperatorKernel {
  const Slot& slot;
  explicit Kernel(const Slot& s) : slot(s) {}
  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
    const Program& p = *slot.current.load(std::memory_order_acquire);
    if (!ran(op, stack, [&] { return run_here<Dev>(p, op, stack); })) p.python->callBoxed(stack);
  }
};

}  // namespace api
}  // namespace kvwrite
