// The CUDA device policy (csrc/README.md): the .cu units' launchers on the current stream.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "engines.h"  // api.h, registry.h (torch/library.h, host.h: at::empty)
#include "launch.h"

namespace kvwrite {
namespace {

void check_launch(cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, "kvwrite: CUDA kernel launch failed: ", cudaGetErrorString(err));
}

struct Cuda {
  static constexpr const char* NAME = "cuda";
  static constexpr c10::DeviceType TYPE = c10::DeviceType::CUDA;

  // the fused RoPE stores' rotated k (k_pe) in [n, row] scratch rows (stream-ordered: capturable)
  template <class P>
  static void run(P p, int64_t check, const Tensor& ref) {
    const c10::cuda::CUDAGuard guard(ref.device());
    Tensor scratch;
    if constexpr (HAS_SCRATCH<P>) {
      const ScratchRow r = scratch_row(p);
      scratch = at::empty({locs_of(p).n, r.elems * r.elem_bytes}, ref.options().dtype(at::kByte));
      p.scratch = static_cast<char*>(scratch.data_ptr());
      p.scratch_sn = r.elems;
    }
    check_launch(launch(p, int(check), c10::cuda::getCurrentCUDAStream()));
  }

  // the duplicate-row pre-pass: guard's loc the store runs on; assert: empty (a device assert)
  static Tensor run(ClaimParams p, int64_t check, const Tensor& loc) {
    const c10::cuda::CUDAGuard guard(loc.device());
    const i64 slots = claim_slots(p.a.n);
    const Tensor keys = at::empty({slots}, loc.options().dtype(at::kLong));
    const Tensor first = at::empty({slots}, loc.options().dtype(at::kInt));
    Tensor out = at::empty({check == CHECK_GUARD ? p.a.n : 0}, loc.options().dtype(at::kLong));
    p.keys = keys.data_ptr<int64_t>();
    p.first = reinterpret_cast<uint32_t*>(first.data_ptr<int32_t>());
    p.mask = slots - 1;
    p.out = check == CHECK_GUARD ? out.data_ptr<int64_t>() : nullptr;
    if (p.a.n > 0) check_launch(launch(p, int(check), c10::cuda::getCurrentCUDAStream()));
    return out;
  }
};

}  // namespace
}  // namespace kvwrite

TORCH_LIBRARY_IMPL(kvwrite_ext, CUDA, m) { kvwrite::engines::impl_device<kvwrite::Cuda>(m); }
