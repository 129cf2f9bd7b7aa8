// Pieces the CPU kernels share: AVX-512 bf16 <-> float32 loads and stores, register transposes and row
// reductions, a reciprocal, GELU, and the AMX tile setup. Header-only and included by several kernels;
// kernels.py hashes this file into the extension's name, so an edit here rebuilds them all.
#pragma once

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#if defined(CPU_CAPABILITY_AVX512)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>

namespace polyvec_cpu {

#if defined(CPU_CAPABILITY_AVX512)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // bf16 is the top half of a float32
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {  // round to nearest even (values are finite)
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}

// r[i][j] -> r[j][i] for a 16 x 16 block of 32-bit elements: 32-bit, then 64-bit interleaves within 128-bit
// lanes (lane L of u[g][c] then holds column 4L + c of rows 4g..4g+3), then two rounds of lane shuffles.
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  __m512i u[4][4];
  for (int g = 0; g < 4; ++g) {
    u[g][0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[g][1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[g][2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[g][3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i lo01 = _mm512_shuffle_i32x4(u[0][c], u[1][c], 0x88);
    const __m512i hi01 = _mm512_shuffle_i32x4(u[0][c], u[1][c], 0xdd);
    const __m512i lo23 = _mm512_shuffle_i32x4(u[2][c], u[3][c], 0x88);
    const __m512i hi23 = _mm512_shuffle_i32x4(u[2][c], u[3][c], 0xdd);
    r[c] = _mm512_shuffle_i32x4(lo01, lo23, 0x88);       // column c: lane 0 of every row group
    r[4 + c] = _mm512_shuffle_i32x4(hi01, hi23, 0x88);   // column 4 + c: lane 1
    r[8 + c] = _mm512_shuffle_i32x4(lo01, lo23, 0xdd);   // column 8 + c: lane 2
    r[12 + c] = _mm512_shuffle_i32x4(hi01, hi23, 0xdd);  // column 12 + c: lane 3
  }
}

// dst[c][r] = src[r][c] for the m (<= 16) rows of a block of 32-bit elements, `width` (a multiple of 16) per
// row; src rows src_stride elements apart, dst rows dst_stride apart; dst[c][m, 16) = 0. The attention kernels'
// key transposes (float32 keys, bf16 key pairs), whose strided stores element by element were costly.
inline void transpose_rows16(const uint32_t* src, int64_t src_stride, int64_t m, int64_t width, uint32_t* dst,
                             int64_t dst_stride) {
  for (int64_t c0 = 0; c0 < width; c0 += 16) {
    __m512i r[16];
    for (int64_t j = 0; j < 16; ++j)
      r[j] = j < m ? _mm512_loadu_si512(src + j * src_stride + c0) : _mm512_setzero_si512();
    transpose16x16(r);
    for (int64_t j = 0; j < 16; ++j) _mm512_storeu_si512(dst + (c0 + j) * dst_stride, r[j]);
  }
}

// Lane r of the result: the 16 lanes of v[r] combined by op (max or add), for r < 16. A transpose-and-reduce
// (four levels of shuffles, 46 instructions) instead of 16 horizontal reductions of ~8 dependent steps each.
template <typename Op>
inline __m512 reduce_rows16(__m512* v, Op op) {
  __m512 u[8], w[4], z[2];
  for (int k = 0; k < 8; ++k)  // rows 2k, 2k+1: halves of 256 bits folded; each row in two 128-bit lanes
    u[k] = op(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
              _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
  for (int k = 0; k < 4; ++k)  // rows 4k .. 4k+3, one per 128-bit lane, 4 floats each
    w[k] = op(_mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], 0x88),
              _mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], 0xDD));
  for (int k = 0; k < 2; ++k)  // in 128-bit lane l: rows 8k + l and 8k + 4 + l, 2 floats each
    z[k] = op(_mm512_shuffle_ps(w[2 * k], w[2 * k + 1], 0x44), _mm512_shuffle_ps(w[2 * k], w[2 * k + 1], 0xEE));
  // lane 4l + e: row 4e + l
  const __m512 r = op(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), r);
}

// 1 / d: the 14-bit estimate and one Newton step (~1e-8 relative), far cheaper than a vector divide.
inline __m512 recip16(__m512 d) {
  const __m512 r = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f)));
}

// act: 0 none, 1 GELU (erf), 2 GELU (tanh approximation).
// GELU without libm: erf as a rational function (11 FMAs and a reciprocal; GELU within 1e-6 of PyTorch's, and
// cheaper than Abramowitz & Stegun 7.1.26 with an exp), tanh(z) = 1 - 2 / (exp(2z) + 1).
inline __m512 gelu16(__m512 x, int act) {
  const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.f);
  if (act == 1) {  // erf(z) as an odd rational function on [-4, 4] (XLA's float erf; ±1 beyond): FMAs only
    const __m512 z = _mm512_max_ps(_mm512_min_ps(_mm512_mul_ps(x, _mm512_set1_ps(static_cast<float>(M_SQRT1_2))),
                                                 _mm512_set1_ps(4.f)), _mm512_set1_ps(-4.f));
    const __m512 z2 = _mm512_mul_ps(z, z);
    __m512 p = _mm512_set1_ps(-2.72614225801306e-10f);
    for (float a : {2.77068142495902e-08f, -2.10102402082508e-06f, -5.69250639462346e-05f, -7.34990630326855e-04f,
                    -2.95459980854025e-03f, -1.60960333262415e-02f})
      p = _mm512_fmadd_ps(p, z2, _mm512_set1_ps(a));
    __m512 q = _mm512_set1_ps(-1.45660718464996e-05f);
    for (float b : {-2.13374055278905e-04f, -1.68282697438203e-03f, -7.37332916720468e-03f, -1.42647390514189e-02f})
      q = _mm512_fmadd_ps(q, z2, _mm512_set1_ps(b));
    const __m512 erf = _mm512_mul_ps(_mm512_mul_ps(p, z), recip16(q));
    return _mm512_mul_ps(_mm512_mul_ps(half, x), _mm512_add_ps(one, erf));
  }
  const __m512 sign = _mm512_and_ps(x, _mm512_set1_ps(-0.f));
  const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
  const __m512 z = _mm512_abs_ps(_mm512_mul_ps(_mm512_set1_ps(0.7978845608f),
                                               _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), x3, x)));
  const __m512 e = at::vec::Vectorized<float>(_mm512_min_ps(_mm512_add_ps(z, z), _mm512_set1_ps(80.f))).exp_u20();
  const __m512 tanh_abs = _mm512_fnmadd_ps(_mm512_set1_ps(2.f), recip16(_mm512_add_ps(e, one)), one);
  return _mm512_mul_ps(_mm512_mul_ps(half, x), _mm512_add_ps(one, _mm512_or_ps(tanh_abs, sign)));
}

inline bool has_avx512_bf16() {
  static const bool yes = __builtin_cpu_supports("avx512bf16");
  return yes;
}

// AMX (Sapphire Rapids and later): eight tiles of 16 rows x 64 bytes, the only shape the kernels use.
struct TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline TileConfig make_tile_config() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  return cfg;
}
// A global: GCC drops stores to a stack copy that only ldtilecfg reads.
alignas(64) inline const TileConfig kTileConfig = make_tile_config();

// The tile configuration belongs to the thread: each parallel task begins and ends its own.
__attribute__((target("amx-tile,amx-bf16"))) inline void amx_begin() { _tile_loadconfig(&kTileConfig); }
__attribute__((target("amx-tile,amx-bf16"))) inline void amx_end() { _tile_release(); }

// Whether AMX may be used at all: the CPU platform's `amx` switch (EngineConfig.kernels), set through
// torch.ops.polyvec.set_amx_enabled; one flag for every kernel of the library (an inline variable).
inline std::atomic<bool> amx_enabled{true};

inline bool amx_ready() {
  static const bool hardware = [] {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    if (!((edx >> 22) & 1) || !((edx >> 24) & 1)) return false;  // AMX-BF16, AMX-TILE
    if (!has_avx512_bf16()) return false;
    // Linux hands out the tile state on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return hardware && amx_enabled.load(std::memory_order_relaxed);
}
#else
inline std::atomic<bool> amx_enabled{true};
inline bool amx_ready() { return false; }
#endif

}  // namespace polyvec_cpu
