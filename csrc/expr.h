// An op's own checks as expressions (`spec.rule(expr=...)`): the rule text compiled once, evaluated
// per call (syntax and semantics: csrc/README.md "Rule expressions").
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace kvwrite {
namespace expr {

constexpr int64_t UNBOUND = INT64_MIN;

// A value: an integer (bools too), a float, a string, or None.
struct Val {
  enum Kind { INT, FLOAT, STR, NONE } kind = INT;
  int64_t i = 0;
  const std::string* s = nullptr;
  double f = 0;
};

// A node: 'i' literal int, 's' literal str, 'N' None, 'a' argument, 'e' env slot, 'l' local,
// 'f' function, 'u' unary, 'b' binary (each its code in i: BIN_OPS / fn_code), '?' conditional,
// '=' assignment (to kids[0]).
struct Node {
  char kind = 'i';
  int64_t i = 0;
  std::string str;
  std::vector<Node> kids;
};

constexpr size_t MAX_LOCALS = 8;

// What a compiled expression reads: the call's arguments and env, and its locals.
struct Scope {
  at::ArrayRef<c10::IValue> args;
  std::vector<int64_t>& env;
  std::array<int64_t, MAX_LOCALS> locals{};
};

// The names an expression may use (the op's program): argument index / env slot by name.
struct Names {
  std::function<int(const std::string&)> arg, slot;
  std::vector<std::string> locals;
};

// A dtype by its torch name (the spec's dtypes, a rule's dtype literals).
inline std::optional<at::ScalarType> scalar_type(const std::string& n) {
  static const std::pair<const char*, at::ScalarType> types[] = {
      {"float32", at::kFloat}, {"float16", at::kHalf}, {"bfloat16", at::kBFloat16}, {"float64", at::kDouble},
      {"uint8", at::kByte}, {"int8", at::kChar}, {"int16", at::kShort}, {"int32", at::kInt}, {"int64", at::kLong},
      {"bool", at::kBool}, {"float8_e4m3fn", at::kFloat8_e4m3fn}, {"float8_e5m2", at::kFloat8_e5m2},
      {"float8_e4m3fnuz", at::kFloat8_e4m3fnuz}};
  for (const auto& t : types)
    if (n == t.first) return t.second;
  return std::nullopt;
}

// Binary operators (C precedence, lowest first) and functions as one-char codes, decoded at compile.
struct BinOp {
  const char* text;
  char code;
  int prec;
};
constexpr BinOp BIN_OPS[] = {{"||", '|', 0}, {"&&", '&', 1}, {"==", '=', 2}, {"!=", '!', 2}, {"<=", 'l', 3},
                             {">=", 'g', 3}, {"<", '<', 3},  {">", '>', 3},  {"+", '+', 4},  {"-", '-', 4},
                             {"*", '*', 5},  {"/", '/', 5},  {"%", '%', 5}};
inline char fn_code(const std::string& f) {
  static const std::pair<const char*, char> fns[] = {{"none", 'n'}, {"isint", 'i'}, {"isbool", 'b'}, {"dim", 'd'},
                                                     {"dtype", 't'}, {"itemsize", 's'}, {"size", 'S'},
                                                     {"stride", 'T'}, {"same_sizes", '#'}};
  for (const auto& x : fns)
    if (f == x.first) return x.second;
  return 0;
}

class Parser {
 public:
  Parser(const std::string& text, Names& names) : t_(text), names_(names) {}

  std::vector<Node> statements() {
    std::vector<Node> out;
    while (skip(), pos_ < t_.size()) {
      out.push_back(assignment());
      if (!eat(";")) break;
    }
    skip();
    TORCH_CHECK(pos_ == t_.size(), "kvwrite: bad rule expression at '", t_.substr(pos_), "' in: ", t_);
    return out;
  }

 private:
  Node assignment() {
    const size_t start = pos_;
    std::string name = ident();
    if (!name.empty() && eat("=") && (skip(), pos_ == t_.size() || t_[pos_] != '='))
      return Node{'=', 0, "", {target(name), conditional()}};
    pos_ = start;
    return conditional();
  }
  int64_t local(const std::string& name) const {
    const auto it = std::find(names_.locals.begin(), names_.locals.end(), name);
    return it == names_.locals.end() ? -1 : it - names_.locals.begin();
  }
  Node target(const std::string& name) {
    if (names_.slot(name) >= 0) return Node{'e', names_.slot(name)};
    if (local(name) >= 0) return Node{'l', local(name)};
    names_.locals.push_back(name);
    TORCH_CHECK(names_.locals.size() <= MAX_LOCALS, "kvwrite: more than ", MAX_LOCALS, " locals in rule: ", t_);
    return Node{'l', int64_t(names_.locals.size() - 1)};
  }
  Node conditional() {
    Node c = binary(0);
    if (!eat("?")) return c;
    Node a = conditional();
    TORCH_CHECK(eat(":"), "kvwrite: expected ':' in rule: ", t_);
    return Node{'?', 0, "", {c, a, conditional()}};
  }
  const BinOp* op_here() {
    skip();
    for (const BinOp& o : BIN_OPS)
      if (t_.compare(pos_, std::char_traits<char>::length(o.text), o.text) == 0) return &o;
    return nullptr;
  }
  Node binary(int min) {
    Node lhs = unary();
    for (const BinOp* op = op_here(); op != nullptr && op->prec >= min; op = op_here()) {
      pos_ += std::char_traits<char>::length(op->text);
      lhs = Node{'b', op->code, "", {lhs, binary(op->prec + 1)}};
    }
    return lhs;
  }
  Node unary() {
    if (eat("!")) return Node{'u', '!', "", {unary()}};
    if (eat("-")) return Node{'u', '-', "", {unary()}};
    return primary();
  }
  Node primary() {
    skip();
    if (eat("(")) {
      Node n = conditional();
      TORCH_CHECK(eat(")"), "kvwrite: expected ')' in rule: ", t_);
      return n;
    }
    if (pos_ < t_.size() && std::isdigit(static_cast<unsigned char>(t_[pos_]))) {
      size_t digits = 0;
      Node n{'i', std::stoll(t_.substr(pos_), &digits)};
      pos_ += digits;
      return n;
    }
    if (eat("'")) {
      const size_t end = t_.find('\'', pos_);
      TORCH_CHECK(end != std::string::npos, "kvwrite: unterminated string in rule: ", t_);
      Node n{'s', 0, t_.substr(pos_, end - pos_)};
      pos_ = end + 1;
      return n;
    }
    const bool arg = eat("$");
    const std::string name = ident();
    TORCH_CHECK(!name.empty(), "kvwrite: expected a name at '", t_.substr(pos_), "' in rule: ", t_);
    if (arg) {
      TORCH_CHECK(names_.arg(name) >= 0, "kvwrite: rule names $", name, ", not an argument: ", t_);
      return Node{'a', names_.arg(name)};
    }
    if (eat("(")) {
      Node f{'f', fn_code(name)};
      TORCH_CHECK(f.i != 0, "kvwrite: rule calls ", name, ", not a function: ", t_);
      while (!eat(")")) {
        f.kids.push_back(conditional());
        eat(",");
        TORCH_CHECK(pos_ < t_.size(), "kvwrite: unterminated call in rule: ", t_);
      }
      return f;
    }
    if (name == "None") return Node{'N'};
    if (auto d = scalar_type(name)) return Node{'i', int64_t(*d)};
    if (local(name) >= 0) return Node{'l', local(name)};
    TORCH_CHECK(names_.slot(name) >= 0, "kvwrite: rule names ", name, ", not an env slot or local: ", t_);
    return Node{'e', names_.slot(name)};
  }
  std::string ident() {
    skip();
    size_t end = pos_;
    while (end < t_.size() && (std::isalnum(static_cast<unsigned char>(t_[end])) || t_[end] == '_')) ++end;
    if (end == pos_ || std::isdigit(static_cast<unsigned char>(t_[pos_]))) return "";
    std::string s = t_.substr(pos_, end - pos_);
    pos_ = end;
    return s;
  }
  void skip() {
    while (pos_ < t_.size() && std::isspace(static_cast<unsigned char>(t_[pos_]))) ++pos_;
  }
  bool eat(const char* s) {
    skip();
    const size_t n = std::char_traits<char>::length(s);
    if (t_.compare(pos_, n, s) != 0) return false;
    pos_ += n;
    return true;
  }

  const std::string& t_;
  Names& names_;
  size_t pos_ = 0;
};

inline std::optional<Val> eval(const Node& n, Scope& s);

inline std::optional<int64_t> int_of(const Node& n, Scope& s) {
  const auto v = eval(n, s);
  return v && v->kind == Val::INT ? std::optional<int64_t>(v->i) : std::nullopt;
}

inline std::optional<Val> num(int64_t i) { return Val{Val::INT, i}; }

inline std::optional<Val> same_sizes(const at::Tensor& a, const Node& n, Scope& s) {
  if (n.kids.size() != 4 || n.kids[2].kind != 'a' || !s.args[n.kids[2].i].isTensor()) return std::nullopt;
  const at::Tensor& b = s.args[n.kids[2].i].toTensor();
  const auto i = int_of(n.kids[1], s), j = int_of(n.kids[3], s);
  if (!i || !j || *i < 0 || *j < 0 || *i > a.dim() || *j > b.dim() || a.dim() - *i != b.dim() - *j)
    return num(0);
  for (int64_t k = 0; *i + k < a.dim(); ++k)
    if (a.size(*i + k) != b.size(*j + k)) return num(0);
  return num(1);
}

inline std::optional<Val> call(const Node& n, Scope& s) {
  if (n.kids.empty() || n.kids[0].kind != 'a') return std::nullopt;
  const c10::IValue& v = s.args[n.kids[0].i];
  if (n.i == 'n') return num(v.isNone());
  if (n.i == 'i') return num(v.isInt());
  if (n.i == 'b') return num(v.isBool());
  if (!v.isTensor()) return std::nullopt;
  const at::Tensor& t = v.toTensor();
  if (n.i == '#') return same_sizes(t, n, s);
  if (n.i == 'd') return num(t.dim());
  if (n.i == 't') return num(int64_t(t.scalar_type()));
  if (n.i == 's') return num(int64_t(t.element_size()));
  const auto i = n.kids.size() == 2 ? int_of(n.kids[1], s) : std::nullopt;
  if (!i || *i < -t.dim() || *i >= t.dim()) return std::nullopt;
  return num(n.i == 'S' ? t.size(*i) : t.stride(*i));
}

template <class T>
std::optional<Val> compare(T x, T y, char op) {
  switch (op) {
    case '=': return num(x == y);
    case '!': return num(x != y);
    case '<': return num(x < y);
    case 'l': return num(x <= y);
    case '>': return num(x > y);
    case 'g': return num(x >= y);
    default: return std::nullopt;
  }
}

// A comparison with a float operand (as Python compares int and float); no float arithmetic.
inline std::optional<Val> compare(const Val& a, const Val& b, char op) {
  if ((a.kind != Val::INT && a.kind != Val::FLOAT) || (b.kind != Val::INT && b.kind != Val::FLOAT))
    return op == '!' ? num(1) : op == '=' ? num(0) : std::nullopt;
  return compare(a.kind == Val::FLOAT ? a.f : double(a.i), b.kind == Val::FLOAT ? b.f : double(b.i), op);
}

inline std::optional<Val> eval(const Node& n, Scope& s) {
  switch (n.kind) {
    case 'i': return num(n.i);
    case 's': return Val{Val::STR, 0, &n.str};
    case 'N': return Val{Val::NONE};
    case 'e': return s.env[n.i] == UNBOUND ? std::nullopt : num(s.env[n.i]);
    case 'l': return num(s.locals[n.i]);
    case 'a': {
      const c10::IValue& v = s.args[n.i];
      if (v.isInt()) return num(v.toInt());
      if (v.isBool()) return num(v.toBool());
      if (v.isDouble()) return Val{Val::FLOAT, 0, nullptr, v.toDouble()};
      if (v.isNone()) return Val{Val::NONE};
      if (v.isString()) return Val{Val::STR, 0, &v.toStringRef()};
      return std::nullopt;
    }
    case 'f': return call(n, s);
    case '?': {
      const auto c = int_of(n.kids[0], s);
      return c ? eval(n.kids[*c ? 1 : 2], s) : std::nullopt;
    }
    case '=': {
      const auto v = int_of(n.kids[1], s);
      if (!v) return std::nullopt;
      (n.kids[0].kind == 'e' ? s.env[n.kids[0].i] : s.locals[n.kids[0].i]) = *v;
      return num(1);
    }
    case 'u': {
      const auto v = int_of(n.kids[0], s);
      return v ? num(n.i == '!' ? !*v : -*v) : std::nullopt;
    }
    default: break;
  }
  const char op = char(n.i);  // binary
  if (op == '&' || op == '|') {
    const auto a = int_of(n.kids[0], s);
    if (!a) return std::nullopt;
    if ((op == '&') != bool(*a)) return num(*a != 0);
    const auto b = int_of(n.kids[1], s);
    return b ? num(*b != 0) : std::nullopt;
  }
  const auto a = eval(n.kids[0], s), b = eval(n.kids[1], s);
  if (!a || !b) return std::nullopt;
  if (a->kind == Val::FLOAT || b->kind == Val::FLOAT) return compare(*a, *b, op);
  if (op == '=' || op == '!') {
    bool eq = a->kind == b->kind;
    if (eq && a->kind == Val::INT) eq = a->i == b->i;
    if (eq && a->kind == Val::STR) eq = *a->s == *b->s;
    return num(eq == (op == '='));
  }
  if (a->kind != Val::INT || b->kind != Val::INT) return std::nullopt;
  const int64_t x = a->i, y = b->i;
  switch (op) {
    case '+': return num(x + y);
    case '-': return num(x - y);
    case '*': return num(x * y);
    case '/': return y == 0 ? std::nullopt : num(x / y);
    case '%': return y == 0 ? std::nullopt : num(x % y);
    default: return compare(x, y, op);
  }
}

struct Rule {
  std::vector<Node> statements;

  bool operator()(at::ArrayRef<c10::IValue> args, std::vector<int64_t>& env) const {
    Scope s{args, env};
    for (const Node& st : statements)
      if (const auto v = int_of(st, s); !v || *v == 0) return false;
    return true;
  }
};

inline Rule compile(const std::string& text, Names names) {
  return Rule{Parser(text, names).statements()};
}

}  // namespace expr
}  // namespace kvwrite
