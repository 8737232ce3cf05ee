// DeepSeek V4 FP4 KV records (formats in kvwrite/ops/dsv4_fp4.py, rounding and special values in
// kvwrite/reference/dsv4_fp4.py): "nvfp4" 384 bytes (e4m3 blocks of 16 over the 448 NoPE values,
// bf16 RoPE, split page), "nvfp4_v41" 288 bytes (all 512 values, e4m3 scale floored at 2^-9,
// split page), "mxfp4" 368 bytes (ue8m0 blocks of 32, scales inside the token row, bf16 RoPE).
#pragma once

#include "dispatch.h"
#include "locs.h"
#include "nvfp4.h"
#include "quant.h"
#include "rope_store.h"
#include "store_dsv4.h"

namespace kvwrite {

// One record's constants (kvwrite.facts.FP4_RECORDS, by code).
template <int FMT>
struct FP4Rec {
  static constexpr bool mx = FMT == 2;
  static constexpr int quant = FMT == 1 ? 512 : DSV4_NOPE, block = mx ? 32 : NVFP4_BLOCK;
  static constexpr int blocks = quant / block, rope = FMT == 1 ? 0 : DSV4_ROPE;
  static constexpr int scale_row = mx ? 16 : 32;
  static constexpr int data_row = quant / 2 + 2 * rope + (mx ? scale_row : 0);
  static constexpr int rope_at = quant / 2 + (mx ? scale_row : 0);
  static constexpr float floor = FMT == 1 ? 0.001953125f : 0.0f;  // 2^-9
};
constexpr int fp4_token_bytes(int fmt) { return fmt == 1 ? 288 : fmt == 2 ? 368 : 384; }

struct StoreDSV4FP4Params {
  const char* kv = nullptr;
  i64 kv_sn = 0;  // token stride in elements
  DType in_dtype = DType::F32;
  int fmt = 0;
  SplitPage cache;  // data_row / scale_row of the record (mxfp4: scale_row 0, scales in the row)
  LocArgs locs;
  RopeArgs rope;    // rope_store_dsv4_kv_fp4: GPT-J rotation of the RoPE part (R = 64), q in place
};

// rope_store_dsv4_kv_fp4: the same params with its rotation (ROPED bodies).
struct RopeStoreDSV4FP4Params : StoreDSV4FP4Params {};

// The block quantiser as a call of its own on the device (scalar arguments: the kernel's
// parameter struct stays in parameter space): inlined into the token loop, the NVFP4 block's 16
// values spilled beside the loop's state (sm_80 / sm_90, bf16).
#if defined(__CUDA_ARCH__)
#define KVW_ITEM __noinline__
#else
#define KVW_ITEM
#endif

// ue8m0 byte of round(log2(amax / 6)) + 127, clamped to [0, 255], from amax's bits (the
// reference's mx_scale_byte), and its value 2^(byte - 127) (byte 0: the subnormal 2^-127).
KVW_HD int mx_scale_byte(float amax) {
  const uint32_t bits = float_to_bits(amax);
  const int byte = int((bits >> 23) & 0xFFu) - 3 + int((bits & 0x7FFFFFu) >= 0x7C3B7u);
  return byte < 0 ? 0 : byte > 255 ? 255 : byte;
}
KVW_HD float mx_byte_value(int byte) { return bits_to_float(byte == 0 ? 0x00400000u : uint32_t(byte) << 23); }

// Block b of the row at `kv` + `row` (e2m1 bytes at `data`, its scale byte at `scales`).
template <int FMT, DType IN>
KVW_ITEM KVW_HD void fp4_block(const char* kv, i64 row, int b, char* data, char* scales) {
  using R = FP4Rec<FMT>;
  const i64 start = row + i64(b) * R::block;
  if constexpr (R::mx) {
    const int byte = mx_scale_byte(block_amax<IN>(kv, start, R::block));
    // special values (README): NaN -> code 0 and the block's scale byte 0xFF
    const bool nan = e2m1_run<IN>(kv, start, R::block, mx_byte_value(byte), data + b * (R::block / 2));
    scales[b] = nan ? char(0xFF) : char(byte);
  } else {
    nvfp4_block_at<IN>(kv, start, nullptr, data + b * (R::block / 2), scales + b, R::floor);
  }
}

// Host, MXFP4 bf16 rows: the record's blocks eight at a time (mxfp4_run_bf16), the blocks it
// leaves by fp4_block.
template <int FMT>
inline void fp4_mx_blocks_host(const char* kv, i64 row, char* data, char* scales) {
#if KVW_SIMD_X86
  using R = FP4Rec<FMT>;
  const uint16_t* x = reinterpret_cast<const uint16_t*>(kv) + row;
  for (uint64_t left = mxfp4_run_bf16(x, R::blocks, data, scales); left != 0; left &= left - 1)
    fp4_block<FMT, DType::BF16>(kv, row, __builtin_ctzll(left), data, scales);
#else
  (void)kv, (void)row, (void)data, (void)scales;
#endif
}

// ROPED: the RoPE part rotated first (rope_head: GPT-J pairs, rounded to IN, as
// kvwrite.reference.rope), then stored as the plain store stores it.
template <int FMT, DType IN, bool ROPED>
KVW_HD void fp4_rope_item(const StoreDSV4FP4Params& p, i64 i, i64 pos, char* data) {
  using R = FP4Rec<FMT>;
  const i64 start = i * p.kv_sn + R::quant;
  if constexpr (ROPED) {
    float rotated[R::rope > 0 ? R::rope : 1];  // IN values (fp32 holds any of them)
    rope_head<IN>(p.rope, pos, p.kv, start, rotated, 0, R::rope, nullptr);
    dsv4_rope_part<IN>(rotated, 0, R::rope, data + R::rope_at);
  } else {
    dsv4_rope_part<IN>(p.kv, start, R::rope, data + R::rope_at);
  }
}

// Token i: lanes stride over its q heads (ROPED, valid position), then its quantisation blocks
// and the RoPE part (the last work item).
template <int CHECK, int FMT, DType IN, bool ROPED>
KVW_HD void store_dsv4_fp4_token(const StoreDSV4FP4Params& p, i64 i, int lane, int nlanes) {
  using R = FP4Rec<FMT>;
  bool pos_ok = true;
  i64 pos = 0;
  Resolved r;
  if constexpr (ROPED) {
    pos = rope_position(p.rope, i, pos_ok);
    r = resolve_rope_checked<CHECK>(p.locs, p.rope, i, pos_ok, pos, lane == 0);
  } else {
    r = resolve_checked<CHECK>(p.locs, i, lane == 0);
  }
  const int nq = ROPED && pos_ok ? p.rope.Hq : 0;
  if (!r.write && nq == 0) return;
  char* data = r.write ? p.cache.data_at(r.row) : nullptr;
  char* scales = !r.write ? nullptr : R::mx ? data + R::quant / 2 : p.cache.scale_at(r.row);
#if !defined(__CUDA_ARCH__)
  constexpr bool MX_LANES = R::mx && IN == DType::BF16;  // MXFP4: the AVX2 lanes of bf16 rows
  if (nlanes == 1 && (!R::mx || (MX_LANES && simd_ok()))) {  // host: eight blocks a vector
    for (int h = 0; h < nq; ++h) rope_head<IN>(p.rope, pos, p.rope.q, i * p.rope.q_sn + h * p.rope.q_sh, p.rope.q,
                                               i * p.rope.q_sn + h * p.rope.q_sh, R::rope, nullptr);
    if (!r.write) return;
    if constexpr (MX_LANES) {
#if KVW_SIMD_X86
      if (fp4_512_ok()) {  // the whole record in one call (the RoPE part unless rotated), blocks it leaves by fp4_block
        const uint16_t* x = reinterpret_cast<const uint16_t*>(p.kv) + i * p.kv_sn;
        for (uint64_t left = mxfp4_record_512<R::blocks, ROPED ? 0 : R::rope>(x, data, scales, data + R::rope_at);
             left != 0; left &= left - 1)
          fp4_block<FMT, DType::BF16>(p.kv, i * p.kv_sn, __builtin_ctzll(left), data, scales);
        if (ROPED) fp4_rope_item<FMT, IN, ROPED>(p, i, pos, data);
        return;
      }
#endif
      fp4_mx_blocks_host<FMT>(p.kv, i * p.kv_sn, data, scales);
    } else {
#if KVW_SIMD_X86
      if constexpr (!R::mx && IN == DType::BF16) {
        if (fp4_512_ok()) {  // the whole record in one call (the RoPE part unless rotated)
          nvfp4_record_512<R::blocks, ROPED ? 0 : R::rope>(reinterpret_cast<const uint16_t*>(p.kv) + i * p.kv_sn, data,
                                                           scales, R::floor, data + R::rope_at);
          if (ROPED) fp4_rope_item<FMT, IN, ROPED>(p, i, pos, data);
          return;
        }
      }
#endif
      nvfp4_run<IN>(p.kv, i * p.kv_sn, R::blocks, nullptr, data, scales, R::floor);
    }
    if (R::rope) fp4_rope_item<FMT, IN, ROPED>(p, i, pos, data);
    return;
  }
#endif
  const int items = nq + (r.write ? R::blocks + (R::rope ? 1 : 0) : 0);
  for (int w = lane; w < items; w += nlanes) {
    if (w < nq) {
      const i64 off = i * p.rope.q_sn + w * p.rope.q_sh;
      rope_head<IN>(p.rope, pos, p.rope.q, off, p.rope.q, off, R::rope, nullptr);
    } else if (w - nq < R::blocks) {
      fp4_block<FMT, IN>(p.kv, i * p.kv_sn, w - nq, data, scales);
    } else {
      fp4_rope_item<FMT, IN, ROPED>(p, i, pos, data);
    }
  }
}

template <int CHECK, int FMT, DType IN, bool ROPED>
struct StoreDSV4FP4Token {
  static constexpr int check = CHECK;
  KVW_HD void operator()(const StoreDSV4FP4Params& p, i64 i, int lane, int nlanes) const {
    store_dsv4_fp4_token<CHECK, FMT, IN, ROPED>(p, i, lane, nlanes);
  }
};

// ROPED: rope_store_dsv4_kv_fp4 (formats with a bf16 RoPE part: nvfp4, mxfp4).
template <bool ROPED, class F>
void dispatch_store_dsv4_fp4(const StoreDSV4FP4Params& p, int check, F&& f) {
  const auto fmts = [&](auto c, auto in) {
    const int q = ROPED ? p.rope.Hq : 0;
    switch (p.fmt) {
      case 0: return f(TypeTag<StoreDSV4FP4Token<c.value, 0, in.value, ROPED>>{}, q + FP4Rec<0>::blocks + 1);
      case 1:
        if constexpr (!ROPED) return f(TypeTag<StoreDSV4FP4Token<c.value, 1, in.value, false>>{}, FP4Rec<1>::blocks);
        return;
      default: return f(TypeTag<StoreDSV4FP4Token<c.value, 2, in.value, ROPED>>{}, q + FP4Rec<2>::blocks + 1);
    }
  };
  with_check(check, [&](auto c) { with_float_dtype(p.in_dtype, [&](auto in) { fmts(c, in); }); });
}

// The bytes a token moves (the CPU runner's grain, ops.cpp) and the body by params type (KVW_BODY,
// dispatch.h: the build derives its units from each line).
inline i64 token_bytes(const StoreDSV4FP4Params& p) {
  return i64(DSV4_NOPE + DSV4_ROPE) * (dtype_size(p.in_dtype) + 1) * QUANT_WEIGHT;
}
inline i64 token_bytes(const RopeStoreDSV4FP4Params& p) {  // + the rotation of q's heads
  return token_bytes(static_cast<const StoreDSV4FP4Params&>(p)) +
         i64(p.rope.Hq) * DSV4_ROPE * dtype_size(p.in_dtype) * QUANT_WEIGHT;
}
KVW_BODY(StoreDSV4FP4Params, dispatch_store_dsv4_fp4<false>)
KVW_BODY(RopeStoreDSV4FP4Params, dispatch_store_dsv4_fp4<true>)

}  // namespace kvwrite

// The host side (KVW_HOST: ops.cpp, cuda_ops.cpp; never a CUDA unit): tensors -> the V4 FP4 stores'
// params and their op table rows (registry.h).
#ifdef KVW_HOST
#include "../host.h"

#define KVW_OPS_STORE_DSV4_FP4(X) \
  X(store_dsv4_kv_fp4, reg::Bind<&store_dsv4_fp4_params>::plain, \
    "(Tensor kv, Tensor(a!) cache, int pool_page_size, int fmt_code, " KVW_TAIL_NO_TABLE ") -> ()") \
  X(rope_store_dsv4_kv_fp4, reg::Bind<&rope_store_dsv4_fp4_params>::plain, \
    "(Tensor positions, Tensor kv, Tensor cos_sin, Tensor(b!)? q, Tensor(a!) cache, " \
    "int pool_page_size, int fmt_code, " \
    KVW_TAIL_NO_TABLE ") -> ()")

namespace kvwrite {

inline StoreDSV4FP4Params store_dsv4_fp4_params(const Tensor& kv, const Tensor& cache, int64_t pool_page_size,
                                                int64_t fmt, const Tensor& loc, const OptTensor& loc_map,
                                                const OptTensor& errors, int64_t dcp_rank, int64_t dcp_size,
                                                int64_t check, int64_t op) {
  TORCH_CHECK(kv.dim() == 2 && kv.size(1) == DSV4_NOPE + DSV4_ROPE && kv.stride(1) == 1,
              "kvwrite: kv must be [N, 512], contiguous in its last dim");
  TORCH_CHECK(fmt >= 0 && fmt <= 2, "kvwrite: fmt must be 0 (nvfp4), 1 (nvfp4_v41) or 2 (mxfp4)");
  TORCH_CHECK(pool_page_size >= 1 && cache.dim() == 2 && cache.size(1) == pool_page_size * fp4_token_bytes(int(fmt)),
              "kvwrite: the FP4 record page does not hold pool_page_size tokens");
  check_same_device(kv, cache, "cache");
  const int token = fp4_token_bytes(int(fmt)), scale_row = fmt == 2 ? 0 : 32;
  StoreDSV4FP4Params p;
  p.kv = static_cast<const char*>(kv.data_ptr());
  p.kv_sn = kv.stride(0);
  p.in_dtype = dtype_of(kv);
  p.fmt = int(fmt);
  paged_locs(p, kv, cache, pool_page_size, token - scale_row, scale_row, loc, loc_map, errors, dcp_rank, dcp_size,
             check, op);
  return p;
}

// rope_store_dsv4_kv_fp4: the store's parameters plus the GPT-J rotation of the 64 RoPE values
// (cos_sin [max_position, 64]) and of q [n, Hq, 64] in place (none: zero heads).
inline RopeStoreDSV4FP4Params rope_store_dsv4_fp4_params(const Tensor& positions, const Tensor& kv, const Tensor& cos_sin,
                                                     const OptTensor& q, const Tensor& cache, int64_t pool_page_size,
                                                     int64_t fmt, const Tensor& loc, const OptTensor& loc_map,
                                                     const OptTensor& errors, int64_t dcp_rank, int64_t dcp_size,
                                                     int64_t check, int64_t op) {
  TORCH_CHECK(fmt == 0 || fmt == 2, "kvwrite: the fused RoPE store takes fmt 0 (nvfp4) or 2 (mxfp4)");
  RopeStoreDSV4FP4Params p{
      store_dsv4_fp4_params(kv, cache, pool_page_size, fmt, loc, loc_map, errors, dcp_rank, dcp_size, check, op)};
  const Tensor qt = q.has_value() ? *q : kv.new_empty({kv.size(0), 0, DSV4_ROPE});
  p.rope = rope_args(positions, qt, cos_sin, c10::nullopt, c10::nullopt, 0.0, false, kv, DSV4_ROPE);
  TORCH_CHECK(p.rope.R == DSV4_ROPE, "kvwrite: cos_sin must be [max_position, 64]");
  return p;
}

// A fused RoPE store (host.h ROPED): the CPU checks a token's position with its loc.
template <>
constexpr bool ROPED<RopeStoreDSV4FP4Params> = true;

}  // namespace kvwrite
#endif  // KVW_HOST
