// The raw ops of the kvwrite_ext library from KVW_OPS (csrc/README.md). A device policy (ops.cpp Cpu,
// cuda_ops.cpp Cuda) has NAME, TYPE and `run(params, check, ref)`: ref is the call's first tensor.
#pragma once

#ifndef KVW_HOST
#error "registry.h needs the body headers' host sections: build the host units with -DKVW_HOST (kvwrite._ext)"
#endif

#include <torch/library.h>

#include "bodies.h"  // every body header with its host section, and KVW_OPS (kvw_ops.h)
#include "host.h"

namespace kvwrite {

// A typed raw kernel called with its arguments as IValues (schema order; api.h run_raw), no dispatcher.
template <class Ret, class... A>
void call_unboxed(Ret (*f)(A...), std::vector<c10::IValue>& s) {
  TORCH_CHECK(s.size() == sizeof...(A), "kvwrite: a raw kernel takes ", sizeof...(A), " arguments, got ", s.size());
  [&]<size_t... I>(std::index_sequence<I...>) {
    f(std::move(s[I]).template to<std::decay_t<A>>()...);
  }(std::index_sequence_for<A...>{});
}

// The raw ops' names in KVW_OPS order (Raw<Dev>::boxed's index).
inline const char* const RAW_NAMES[] = {
#define KVW_NAME(op, bind, schema) #op,
    KVW_OPS(KVW_NAME)
#undef KVW_NAME
};

// One device's raw kernels by op name (Raw<Dev>::claim_rows ...), and by index into RAW_NAMES
// with IValue arguments (Raw<Dev>::boxed: api.h's generic launcher).
template <class Dev>
struct Raw {
#define KVW_RAW(op, bind, schema) static constexpr auto op = &bind<Dev>;
  KVW_OPS(KVW_RAW)
#undef KVW_RAW
  static void boxed(size_t i, std::vector<c10::IValue>& s) {
    static void (*const fns[])(std::vector<c10::IValue>&) = {
#define KVW_BOXED(op, bind, schema) [](std::vector<c10::IValue>& s) { call_unboxed(&bind<Dev>, s); },
        KVW_OPS(KVW_BOXED)
#undef KVW_BOXED
    };
    fns[i](s);
  }
};

}  // namespace kvwrite
