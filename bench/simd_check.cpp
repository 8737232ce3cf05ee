// Exhaustive check of the cpu backend's AVX2 / AVX-512 conversions (csrc/kvwrite/simd_x86.h, simd_avx512.h) against the
// scalar code every backend shares: every one of the 2^32 fp32 bit patterns through fp8_codes8
// (both variants) for e4m3 / e5m2 / e4m3fnuz and through e2m1_codes8 (divisor 1), compared with
// fp8_bits / e2m1_code; the streaming bf16 lanes: div_cr8 (x * RN(1/s) with one FMA correction)
// against the division for every (8-bit x mantissa, 24-bit s mantissa) pair and for 11-bit (fp16)
// x mantissas too, and fp8_bf16_run / int8_bf16_run over every bf16 pattern for a spread of
// scales, int8_bf16_run_rf for every bf16 amax and every |x| <= amax, the per token-head int8 runs'
// scale table for every bf16 amax, fp8_ds_mla's tiles by one multiply a value for every bf16 amax
// and every |x| <= amax (and by the byte lookup, `simd_check fp8ds`: those two alone), the static-scale code
// tables, the NVFP4 / MXFP4 bf16 lanes (e2m1 by 16-bit compares)
// (`simd_check bf16`: these alone,
// about a minute). Not part of `make test` (about a minute
// per format on one core). It checks the lanes simd_level() picks (AVX-512 where the CPU has it):
// run it again with KVWRITE_CPU_SIMD=avx2 for the AVX2 lanes:
//   g++ -O2 -ffp-contract=off -fno-trapping-math -std=c++17 bench/simd_check.cpp -o /tmp/simd_check && /tmp/simd_check
//   KVWRITE_CPU_SIMD=avx2 /tmp/simd_check
#include <cstdio>

#include <cmath>
#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "../csrc/kvwrite/kv_quant.h"
#include "../csrc/kvwrite/nvfp4.h"
#include "../csrc/kvwrite/store_dsv4_fp4.h"
#include "../csrc/kvwrite/store_dsv4.h"

using namespace kvwrite;

template <class Vec, class Ref>
__attribute__((target("avx2,f16c"))) long count_diffs(const char* what, Vec vec, Ref ref) {
  long bad = 0;
  for (uint64_t i = 0; i < (1ull << 32); i += 8) {
    alignas(32) uint32_t in[8];
    alignas(32) int32_t out[8];
    for (int k = 0; k < 8; ++k) in[k] = uint32_t(i + k);
    _mm256_store_si256(reinterpret_cast<__m256i*>(out), vec(_mm256_load_ps(reinterpret_cast<const float*>(in))));
    for (int k = 0; k < 8; ++k) {
      if (uint32_t(out[k]) != ref(bits_to_float(in[k])) && bad++ < 4)
        std::printf("%s: %08x gives %02x, scalar %02x\n", what, in[k], out[k], ref(bits_to_float(in[k])));
    }
  }
  std::printf("%s: %ld of 2^32 differ\n", what, bad);
  return bad;
}

template <class F>
long check_fp8(const char* what) {
  return count_diffs(what, [](__m256 x) __attribute__((target("avx2,f16c"))) { return fp8_codes8<F>(x); },
                     [](float x) { return uint32_t(fp8_bits<F>(x)); });
}

// div_cr8(a, b) == a / b for a = every mantissa of `abits` explicit bits in [1, 2) and b = every
// fp32 mantissa in [1, 2) (exponents only scale both sides exactly in cr_div_ok's range).
__attribute__((target("avx2,f16c,fma"))) long check_div(int abits) {
  const int na = 1 << abits;
  std::vector<float> as(na);
  for (int k = 0; k < na; ++k) as[k] = 1.0f + float(k) / float(na);
  long bad = 0;
  for (uint32_t mb = 0; mb < (1u << 23); ++mb) {
    const float b = bits_to_float(0x3F800000u | mb);
    const __m256 vb = _mm256_set1_ps(b), vr = _mm256_set1_ps(1.0f / b);
    for (int k = 0; k < na; k += 8) {
      const __m256 a = _mm256_loadu_ps(as.data() + k);
      bad += __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(div_cr8(a, vb, vr), _mm256_div_ps(a, vb), _CMP_NEQ_UQ)));
    }
  }
  std::printf("div_cr8, %d-bit x mantissas x every fp32 s mantissa: %ld differ\n", abits + 1, bad);
  return bad;
}

// fp8_bf16_run<F> (its DYN lanes on their domain, and int8_bf16_run on the rows without NaN / inf)
// over every bf16 pattern.
template <class F>
long check_bf16_run(const char* what, const std::vector<float>& scales) {
  std::vector<uint16_t> x(65536);
  for (int i = 0; i < 65536; ++i) x[i] = uint16_t(i);
  std::vector<char> out(65536);
  long bad = 0;
  for (const float s : scales) {
    if (!cr_div_ok(s)) continue;
    fp8_bf16_run<F>(x.data(), 65536, s, out.data());
    for (int i = 0; i < 65536; ++i) {
      const uint8_t want = fp8_bits<F>(daz(bf16_to_float(x[i])) / s);
      if (uint8_t(out[i]) != want && bad++ < 4) std::printf("%s s=%a: %04x gives %02x, scalar %02x\n", what, s, i, uint8_t(out[i]), want);
    }
    if (s > 0) {  // the DYN lanes on their domain: finite |x| <= max * s (1 + 2^-23), a dynamic scale's row
      fp8_bf16_run<F, true>(x.data(), 65536, s, out.data());
      for (int i = 0; i < 65536; ++i) {
        const float v = bf16_to_float(x[i]);
        if (!(std::fabs(double(v)) <= double(fp8_max<F>()) * s * (1.0 + 0x1p-23))) continue;
        const uint8_t want = fp8_bits<F>(daz(v) / s);
        if (uint8_t(out[i]) != want && bad++ < 4) std::printf("%s DYN s=%a: %04x gives %02x, scalar %02x\n", what, s, i, uint8_t(out[i]), want);
      }
    }
    if constexpr (std::is_same<F, E4M3>::value) {  // int8 on the finite patterns (|x| < 0x7F80)
      const Quantizer<Int8Fmt> q(s, RULE_RNE);
      for (int base = 0; base < 65536; base += 64) {  // 64: one step of the AVX-512 lanes
        bool finite = true;
        for (int j = 0; j < 64; ++j)  // int8_bf16_run's domain: |x / s| < 2^31 (a dynamic scale's rows)
          finite = finite && (x[base + j] & 0x7FFF) < 0x7F80 && std::fabs(bf16_to_float(x[base + j]) / s) < 1e9f;
        if (!finite) continue;
        int8_bf16_run(x.data() + base, 64, s, out.data() + base);
        for (int j = 0; j < 64; ++j) {
          const int i = base + j;
          const uint8_t want = q(load_quant<DType::BF16>(x.data(), i));
          if (uint8_t(out[i]) != want && bad++ < 4) std::printf("int8 s=%a: %04x gives %02x, scalar %02x\n", s, i, uint8_t(out[i]), want);
        }
      }
    }
  }
  std::printf("%s: %ld differ over %zu scales x 2^16\n", what, bad, scales.size());
  return bad;
}

// int8_bf16_run_rf (the int8 codes of a dynamic scale's row by one FMA a value) against the
// scalar int8 code: every positive finite bf16 amax (every one the lanes take), its rf from
// int8_fast_recip and from int8_fast_recips8 (eight amax values at a time), every bf16 x with
// |x| <= amax (both signs; x = +-amax / 2 is the one tie the rule has to settle).
long check_int8_rf() {
  return with_lanes([&](auto l) {
    std::vector<uint16_t> x(2 * 0x7F80 + 64);
    std::vector<char> out(x.size());
    long bad = 0, rows = 0, values = 0, exact = 0;
    for (uint32_t a0 = 0; a0 < 0x7F80; a0 += 8) {
      uint32_t raw[8];
      float sc[8], rc[8], rf8[8];
      for (int k = 0; k < 8; ++k) raw[k] = a0 + k;
      if (!dynamic_scales8(raw, 127.0f, DYN_SCALE_FLOOR, sc, rc)) continue;
      l.int8_fast_recips8(raw, sc, DYN_SCALE_FLOOR, rf8);
      for (int k = 0; k < 8; ++k) {
        const float amax = bf16_policy_amax(raw[k]), s = dynamic_scale<Int8Fmt>(amax);
        const float rf = l.int8_fast_recip(amax, s, DYN_SCALE_FLOOR);
        if (rf8[k] != rf && bad++ < 4) std::printf("int8 rf: amax %a gives %a, eight at a time %a\n", amax, rf, rf8[k]);
        if (rf == 0.0f) {
          exact += cr_div_ok(s);
          continue;
        }
        int n = 0;
        for (uint32_t m = 0; m <= raw[k]; ++m) {
          x[n++] = uint16_t(m);
          x[n++] = uint16_t(m | 0x8000);
        }
        while (n % 64 != 0) x[n++] = 0;
        l.int8_bf16_run_rf(x.data(), n, out.data(), rf);
        const Quantizer<Int8Fmt> q(s, RULE_RNE);
        for (int i = 0; i < n; ++i) {
          const uint8_t want = q(bf16_to_float(x[i]));
          if (uint8_t(out[i]) != want && bad++ < 4)
            std::printf("int8 rf: amax %a x %04x gives %02x, scalar %02x\n", amax, x[i], uint8_t(out[i]), want);
        }
        ++rows;
        values += n;
      }
    }
    std::printf("int8 rf lanes: %ld differ over %ld amax values, %ld codes (%ld amax values left to the exact lanes)\n",
                bad, rows, values, exact);
    return bad;
  });
}

// The per token-head int8 runs (int8_head_runs_512, AVX-512 only): its scale table against
// dynamic_scale / int8_fast_recip over every bf16 amax bit pattern (NaN / inf included), then
// runs of 128 values (the amax with a random sign, amax / 2 and its bf16 neighbours, random |x| <=
// amax), 64 runs a call over every amax pattern: the runs it leaves are the ones the table
// declines, the others' scales and codes are the scalar ones.
long check_int8_head_runs() {
  if (simd_level() < 2) return 0;
  long bad = 0, tab = 0, left_ok = 0;
  for (uint32_t raw = 0; raw < 0x8000; ++raw) {
    const float amax = bf16_policy_amax(raw), s = amax < 0.0f ? 0.0f : dynamic_scale<Int8Fmt>(amax);
    const float rf = amax < 0.0f ? 0.0f : int8_fast_recip(amax, s, DYN_SCALE_FLOOR);
    float ts = 0.0f, trf = 0.0f;
    if (!int8_scale_tab1(raw, ts, trf)) continue;
    ++tab;
    if ((ts != s || trf != rf || rf == 0.0f) && bad++ < 4) std::printf("int8 table: amax %04x gives s %a rf %a, want %a %a\n", raw, ts, trf, s, rf);
  }
  constexpr int D = 128, RUNS = 64;
  std::mt19937 g(3);
  std::vector<uint16_t> x(D * RUNS);
  std::vector<char> out(D * RUNS);
  std::vector<float> sc(RUNS);
  std::vector<HeadRun> r(RUNS);
  for (int u = 0; u < RUNS; ++u) r[u] = {x.data() + u * D, out.data() + u * D, &sc[u]};
  for (uint32_t a0 = 0; a0 < 0x8000; a0 += RUNS) {
    for (int u = 0; u < RUNS; ++u) {
      const uint32_t a = a0 + uint32_t(u);
      const float amax = bf16_to_float(uint16_t(a)), half = bf16_to_float(uint16_t(float_to_bits(amax * 0.5f) >> 16));
      uint16_t* row = x.data() + u * D;
      for (int j = 0; j < D; ++j) {
        const uint32_t v = j == 0 ? a : j < 4 && a >= 0x100 && a < 0x7F80 ? (float_to_bits(half) >> 16) + uint32_t(j) - 2 : g() % (a + 1);
        row[j] = uint16_t((v > a ? a : v) | (g() & 1) << 15);
      }
      std::shuffle(row, row + D, g);
    }
    const uint64_t left = int8_head_runs_512<0>(r.data(), RUNS, D);  // D at run time, then at compile time
    const std::vector<char> run_time = out;
    const std::vector<float> run_time_sc = sc;
    if ((int8_head_runs_512<D>(r.data(), RUNS, D) != left || out != run_time || sc != run_time_sc) && bad++ < 4)
      std::printf("int8 head runs: D at compile time differs (amax %04x..)\n", a0);
    for (int u = 0; u < RUNS; ++u) {
      const uint32_t a = a0 + uint32_t(u);
      float ts, trf;
      const bool want_left = !int8_scale_tab1(a, ts, trf);
      if (((left >> u) & 1) != want_left && bad++ < 4) std::printf("int8 head runs: amax %04x left %d\n", a, int((left >> u) & 1));
      if (want_left) {
        ++left_ok;
        continue;
      }
      const float s = dynamic_scale<Int8Fmt>(bf16_policy_amax(a));
      if (sc[u] != s && bad++ < 4) std::printf("int8 head runs: amax %04x scale %a, want %a\n", a, sc[u], s);
      const Quantizer<Int8Fmt> q(s, RULE_RNE);
      for (int j = 0; j < D; ++j) {
        const uint8_t want = q(bf16_to_float(x[u * D + j]));
        if (uint8_t(out[u * D + j]) != want && bad++ < 4)
          std::printf("int8 head runs: amax %04x x %04x gives %02x, scalar %02x\n", a, x[u * D + j], uint8_t(out[u * D + j]), want);
      }
    }
  }
  std::printf("int8 head runs: %ld differ (table: %ld amax values; %ld runs left to quant_kv_head)\n", bad, tab, left_ok);
  return bad;
}

// Every bf16 |x| <= a, both signs, ascending, into x, zeros up to a multiple of pad; returns the count.
int every_below(uint32_t a, std::vector<uint16_t>& x, int pad) {
  int n = 0;
  for (uint32_t m = 0; m <= a; ++m) {
    x[n++] = uint16_t(m);
    x[n++] = uint16_t(m | 0x8000);
  }
  while (n % pad != 0) x[n++] = 0;
  return n;
}

// fp8_ds_mla's tiles by one multiply a value (AVX-512 only): every bf16 amax bit pattern with every
// bf16 |x| <= amax (both signs) as one tile through fp8_ds_tiles_512 (it declines exactly the amax
// values outside its table's exponents; else its scale is ds_mla_scale(amax) and its codes the
// scalar e4m3 codes of x / s: fp8_bf16_run_512's RF lanes where the table has an rf, the division
// where not).
long check_fp8_ds() {
  if (simd_level() < 2) return 0;
  std::vector<uint16_t> x(2 * 0x8000 + 64);
  std::vector<char> out(x.size());
  long bad = 0, tiles = 0, rf_tiles = 0, declined = 0, codes = 0;
  for (uint32_t a = 0; a < 0x8000; ++a) {
    const int n = every_below(a, x, 64);
    float s = 0.0f;
    const bool in = Fp8DsTab::covers(a);
    if (!fp8_ds_tiles_512(x.data(), 1, n, out.data(), &s)) {
      declined += 1;
      if (in && bad++ < 4) std::printf("fp8 ds tiles: amax %04x declined\n", a);
      continue;
    }
    const float want_s = ds_mla_scale(bf16_to_float(uint16_t(a)));
    if ((!in || s != want_s) && bad++ < 4) std::printf("fp8 ds tiles: amax %04x scale %a, want %a\n", a, s, want_s);
    ++tiles;
    rf_tiles += fp8_ds_tab().rf[a & 0x7F] != 0;
    for (int i = 0; i < n; ++i) {
      const uint8_t want = fp8_bits<E4M3>(daz(bf16_to_float(x[i])) / want_s);
      if (uint8_t(out[i]) != want && bad++ < 4)
        std::printf("fp8 ds tiles: amax %04x x %04x gives %02x, scalar %02x\n", a, x[i], uint8_t(out[i]), want);
    }
    codes += n;
  }
  std::printf("fp8 ds tiles: %ld differ over %ld amax values (%ld by one multiply, %ld by the division; %ld declined), "
              "%ld codes\n", bad, tiles, rf_tiles, tiles - rf_tiles, declined, codes);
  return bad;
}

// fp8_ds_mla's tiles by the byte lookup (fp8_ds_codes, AVX-512 only): every bf16 amax in the
// table's exponents, its tiles of 64 holding it and 63 of the |x| below it (alternating signs),
// from amax down past the lookup's threshold (22 binades), so each |x| is coded once by the tiles
// that take the lookup and, near the bottom, once by the arithmetic lanes; against the scalar codes.
long check_fp8_ds_lookup() {
  if (simd_level() < 2) return 0;
  if (!fp8_ds_codes().ok) { std::printf("fp8 ds lookup: the table failed its own check\n"); return 1; }
  long bad = 0, codes = 0, looked = 0;
  std::vector<uint16_t> x;
  std::vector<char> out;
  for (uint32_t a = FP8DS_TAB_E0 << 7; a < uint32_t(FP8DS_TAB_E0 + FP8DS_TAB_NE) << 7; ++a) {
    const float s = ds_mla_scale(bf16_to_float(uint16_t(a)));
    const uint32_t lo = fp8_ds_codes().lo[a & 0x7F] + ((a >> 7) - 20) * 128;
    x.clear();
    for (uint32_t v = a, k = 0; v + 22 * 128 > a && v > 0; --v, ++k) {
      if (x.size() % 64 == 0) x.push_back(uint16_t(a));
      x.push_back(uint16_t(v | (k & 1) << 15));
    }
    while (x.size() % 64 != 0) x.push_back(uint16_t(a));
    out.resize(x.size());
    float sc[16];
    for (size_t t0 = 0; t0 < x.size(); t0 += 16 * 64) {
      const int tiles = int(std::min<size_t>(16, (x.size() - t0) / 64));
      if (!fp8_ds_tiles_512(x.data() + t0, tiles, 64, out.data() + t0, sc)) {
        if (bad++ < 4) std::printf("fp8 ds lookup: amax %04x declined\n", a);
        continue;
      }
      for (int w = 0; w < tiles; ++w) {
        uint32_t low = 0xFFFF;
        for (int i = 0; i < 64; ++i) low = std::min<uint32_t>(low, x[t0 + 64 * w + i] & 0x7FFF);
        looked += low >= lo;
      }
    }
    for (size_t i = 0; i < x.size(); ++i) {
      const uint8_t want = fp8_bits<E4M3>(bf16_to_float(x[i]) / s);
      if (uint8_t(out[i]) != want && bad++ < 4)
        std::printf("fp8 ds lookup: amax %04x x %04x gives %02x, scalar %02x\n", a, x[i], uint8_t(out[i]), want);
    }
    codes += long(x.size());
  }
  std::printf("fp8 ds lookup: %ld differ over %ld codes (%ld tiles by the lookup)\n", bad, codes, looked);
  return bad;
}

// e4m3_lookup_run_512 (dynamic fp8 scales, AVX-512 only): every bf16 amax, the run of every |x| <=
// amax of both signs in ascending order (so its 64s above the lookup's threshold take the lookup,
// those below the division lanes) under dynamic_scale<E4M3>(amax), against the scalar codes; a scale
// the lookup declines goes by the division lanes, as the store does.
long check_e4m3_lookup_run() {
  if (simd_level() < 2) return 0;
  std::vector<uint16_t> x(2 * 0x8000 + 64);
  std::vector<char> out(x.size());
  long bad = 0, runs = 0, declined = 0, codes = 0;
  for (uint32_t a = 0x80; a < 0x7F80; ++a) {
    const int n = every_below(a, x, 32);
    const float s = dynamic_scale<E4M3>(bf16_to_float(uint16_t(a)));
    if (!e4m3_lookup_run_512(x.data(), n, a, s, out.data())) {
      ++declined;
      continue;
    }
    ++runs;
    for (int i = 0; i < n; ++i) {
      const uint8_t want = fp8_bits<E4M3>(daz(bf16_to_float(x[i])) / s);
      if (uint8_t(out[i]) != want && bad++ < 4)
        std::printf("e4m3 lookup run: amax %04x x %04x gives %02x, scalar %02x\n", a, x[i], uint8_t(out[i]), want);
    }
    codes += n;
  }
  std::printf("e4m3 lookup runs: %ld differ over %ld amax values (%ld declined), %ld codes\n", bad, runs, declined, codes);
  return bad;
}

// e4m3_head_runs_512 (per token-head fp8 scales): every finite bf16 amax as a head of 128 (amax
// and the 127 |x| below it, alternating signs): its scale against dynamic_scale<E4M3> and its codes
// against the scalar codes, or left (the scale is not the table's: the floor, the table's exponents).
long check_e4m3_head_runs() {
  if (simd_level() < 2) return 0;
  std::vector<uint16_t> x(128);
  std::vector<char> out(128);
  long bad = 0, runs = 0, left = 0;
  for (uint32_t a = 0; a < 0x7F80; ++a) {
    for (uint32_t i = 0; i < 128; ++i) x[i] = uint16_t((a > i ? a - i : 0) | (i & 1) << 15);
    float sc = 0.0f;
    const HeadRun r{x.data(), out.data(), &sc};
    const float amax = daz(bf16_to_float(uint16_t(a)));
    const float s = dynamic_scale<E4M3>(amax);
    if (e4m3_head_runs_512<128>(&r, 1, 128, DYN_SCALE_FLOOR) != 0) {
      ++left;
      const bool table = Fp8DsTab::covers(a) && s != DYN_SCALE_FLOOR;
      if (table && bad++ < 4) std::printf("e4m3 head runs: amax %04x left\n", a);
      continue;
    }
    ++runs;
    if (sc != s && bad++ < 4) std::printf("e4m3 head runs: amax %04x scale %a, want %a\n", a, sc, s);
    for (int i = 0; i < 128; ++i) {
      const uint8_t want = fp8_bits<E4M3>(daz(bf16_to_float(x[i])) / s);
      if (uint8_t(out[i]) != want && bad++ < 4)
        std::printf("e4m3 head runs: amax %04x x %04x gives %02x, scalar %02x\n", a, x[i], uint8_t(out[i]), want);
    }
  }
  std::printf("e4m3 head runs: %ld differ over %ld amax values (%ld left to quant_kv_head)\n", bad, runs, left);
  return bad;
}

// 2^16 bf16 values in blocks of `block`: block k's amax is amax_mul * d (d = scale(c), c cycling
// over [c0, c1)), the rest the e2m1 rounding thresholds B d and their bf16 neighbours, zeros and
// subnormals, random signs: every scale's ties and near-ties.
template <class Scale>
std::vector<uint16_t> fp4_threshold_rows(int block, Scale scale, int c0, int c1, float amax_mul) {
  static constexpr float B[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  std::vector<uint16_t> x(1 << 16);
  std::mt19937 g(5);
  for (int k = 0; k * block < int(x.size()); ++k) {
    const float d = scale(c0 + k % (c1 - c0));
    const uint16_t sign = uint16_t((g() & 1) << 15);
    x[k * block] = uint16_t(sign | float_to_bits(amax_mul * d) >> 16);
    for (int e = 1; e < block; ++e) {
      const uint32_t r = g();
      const uint16_t t = uint16_t(float_to_bits(B[r % 7] * d) >> 16);
      const uint16_t v = (r >> 3) % 8 == 0 ? uint16_t((r >> 6) & 0x7F) : uint16_t(t + int((r >> 3) % 3) - 1);
      x[k * block + e] = uint16_t(v | ((r >> 10) & 1) << 15);
    }
  }
  return x;
}

// Run lengths in blocks: every partial group of the 8- and 16-block lanes and whole ones.
static constexpr int RUNS[8] = {28, 61, 16, 1, 5, 9, 13, 32};

// nvfp4_run<IN> (the arithmetic lanes: fp16 / fp32 rows, global scales) against the scalar
// nvfp4_block over the rows x (elements as IN's bits), runs of RUNS blocks, with and without
// global scales (ones the lanes decline too: subnormal, negative, huge, inf, NaN) and the V4.1 floor.
template <DType IN, class T>
long check_nvfp4_rows(const char* what, const std::vector<T>& x) {
  const int nbk = int(x.size()) / 16;
  long bad = 0;
  for (const float gl : {0.0f, 0.5f, 1e-30f, 3.7f, 1e-3f, 0.37f, 1e-40f, -2.0f, 3e38f, INFINITY, NAN})
    for (const float fl : {0.0f, 1.0f / 512}) {
      const float* gp = gl == 0.0f ? nullptr : &gl;
      std::vector<char> b1(nbk * 8), s1(nbk), b2(nbk * 8), s2(nbk);
      for (int k0 = 0, r = 0; k0 < nbk; k0 += RUNS[r % 8], ++r) {
        const int m = nbk - k0 < RUNS[r % 8] ? nbk - k0 : RUNS[r % 8];
        nvfp4_run<IN>(x.data(), i64(k0) * 16, m, gp, b1.data() + k0 * 8, s1.data() + k0, fl);
      }
      for (int k = 0; k < nbk; ++k)
        nvfp4_block([&](int e) { return load_float<IN>(x.data(), k * 16 + e); }, gp, b2.data() + k * 8, s2.data() + k, fl);
      long d = 0;
      for (int i = 0; i < nbk * 8; ++i) d += b1[i] != b2[i];
      for (int i = 0; i < nbk; ++i) d += s1[i] != s2[i];
      if (d != 0 && bad < 4) std::printf("%s g=%g floor=%g: %ld bytes differ\n", what, gl, fl, d);
      bad += d;
    }
  return bad;
}

__attribute__((target("f16c"))) uint16_t float_to_half(float f) { return _cvtss_sh(f, 0); }  // RNE

// check_nvfp4_rows over fp16 and fp32 rows: every fp16 pattern (in order, shuffled, and scaled so
// block scales land anywhere), the bf16 threshold rows (every e4m3 scale's ties) widened, and as
// fp32 one ulp either side of each tie.
long check_nvfp4_fp16_fp32() {
  const int n = 1 << 16;
  std::vector<uint16_t> thr = fp4_threshold_rows(16, [](int c) { return e4m3_to_float(uint8_t(c)); }, 1, 127, 6.0f);
  std::vector<uint16_t> h(n);
  std::vector<float> f(n);
  long bad = 0;
  for (const float mul : {1.0f, 1e-3f, 3e-5f, -1.0f}) {  // -1: shuffled
    for (int i = 0; i < n; ++i) h[i] = mul == -1.0f ? uint16_t(i) : float_to_half(half_to_float(uint16_t(i)) * mul);
    if (mul == -1.0f) std::shuffle(h.begin(), h.end(), std::mt19937(6));
    bad += check_nvfp4_rows<DType::F16>("nvfp4 fp16", h);
  }
  for (int i = 0; i < n; ++i) h[i] = float_to_half(bf16_to_float(thr[i]));  // ties representable in fp16
  bad += check_nvfp4_rows<DType::F16>("nvfp4 fp16 ties", h);
  std::mt19937 g(7);
  for (const float mul : {1.0f, 1e-30f, 3e20f, 0.0f}) {  // 0: random fp32 patterns
    for (int i = 0; i < n; ++i) {
      const uint32_t r = g();
      f[i] = mul == 0.0f ? bits_to_float(r) : bits_to_float((float_to_bits(bf16_to_float(thr[i])) + (r % 3) - 1)) * mul;
    }
    bad += check_nvfp4_rows<DType::F32>("nvfp4 fp32", f);
  }
  std::printf("nvfp4 fp16 / fp32 lanes, global scales: %ld bytes differ\n", bad);
  return bad;
}

// nvfp4_run on bf16 rows (nvfp4_blocks8_bf16, or the generic lanes for a group it declines)
// against the scalar nvfp4_block, every bf16 pattern, scaled so block scales land anywhere, with
// and without global scales and the V4.1 floor.
long check_nvfp4_bf16() {
  const int n = 1 << 16;
  std::vector<uint16_t> x(n);
  long bad = 0;
  std::vector<uint16_t> thr = fp4_threshold_rows(16, [](int c) { return e4m3_to_float(uint8_t(c)); }, 1, 127, 6.0f);
  for (const float mul : {1.0f, 1e-30f, 3e20f, 0.37f, -1.0f, 0.0f}) {  // -1: shuffled patterns, 0: thresholds
    for (int i = 0; i < n; ++i) x[i] = uint16_t(float_to_bits(bf16_to_float(uint16_t(i)) * mul) >> 16);
    if (mul == -1.0f) std::shuffle(x.begin(), x.end(), std::mt19937(3));
    if (mul == 0.0f) std::copy(thr.begin(), thr.begin() + n, x.begin());
    for (const float gl : {0.0f, 0.5f, 1e-30f, 3.7f, 1e-3f, 0.37f, 1e-40f, -2.0f, 3e38f, INFINITY, NAN})
      for (const float fl : {0.0f, 1.0f / 512}) {
        const float* gp = gl == 0.0f ? nullptr : &gl;
        std::vector<char> b1(n / 2), s1(n / 16), b2(n / 2), s2(n / 16);
        for (int h = 0; h < n / 128; ++h) nvfp4_run<DType::BF16>(x.data(), h * 128, 8, gp, b1.data() + h * 64, s1.data() + h * 8, fl);
        for (int k0 = 0, r = 0; k0 < n / 16; k0 += RUNS[r % 8], ++r) {  // runs of 1 .. 61 blocks (partial groups)
          const int m = n / 16 - k0 < RUNS[r % 8] ? n / 16 - k0 : RUNS[r % 8];
          std::vector<char> b3(m * 8), s3(m);
          nvfp4_run<DType::BF16>(x.data(), k0 * 16, m, gp, b3.data(), s3.data(), fl);
          for (int i = 0; i < m * 8; ++i) bad += b3[i] != b1[k0 * 8 + i];
          for (int i = 0; i < m; ++i) bad += s3[i] != s1[k0 + i];
        }
        for (int k = 0; k < n / 16; ++k)
          nvfp4_block([&](int e) { return load_float<DType::BF16>(x.data(), k * 16 + e); }, gp, b2.data() + k * 8, s2.data() + k, fl);
        for (int i = 0; i < n / 2; ++i) bad += b1[i] != b2[i];
        for (int i = 0; i < n / 16; ++i) bad += s1[i] != s2[i];
      }
  }
  for (const float s : {1.0f, 0.5f, 0x1p-100f, 0x1p100f, 0x1p-3f, 0x1p-127f, 3.0f, 0x1p-101f}) {  // e2m1_run (MXFP4 scales)
    std::vector<char> b1(n / 2);
    for (int k0 = 0; k0 < n; k0 += 32) {
      bool nan = false;
      for (int e = k0; e < k0 + 32; ++e) nan = nan || (x[e] & 0x7FFF) > 0x7F80;
      bad += e2m1_run<DType::BF16>(x.data(), k0, 32, s, b1.data() + k0 / 2) != nan;
    }
    for (int j = 0; j < n / 2; ++j)
      bad += uint8_t(b1[j]) != (e2m1_code(load_quant<DType::BF16>(x.data(), 2 * j) / s) |
                                (e2m1_code(load_quant<DType::BF16>(x.data(), 2 * j + 1) / s) << 4));
  }
  thr = fp4_threshold_rows(32, [](int e) { return bits_to_float(uint32_t(e) << 23); }, 1, 255, 8.0f);
  for (const float mul : {1.0f, 1e-30f, 3e20f, 0.37f, 1e-38f, -1.0f, 0.0f}) {  // MXFP4 blocks (the DeepSeek V4 record's rule)
    for (int i = 0; i < n; ++i) x[i] = uint16_t(float_to_bits(bf16_to_float(uint16_t(i)) * mul) >> 16);
    if (mul == -1.0f) std::shuffle(x.begin(), x.end(), std::mt19937(4));
    if (mul == 0.0f) std::copy(thr.begin(), thr.begin() + n, x.begin());
    for (int k0 = 0, nb = 8; k0 < n / 32; k0 += nb, nb = nb == 8 ? 6 : 8) {
      const int m = n / 32 - k0 < nb ? n / 32 - k0 : nb;
      char b3[128], s3[8];
      const uint64_t left = mxfp4_run_bf16(x.data() + 32 * k0, m, b3, s3);
      for (int b = 0; b < m; ++b) {
        uint32_t amax = 0;
        bool special = false;  // a NaN or an inf
        for (int e = 0; e < 32; ++e) {
          amax = std::max(amax, abs_bits<DType::BF16>(x.data(), 32 * (k0 + b) + e));
          special = special || (x[32 * (k0 + b) + e] & 0x7FFF) >= 0x7F80;
        }
        const int byte = mx_scale_byte(bits_to_float(amax));
        if ((left >> b) & 1) {  // left to the caller: only where the rule says so
          bad += !(special || byte < 27 || byte > 227);
          continue;
        }
        bad += uint8_t(s3[b]) != uint8_t(byte);
        const float sv = mx_byte_value(byte);
        for (int j = 0; j < 16; ++j) {
          const int e = 32 * (k0 + b) + 2 * j;
          bad += uint8_t(b3[16 * b + j]) != (e2m1_code(load_quant<DType::BF16>(x.data(), e) / sv) |
                                             (e2m1_code(load_quant<DType::BF16>(x.data(), e + 1) / sv) << 4));
        }
      }
    }
  }
  thr = fp4_threshold_rows(32, [](int e) { return bits_to_float(uint32_t(e) << 23); }, 100, 254, 6.0f);  // amax 6 d: d exact
  for (const float mul : {1.0f, 1e-30f, 3e20f, 1e-6f, -1.0f, 0.0f}) {  // the V4 indexer's MXFP4 blocks (dsv4_scale)
    for (int i = 0; i < n; ++i) x[i] = uint16_t(float_to_bits(bf16_to_float(uint16_t(i)) * mul) >> 16);
    if (mul == -1.0f) std::shuffle(x.begin(), x.end(), std::mt19937(8));
    if (mul == 0.0f) std::copy(thr.begin(), thr.begin() + n, x.begin());
    for (int k0 = 0, r = 0; k0 < n / 32; k0 += RUNS[r % 8], ++r) {
      const int m = std::min(n / 32 - k0, std::min(RUNS[r % 8], 64));
      std::vector<char> b3(16 * m), s3(m);
      uint64_t left = 0;
      if (!mxfp4_ceil_run_bf16(x.data() + 32 * k0, m, b3.data(), s3.data(), left)) break;  // not the AVX-512 level
      for (int b = 0; b < m; ++b) {
        const i64 at = 32 * i64(k0 + b);
        bool special = false;
        for (int e = 0; e < 32; ++e) special = special || (x[at + e] & 0x7FFF) >= 0x7F80;
        if ((left >> b) & 1) {  // left to the caller: a NaN or an inf only
          bad += !special;
          continue;
        }
        const float sv = dsv4_scale(block_amax<DType::BF16>(x.data(), at, 32), 6.0f);
        char want[16];
        bad += special + e2m1_run<DType::BF16>(x.data(), at, 32, sv, want) + (s3[b] != ue8m0_byte(sv));
        for (int j = 0; j < 16; ++j) bad += b3[16 * b + j] != want[j];
      }
    }
  }
  std::printf("nvfp4 bf16 lanes, e2m1 runs, mxfp4 blocks: %ld bytes differ\n", bad);
  return bad;
}

// bf16_absmax_raw (the max of the |x| bits) over runs of every length n % 16 == 0 up to 256 from
// every offset of a shuffled copy of all bf16 patterns.
long check_absmax() {
  std::vector<uint16_t> x(65536 + 256);
  std::mt19937 g(1);
  for (int i = 0; i < int(x.size()); ++i) x[i] = uint16_t(i);
  std::shuffle(x.begin(), x.end(), g);
  long bad = 0;
  for (int n = 16; n <= 256; n += 16)
    for (int at = 0; at + n <= int(x.size()); at += 61) {
      uint32_t want = 0;
      for (int j = 0; j < n; ++j) want = (x[at + j] & 0x7FFFu) > want ? x[at + j] & 0x7FFFu : want;
      bad += bf16_absmax_raw(x.data() + at, n) != want;
    }
  std::printf("bf16_absmax_raw: %ld runs differ\n", bad);
  return bad;
}

// e4m3_pow2_run_512 (the V4 KV record's tiles) against the scalar e4m3 code of x / s for every
// power-of-two s = 2^(es - 127) the record's scale rule gives (es 105 .. 254) and every bf16 x with
// |x| / s <= 448 (the rule's bound), both signs, zeros and bf16 subnormals included.
long check_e4m3_pow2() {
  if (simd_level() < 2) return 0;
  std::vector<uint16_t> x;
  std::vector<char> out;
  long bad = 0, codes = 0;
  for (int es = 105; es <= 254; ++es) {
    const float s = bits_to_float(uint32_t(es) << 23);
    x.clear();
    for (uint32_t m = 0; m < 0x7F80; ++m)
      if (bf16_to_float(uint16_t(m)) / s <= 448.0f) x.push_back(uint16_t(m)), x.push_back(uint16_t(m | 0x8000));
    while (x.size() % 64 != 0) x.push_back(0);
    out.assign(x.size(), 0);
    e4m3_pow2_run_512(x.data(), int(x.size()), es, out.data());
    for (size_t i = 0; i < x.size(); ++i) {
      const uint8_t want = fp8_bits<E4M3>(bf16_to_float(x[i]) / s);
      if (uint8_t(out[i]) != want && bad++ < 4)
        std::printf("e4m3 pow2: es %d x %04x gives %02x, scalar %02x\n", es, x[i], uint8_t(out[i]), want);
    }
    codes += long(x.size());
  }
  std::printf("e4m3 pow2 lanes: %ld differ over %ld codes (150 scales)\n", bad, codes);
  long rules = 0;  // pow2_448_exponent against the three power-of-two scale rules, every finite bf16 amax
  const auto rule = [&](const char* name, auto&& scale_of) {
    const int floor_e = int(float_to_bits(scale_of(0.0f)) >> 23);
    for (uint32_t a = 0; a < 0x7F80; ++a) {
      const float want = scale_of(bf16_to_float(uint16_t(a)));
      if (float_to_bits(want) != uint32_t(pow2_448_exponent(a, floor_e)) << 23 && rules++ < 4)
        std::printf("pow2 scale %s: amax %04x gives e %d, want %a\n", name, a, pow2_448_exponent(a, floor_e), want);
    }
  };
  rule("dsv4", [](float a) { return dsv4_scale(a, 448.0f); });
  rule("indexer ue8m0", [](float a) { return indexer_scale(a, true); });
  rule("ds_mla pow2", [](float a) { return ds_mla_scale_pow2(a); });
  std::printf("power-of-two scale rules by exponent: %ld differ over 3 x %d bf16 amax values\n", rules, 0x7F80);
  return bad + rules;
}

int main(int argc, char** argv) {
  if (!simd_ok()) { std::printf("the portable loops are in use (no AVX2 + F16C + FMA, or KVWRITE_CPU_SIMD=0)\n"); return 0; }
  std::printf("lanes: %s (KVWRITE_CPU_SIMD=avx2 checks the AVX2 ones)\n", simd_level() == 2 ? "AVX-512" : "AVX2");
  if (argc > 1 && std::string(argv[1]) == "fp8ds") return check_fp8_ds_lookup() + check_e4m3_lookup_run() + check_e4m3_head_runs() + check_fp8_ds() != 0;  // those alone
  long bad = check_absmax();
  const bool bf16_only = argc > 1 && std::string(argv[1]) == "bf16";  // `simd_check bf16`: the bf16 lanes alone
  if (!bf16_only) bad += check_fp8<E4M3>("e4m3") + check_fp8<E5M2>("e5m2") + check_fp8<E4M3FNUZ>("e4m3fnuz");
  if (!bf16_only) bad += count_diffs("e2m1", [](__m256 x) __attribute__((target("avx2,f16c"))) { return e2m1_codes8(x, 1.0f); },
                     [](float x) { return e2m1_code(x / 1.0f); });
  bad += check_div(7) + check_div(10);
  std::vector<float> scales = {1.0f, -1.0f, 3.0f, 1.0f / 3, 0.37f, -0.0173f, 448.0f, 1.0f / 448, 9.094947e-13f, 1.0995116e12f};
  std::mt19937 g(0);
  for (int k = 0; k < 2000; ++k) scales.push_back(bits_to_float((g() & 0x807FFFFFu) | (uint32_t(87 + g() % 80) << 23)));
  bad += check_bf16_run<E4M3>("e4m3 bf16 lanes", scales) + check_bf16_run<E5M2>("e5m2 bf16 lanes", scales);
  bad += check_int8_rf() + check_int8_head_runs() + check_fp8_ds() + check_fp8_ds_lookup() + check_e4m3_lookup_run() + check_e4m3_head_runs() + check_e4m3_pow2();
  bad += check_nvfp4_bf16() + check_nvfp4_fp16_fp32();
  {  // the static-scale code tables (fp8_bf16_table_run, blocks it declines by the arithmetic lanes)
    std::vector<uint16_t> x(65536);
    for (int i = 0; i < 65536; ++i) x[i] = uint16_t(i);
    std::vector<char> out(65536);
    long tb = 0;
    for (const float s : scales) {
      quant_heads<DType::BF16, E4M3>(x.data(), 0, 128, 512, 128, &s, 0, out.data(), 128);
      for (int i = 0; i < 65536; ++i) tb += uint8_t(out[i]) != fp8_bits<E4M3>(daz(bf16_to_float(uint16_t(i))) / s);
      quant_heads<DType::BF16, E5M2>(x.data(), 0, 128, 512, 128, &s, 0, out.data(), 128);
      for (int i = 0; i < 65536; ++i) tb += uint8_t(out[i]) != fp8_bits<E5M2>(daz(bf16_to_float(uint16_t(i))) / s);
    }
    std::printf("fp8 code tables: %ld differ over %zu scales x 2^16 x 2 formats\n", tb, scales.size());
    bad += tb;
  }
  return bad != 0;
}
