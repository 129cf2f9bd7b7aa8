// Bidirectional attention over packed (padding-free) sequences, on CPU.
//
// softmax(q k^T * scale) v for every (sequence, head) of a packed batch, read straight from the fused
// qkv projection [T, 3 * H * d] and written to [T, H * d]: no padded grid, no mask, no scatter/gather.
// Encoder sequences are short (tens to hundreds of tokens), so one (sequence, head) fits in L1/L2: its keys
// are transposed into a float32 buffer once, and each block of query rows computes scores 16 keys per
// vector FMA, a softmax in registers' width, and the value sum 16 features per FMA (float32 with AVX-512 has
// its own path, attend_f32: scores, softmax and values as three register-blocked functions, the softmax in log2
// units with a polynomial 2^x). PyTorch's general CPU flash-attention kernel spends most of its time on
// per-block overhead at these lengths and head_dim 32.
// Arithmetic is float32 whatever the storage dtype (bf16 / fp16 in, same dtype out), so results match float32
// SDPA to rounding. bf16 with head_dim % 32 == 0 has faster paths (attend_bf16): AMX tile multiplies where the
// CPU has AMX (Sapphire Rapids on), else AVX512-BF16 dot products; both multiply the stored bf16 values exactly
// and sum in float32, with a float32 softmax. Each (sequence, head) is computed alone, so a sequence's output
// does not depend on the rest of the batch. An optional additive bias ([heads, L, L] by position: MPNet's
// relative positions) or a sliding window (keys at most `window` positions from the query: ModernBERT's local
// layers) goes in as a row of score offsets per query; a window's is one shared row, read shifted.
// Long sequences without a bias or window (page images: thousands of patches) go to PyTorch's blocked
// flash-attention kernel instead, one sequence at a time (long_sequence_min has the crossover lengths).
//
// Registered as torch.ops.polyvec.varlen_attention; built on first use by polyvec/layers/kernels.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "cpu_common.h"

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using namespace polyvec_cpu;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t kW = Vec::size();  // floats per vector (16 with AVX-512, 8 with AVX2)
constexpr int kRows = 8;  // query rows per block

// Storage dtype <-> float32, in loops the compiler vectorizes (bf16 is the top half of a float32).
inline void to_float(const float* src, float* dst, int64_t n, float scale) {
  for (int64_t c = 0; c < n; ++c) dst[c] = src[c] * scale;
}
inline void to_float(const c10::BFloat16* src, float* dst, int64_t n, float scale) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t c = 0; c < n; ++c) {
    uint32_t u = static_cast<uint32_t>(bits[c]) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    dst[c] = f * scale;
  }
}
inline void to_float(const c10::Half* src, float* dst, int64_t n, float scale) {
  for (int64_t c = 0; c < n; ++c) dst[c] = static_cast<float>(src[c]) * scale;
}
inline void from_float(const float* src, float* dst, int64_t n, float mul) {
  for (int64_t c = 0; c < n; ++c) dst[c] = src[c] * mul;
}
inline void from_float(const float* src, c10::BFloat16* dst, int64_t n, float mul) {
  uint16_t* bits = reinterpret_cast<uint16_t*>(dst);
  for (int64_t c = 0; c < n; ++c) {  // round to nearest even (outputs are finite)
    float f = src[c] * mul;
    uint32_t u;
    std::memcpy(&u, &f, 4);
    bits[c] = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
}
inline void from_float(const float* src, c10::Half* dst, int64_t n, float mul) {
  for (int64_t c = 0; c < n; ++c) dst[c] = static_cast<c10::Half>(src[c] * mul);
}

// One row of float32 scores (q already scaled), in place: p = exp(s + bias - max), 0 past n_keys (n_pad is a
// multiple of kW, so the value loops can run on whole vectors); returns 1 / sum(p).
inline float softmax_row(float* sr, int64_t n_keys, int64_t n_pad, const float* bias) {
  if (bias)
    for (int64_t j = 0; j < n_keys; ++j) sr[j] += bias[j];
  Vec mvec(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + kW <= n_keys; j += kW) mvec = at::vec::maximum(mvec, Vec::loadu(sr + j));
  float m = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, mvec);
  for (; j < n_keys; ++j) m = sr[j] > m ? sr[j] : m;
  Vec sum(0.f), mv(m);
  for (j = 0; j < n_pad; j += kW) {
    Vec e = (Vec::loadu(sr + j) - mv).exp_u20();
    if (j + kW > n_keys) e = Vec::set(Vec(0.f), e, std::max<int64_t>(0, n_keys - j));
    e.store(sr + j);
    sum = sum + e;
  }
  return 1.f / at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sum);
}

// out[r][0, V * kW) = sum_t a[r][t] * b[t][0, V * kW) for R rows: every b vector loaded feeds R FMAs, and the
// R * V independent accumulator chains hide the FMA latency (V = 2: FMA-bound rather than load-bound).
template <int R, int V>
inline void rows_block(const float* a, int64_t a_stride, const float* b, int64_t b_stride, int64_t len, float* out,
                       int64_t out_stride) {
  static_assert(V == 1 || V == 2, "one or two vectors wide");
  Vec a0[R], a1[R];  // a1 unused when V = 1 (the compiler drops it)
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = Vec(0.f);
  for (int64_t t = 0; t < len; ++t) {
    const Vec b0 = Vec::loadu(b + t * b_stride), b1 = V == 2 ? Vec::loadu(b + t * b_stride + kW) : b0;
    for (int r = 0; r < R; ++r) {
      const Vec ar(a[r * a_stride + t]);
      a0[r] = at::vec::fmadd(ar, b0, a0[r]);
      if constexpr (V == 2) a1[r] = at::vec::fmadd(ar, b1, a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    a0[r].store(out + r * out_stride);
    if constexpr (V == 2) a1[r].store(out + r * out_stride + kW);
  }
}

// The R x `width` product a[R][len] . b[len][width] (width a multiple of kW): two vectors wide, then one.
template <int R>
inline void rows_times(const float* a, int64_t a_stride, const float* b, int64_t b_stride, int64_t len,
                       int64_t width, float* out, int64_t out_stride) {
  int64_t c = 0;
  for (; c + 2 * kW <= width; c += 2 * kW) rows_block<R, 2>(a, a_stride, b + c, b_stride, len, out + c, out_stride);
  for (; c < width; c += kW) rows_block<R, 1>(a, a_stride, b + c, b_stride, len, out + c, out_stride);
}

// R query rows of one head: scores s = q . kt, softmax, then o = p . v, written to out_rows.
template <int R, typename T>
void query_block(const float* q, int64_t q_stride, const float* kt, const float* v, int64_t v_stride, float* s,
                 int64_t n_keys, int64_t n_pad, int64_t d, const float* const* bias_rows, T* const* out_rows,
                 float* o) {
  rows_times<R>(q, q_stride, kt, n_pad, d, n_pad, s, n_pad);  // s[r][j] = q[r] . k[j]
  float inv_sum[R];
  for (int r = 0; r < R; ++r)
    inv_sum[r] = softmax_row(s + r * n_pad, n_keys, n_pad, bias_rows ? bias_rows[r] : nullptr);
  rows_times<R>(s, n_pad, v, v_stride, n_keys, d, o, d);  // o[r] = sum_j p[r][j] v[j]
  for (int r = 0; r < R; ++r) from_float(o + r * d, out_rows[r], d, inv_sum[r]);
}

// kt[c][r] = k[r][c] for the m (<= kW) keys of a block, k being kW rows of `cols` floats and kt's rows n_pad
// apart; kt[c][m, kW) = 0. AVX-512: 16 x 16 blocks transposed in registers (bit-identical to element by
// element, whose strided stores cost more).
inline void transpose_keys(const float* k, int64_t m, int64_t cols, float* kt, int64_t n_pad) {
#if defined(CPU_CAPABILITY_AVX512)
  transpose_rows16(reinterpret_cast<const uint32_t*>(k), cols, m, cols, reinterpret_cast<uint32_t*>(kt), n_pad);
#else
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t r = 0; r < kW; ++r) kt[c * n_pad + r] = r < m ? k[r * cols + c] : 0.f;
#endif
}

#if defined(CPU_CAPABILITY_AVX512)
#define POLYVEC_F32_AVX512 1
constexpr float kLog2e = 1.4426950408889634f;

// 2^y for y <= 0 (a softmax's shifted logits in log2 units): a fit of 2^f on [-1/2, 1/2], highest coefficient
// first, then scalef by the rounded exponent; exactly 0 below -126 (a masked key's -inf included: a clamp to
// 2^-126 there made the p . v products denormal, 3-4x slower on float32). Half the instructions of exp_u20. kExp2F32 (degree 5, relative error 2.2e-7, two float32 ulps as exp_u20) for float32 outputs;
// kExp2BF16 (degree 4, 2.7e-6) where the probabilities are rounded to bf16 anyway.
constexpr float kExp2F32[] = {0.0013266970636323094f, 0.009675459936261177f, 0.05550742521882057f,
                              0.24022121727466583f, 0.6931469440460205f, 1.0000001192092896f};
constexpr float kExp2BF16[] = {0.009560510516166687f, 0.05591703951358795f, 0.24024981260299683f,
                               0.6931219696998596f, 0.9999991655349731f};
template <int N>
inline __m512 exp2_nonpositive(__m512 y, const float (&coef)[N]) {
  const __mmask16 normal = _mm512_cmp_ps_mask(y, _mm512_set1_ps(-126.f), _CMP_GE_OQ);
  y = _mm512_max_ps(y, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(coef[0]);
  for (int i = 1; i < N; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(coef[i]));
  return _mm512_maskz_scalef_ps(normal, p, n);
}

// The real keys among the 16 starting at j (all, the last few, or none).
inline __mmask16 key_mask(int64_t j, int64_t n_keys) {
  return j + 16 <= n_keys ? 0xFFFF : j < n_keys ? (__mmask16)((1u << (n_keys - j)) - 1) : 0;
}

// Scores of R query rows against all keys of one head, as logits in log2 units (q . k times scale * log2(e),
// plus bias * log2(e)); each block of 32 keys' scores stays in registers for its scale, bias and each row's
// running maximum (mx, by lane) before being stored. Its own function, as are the softmax and p . v: inlined
// together, the compiler kept the softmax's constants in registers and spilled a key vector from this loop.
template <int R, bool kBias>
__attribute__((noinline)) void scores_f32(const float* const* q, float q_scale, const float* kt, float* s,
                                          int64_t n_keys, int64_t n_pad, int64_t d, const float* const* bias_rows,
                                          __m512* mx) {
  const __m512 qs = _mm512_set1_ps(q_scale);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) mx[r] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  auto finish = [&](int r, int64_t j, __mmask16 m, __m512 a) {
    a = _mm512_mul_ps(a, qs);
    if constexpr (kBias)
      a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, bias_rows[r] + j), _mm512_set1_ps(kLog2e), a);
    _mm512_storeu_ps(s + r * n_pad + j, a);
    mx[r] = _mm512_mask_max_ps(mx[r], m, mx[r], a);
  };
  int64_t j = 0;
  for (; j + 32 <= n_pad; j += 32) {
    __m512 a0[R], a1[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; ++c) {
      const __m512 b0 = _mm512_loadu_ps(kt + c * n_pad + j), b1 = _mm512_loadu_ps(kt + c * n_pad + j + 16);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m512 qr = _mm512_set1_ps(q[r][c]);
        a0[r] = _mm512_fmadd_ps(qr, b0, a0[r]);
        a1[r] = _mm512_fmadd_ps(qr, b1, a1[r]);
      }
    }
    const __mmask16 m0 = key_mask(j, n_keys), m1 = key_mask(j + 16, n_keys);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      finish(r, j, m0, a0[r]);
      finish(r, j + 16, m1, a1[r]);
    }
  }
  if (j < n_pad) {  // 16 keys left
    __m512 a0[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) a0[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; ++c) {
      const __m512 b0 = _mm512_loadu_ps(kt + c * n_pad + j);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) a0[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r][c]), b0, a0[r]);
    }
    const __mmask16 m0 = key_mask(j, n_keys);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) finish(r, j, m0, a0[r]);
  }
}

// p = 2^(s - max) in place for R rows (0 past n_keys); inv_sum[r] = 1 / sum(p[r]).
template <int R>
__attribute__((noinline)) void softmax_f32(float* s, int64_t n_keys, int64_t n_pad, const __m512* mx, float* inv_sum) {
  const int64_t full = n_keys / 16 * 16;
  for (int r = 0; r < R; ++r) {
    float* sr = s + r * n_pad;
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx[r]));
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= full; k += 32) {
      const __m512 e0 = exp2_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sr + k), m), kExp2F32);
      const __m512 e1 = exp2_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sr + k + 16), m), kExp2F32);
      _mm512_storeu_ps(sr + k, e0);
      _mm512_storeu_ps(sr + k + 16, e1);
      sum0 = _mm512_add_ps(sum0, e0);
      sum1 = _mm512_add_ps(sum1, e1);
    }
    for (; k < n_pad; k += 16) {
      const __m512 e = _mm512_maskz_mov_ps(key_mask(k, n_keys),
                                           exp2_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sr + k), m), kExp2F32));
      _mm512_storeu_ps(sr + k, e);
      sum0 = _mm512_add_ps(sum0, e);
    }
    inv_sum[r] = 1.f / _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
  }
}

// out_rows[r] = sum_j p[r][j] v[j] * inv_sum[r], 32 features at a time, then 16.
template <int R>
__attribute__((noinline)) void values_f32(const float* p, const float* v, int64_t n_keys, int64_t n_pad, int64_t d,
                                          const float* inv_sum, float* const* out_rows) {
  for (int64_t c0 = 0; c0 < d; c0 += 32) {
    const bool two = c0 + 32 <= d;
    __m512 a0[R], a1[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    if (two) {
      for (int64_t t = 0; t < n_keys; ++t) {
        const __m512 v0 = _mm512_loadu_ps(v + t * d + c0), v1 = _mm512_loadu_ps(v + t * d + c0 + 16);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const __m512 pr = _mm512_set1_ps(p[r * n_pad + t]);
          a0[r] = _mm512_fmadd_ps(pr, v0, a0[r]);
          a1[r] = _mm512_fmadd_ps(pr, v1, a1[r]);
        }
      }
    } else {
      for (int64_t t = 0; t < n_keys; ++t) {
        const __m512 v0 = _mm512_loadu_ps(v + t * d + c0);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) a0[r] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * n_pad + t]), v0, a0[r]);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 inv = _mm512_set1_ps(inv_sum[r]);
      _mm512_storeu_ps(out_rows[r] + c0, _mm512_mul_ps(a0[r], inv));
      if (two) _mm512_storeu_ps(out_rows[r] + c0 + 16, _mm512_mul_ps(a1[r], inv));
    }
  }
}
#endif

struct Buffers {
  std::vector<float> q, k, kt, v, s, o, scratch, zero_row;
};

// The additive score bias of query q of head h: a row of a [heads, L, L] bias (bias_len = L > 0), or for a
// sliding window (bias_len < 0) one row shared by every query and head, read shifted: `bias` points at its
// center, and key j of query q reads bias[j - q] (0 within the window, -inf outside).
inline const float* bias_row(const float* bias, int64_t bias_len, int64_t h, int64_t q) {
  return bias_len < 0 ? bias - q : bias + (h * bias_len + q) * bias_len;
}

// Heads [h0, h1) of one sequence. Its rows are contiguous in qkv and are read once, front to back, into
// float32 buffers: q (scaled) and v row-major, k transposed per head. Reading each head's 128 bytes from
// every 4.6 KB row instead was latency-bound (the prefetchers do not follow strides that cross pages).
template <typename T>
void attend(const T* qkv, T* out, int64_t start, int64_t n, int64_t n_keys, int64_t h0, int64_t h1,
            int64_t heads, int64_t d, float scale, const float* bias, int64_t bias_len, Buffers& buf) {
  const int64_t hidden = heads * d, stride = 3 * hidden, cols = (h1 - h0) * d, off = h0 * d;
  const int64_t n_pad = (n_keys + kW - 1) / kW * kW;
  const int64_t n_rows = (n + kRows - 1) / kRows * kRows;  // query rows past n are zeros, their output dropped
  buf.q.resize(n_rows * cols);
  std::fill(buf.q.begin() + n * cols, buf.q.end(), 0.f);  // the query rows past n
  buf.k.resize(kW * cols);
  buf.kt.resize(cols * n_pad);  // written whole by transpose_keys (keys past n_keys as zeros)
  buf.v.resize(n_keys * cols);
  buf.s.resize(kRows * n_pad);
  buf.o.resize(kRows * d);
  for (int64_t i = 0; i < n; ++i) {
    const T* row = qkv + (start + i) * stride + off;
    to_float(row, buf.q.data() + i * cols, cols, scale);
    if (i < n_keys) {
      to_float(row + hidden, buf.k.data() + (i % kW) * cols, cols, 1.f);
      to_float(row + 2 * hidden, buf.v.data() + i * cols, cols, 1.f);
    }
    // every kW keys (and after the last), transpose them into kt: kW rows x `cols` stays in L1, and each
    // feature's kW keys are one contiguous store (not a scatter across n_pad-strided lines per key)
    if (i < n_keys && (i % kW == kW - 1 || i == n_keys - 1)) {
      const int64_t i0 = i / kW * kW;
      transpose_keys(buf.k.data(), i - i0 + 1, cols, buf.kt.data() + i0, n_pad);
    }
  }
  std::vector<T> scratch(kRows * d);
  for (int64_t hh = 0; hh < h1 - h0; ++hh) {
    const float* q = buf.q.data() + hh * d;
    const float* kt = buf.kt.data() + hh * d * n_pad;
    const float* v = buf.v.data() + hh * d;
    T* o = out + start * hidden + off + hh * d;
    for (int64_t i = 0; i < n; i += kRows) {
      T* rows[kRows];
      const float* bias_rows[kRows];
      for (int r = 0; r < kRows; ++r) {
        rows[r] = i + r < n ? o + (i + r) * hidden : scratch.data() + r * d;
        // bias[h][i][j]: the additive score bias of query i and key j (a padding row reuses row n - 1)
        bias_rows[r] = bias ? bias_row(bias, bias_len, h0 + hh, std::min(i + r, n - 1)) : nullptr;
      }
      query_block<kRows>(q + i * cols, cols, kt, v, cols, buf.s.data(), n_keys, n_pad, d,
                         bias ? bias_rows : nullptr, rows, buf.o.data());
    }
  }
}

#ifdef POLYVEC_F32_AVX512
// float32 storage, AVX-512: heads [h0, h1) of one sequence. Queries are read in place from qkv (a block's 8
// rows stay in L1 for all its keys; the next block's are prefetched, as are its output rows: rows of qkv are
// 3 x hidden apart, a stride no hardware prefetcher follows), keys transposed straight from qkv into kt, and
// values copied head by head into contiguous [n_keys][d] slices: value rows a qkv row apart (or all heads
// apart) fall in a few L1 sets, and one head's, read once per block of queries, did not stay in L1.
void attend_f32(const float* qkv, float* out, int64_t start, int64_t n, int64_t n_keys, int64_t h0, int64_t h1,
                int64_t heads, int64_t d, float scale, const float* bias, int64_t bias_len, Buffers& buf) {
  constexpr int R = kRows;
  const int64_t hidden = heads * d, stride = 3 * hidden, cols = (h1 - h0) * d, off = h0 * d, nh = h1 - h0;
  const int64_t n_pad = (n_keys + 15) / 16 * 16;
  buf.kt.resize(cols * n_pad);  // written whole (keys past n_keys as zeros)
  buf.v.resize(nh * n_keys * d);
  buf.s.resize(R * n_pad);
  buf.zero_row.assign(d, 0.f);  // the query row of the rows past n (their output goes to scratch)
  buf.scratch.resize(R * d);
  const float* base = qkv + start * stride + off;
  for (int64_t i0 = 0; i0 < n_keys; i0 += 16)
    transpose_rows16(reinterpret_cast<const uint32_t*>(base + i0 * stride + hidden), stride,
                     std::min<int64_t>(16, n_keys - i0), cols, reinterpret_cast<uint32_t*>(buf.kt.data() + i0),
                     n_pad);
  for (int64_t i = 0; i < n_keys; ++i)
    for (int64_t hh = 0; hh < nh; ++hh)
      to_float(base + i * stride + 2 * hidden + hh * d, buf.v.data() + (hh * n_keys + i) * d, d, 1.f);
  const float q_scale = scale * kLog2e;  // logits in log2 units
  for (int64_t hh = 0; hh < nh; ++hh) {
    const float* kt = buf.kt.data() + hh * d * n_pad;
    const float* v = buf.v.data() + hh * n_keys * d;
    for (int64_t i = 0; i < n; i += R) {
      const float* q_rows[R];
      float* rows[R];
      const float* bias_rows[R];
      for (int r = 0; r < R; ++r) {
        const bool real = i + r < n;
        q_rows[r] = real ? base + (i + r) * stride + hh * d : buf.zero_row.data();
        rows[r] = real ? out + (start + i + r) * hidden + off + hh * d : buf.scratch.data() + r * d;
        bias_rows[r] = bias ? bias_row(bias, bias_len, h0 + hh, std::min(i + r, n - 1)) : nullptr;
        if (i + R + r < n)  // the next block's query and output rows
          for (int64_t c = 0; c < d; c += 16) {
            _mm_prefetch((const char*)(base + (i + R + r) * stride + hh * d + c), _MM_HINT_T0);
            _mm_prefetch((const char*)(out + (start + i + R + r) * hidden + off + hh * d + c), _MM_HINT_ET0);
          }
      }
      __m512 mx[R];
      float inv_sum[R];
      if (bias)
        scores_f32<R, true>(q_rows, q_scale, kt, buf.s.data(), n_keys, n_pad, d, bias_rows, mx);
      else
        scores_f32<R, false>(q_rows, q_scale, kt, buf.s.data(), n_keys, n_pad, d, nullptr, mx);
      softmax_f32<R>(buf.s.data(), n_keys, n_pad, mx, inv_sum);
      values_f32<R>(buf.s.data(), v, n_keys, n_pad, d, inv_sum, rows);
    }
  }
}
#endif

#if defined(CPU_CAPABILITY_AVX512) && (defined(__GNUC__) || defined(__clang__))
#define POLYVEC_DPBF16 1
// bfloat16 storage on CPUs with AVX512-BF16 (and head_dim a multiple of 32): q.k and p.v are bf16 pair dot
// products (vdpbf16ps: two multiply-adds per float32 lane per instruction, exact products, float32 sums),
// on the bf16 inputs as stored, so half the instructions and half the bytes of the float32 path. The softmax
// stays float32; p is rounded to bf16 for p.v, as PyTorch's bf16 flash attention does.
struct BuffersBF16 {
  std::vector<uint16_t> q, v2, p;
  std::vector<uint32_t> kt;
  std::vector<float> s, o;
};

inline uint32_t pair_at(const uint16_t* p) {
  uint32_t u;
  std::memcpy(&u, p, 4);
  return u;
}

// Softmax of `rows` (<= 16) rows of raw scores, written as bf16 probabilities p for the p.v products (n_pad a
// multiple of 32; p is 0 past n_keys); inv_sum[r] = 1 / sum(p[r]) in float32. Two passes: the maximum of the
// logits scale * s + bias, then exp, the sum and the bf16 store from registers; the per-row maxima and sums of
// all rows are reduced together (reduce_rows16). The logits are recomputed in the second pass rather than
// stored: float32 scores written and read back, and passes of their own for the scale and the bf16
// conversion, cost more than the recomputation. Without a bias (and scale > 0), the maximum is taken over the raw
// scores and each exponent is (s * scale - max) * log2(e) in one FMA; masks only on the last vector of real keys.
__attribute__((target("avx512bf16"))) inline void softmax_to_bf16(const float* s, uint16_t* p16, int rows,
                                                                  int64_t n_keys, int64_t n_pad, float scale,
                                                                  const float* const* bias_rows, float* inv_sum) {
  const __m512 sv = _mm512_set1_ps(scale), sl = _mm512_set1_ps(scale * kLog2e), l2e = _mm512_set1_ps(kLog2e);
  const int64_t full = n_keys / 16 * 16;  // whole vectors of real keys; then one masked vector, then zeros
  const __mmask16 tail = (__mmask16)((1u << (n_keys - full)) - 1);
  // the max of the raw scores when they order as the logits do (no bias, scale > 0), else of the logits
  const bool raw = !bias_rows && scale > 0.f;
  auto logit = [&](int r, int64_t j, __mmask16 m) {
    const __m512 v = _mm512_maskz_loadu_ps(m, s + r * n_pad + j);
    return raw ? v : bias_rows ? _mm512_fmadd_ps(v, sv, _mm512_maskz_loadu_ps(m, bias_rows[r] + j))
                               : _mm512_mul_ps(v, sv);
  };
  __m512 acc[16];
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int r = 0; r < rows; ++r) {
    __m512 mv = acc[r];
    for (int64_t j = 0; j < full; j += 16) mv = _mm512_max_ps(mv, logit(r, j, 0xFFFF));
    if (tail) mv = _mm512_mask_max_ps(mv, tail, mv, logit(r, full, tail));
    acc[r] = mv;
  }
  alignas(64) float shift[16];  // the maxima times log2(e) (times the scale for raw scores)
  _mm512_store_ps(shift, _mm512_mul_ps(reduce_rows16(acc, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); }),
                                       raw ? sl : l2e));
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
  for (int r = 0; r < rows; ++r) {
    const __m512 sh = _mm512_set1_ps(shift[r]);
    auto prob = [&](int64_t j) {  // 2^(logit * log2 e - max * log2 e), 0 past n_keys
      if (j >= n_keys) return _mm512_setzero_ps();
      const __mmask16 m = j < full ? 0xFFFF : tail;
      const __m512 e = exp2_nonpositive(_mm512_fmsub_ps(logit(r, j, m), raw ? sl : l2e, sh), kExp2BF16);
      return j < full ? e : _mm512_maskz_mov_ps(m, e);
    };
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n_pad; j += 32) {
      const __m512 e0 = prob(j), e1 = prob(j + 16);
      sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
      _mm512_storeu_si512(p16 + r * n_pad + j, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    }
    acc[r] = sum;
  }
  alignas(64) float inv[16];
  _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f),
                                     reduce_rows16(acc, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); })));
  for (int r = 0; r < rows; ++r) inv_sum[r] = inv[r];
}

template <int R>
__attribute__((target("avx512bf16"))) void query_block_bf16(
    const uint16_t* q, int64_t q_stride, const uint32_t* kt, const uint16_t* v2, int64_t d, float* s, uint16_t* p16,
    int64_t n_keys, int64_t n_pad, float scale, const float* const* bias_rows, c10::BFloat16* const* out_rows,
    float* o) {
  // scores: kt holds (k[j][2c], k[j][2c+1]) pairs, [d / 2][n_pad]
  for (int64_t j = 0; j < n_pad; j += 16) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < d / 2; ++c) {
      __m512bh kv = (__m512bh)_mm512_loadu_si512(kt + c * n_pad + j);
      for (int r = 0; r < R; ++r)
        acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(pair_at(q + r * q_stride + 2 * c)), kv);
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(s + r * n_pad + j, acc[r]);
  }
  float inv_sum[R];
  softmax_to_bf16(s, p16, R, n_keys, n_pad, scale, bias_rows, inv_sum);
  // o[r] = sum_j p[r][j] v[j]: v2 holds (v[2m][c], v[2m+1][c]) pairs, [n_keys / 2][d]
  const int64_t n_pairs = (n_keys + 1) / 2;
  for (int64_t c0 = 0; c0 < d; c0 += 32) {
    __m512 a0[R], a1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    for (int64_t m = 0; m < n_pairs; ++m) {
      __m512bh v0 = (__m512bh)_mm512_loadu_si512(v2 + (m * d + c0) * 2);
      __m512bh v1 = (__m512bh)_mm512_loadu_si512(v2 + (m * d + c0 + 16) * 2);
      for (int r = 0; r < R; ++r) {
        __m512bh pb = (__m512bh)_mm512_set1_epi32(pair_at(p16 + r * n_pad + 2 * m));
        a0[r] = _mm512_dpbf16_ps(a0[r], pb, v0);
        a1[r] = _mm512_dpbf16_ps(a1[r], pb, v1);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(o + r * d + c0, a0[r]);
      _mm512_storeu_ps(o + r * d + c0 + 16, a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) from_float(o + r * d, out_rows[r], d, inv_sum[r]);
}

// AMX (Sapphire Rapids and later): each 16 x 16 block of scores is one tile multiply of 16 queries by 16
// keys over 32 head features (q rows and the (k, k) pairs of kt are already the tile layouts), and each
// 16 x 16 block of output one tile multiply of p [16 queries x 32 keys] by the (v, v) pairs of v2.
__attribute__((target("amx-tile,amx-bf16,avx512bf16"))) void amx_head(
    const uint16_t* q, int64_t q_stride, const uint32_t* kt, const uint16_t* v2, int64_t d, int64_t n,
    int64_t n_keys, int64_t n_pad, float scale, const float* bias, int64_t bias_len, BuffersBF16& buf,
    c10::BFloat16* o_base, int64_t hidden) {
  float* s = buf.s.data();
  uint16_t* p16 = buf.p.data();
  float* o = buf.o.data();
  for (int64_t i = 0; i < n; i += 16) {
    for (int64_t j = 0; j < n_pad; j += 16) {
      _tile_zero(2);
      for (int64_t c = 0; c < d; c += 32) {
        _tile_loadd(0, q + i * q_stride + c, q_stride * 2);
        _tile_loadd(1, kt + (c / 2) * n_pad + j, n_pad * 4);
        _tile_dpbf16ps(2, 0, 1);
      }
      _tile_stored(2, s + j, n_pad * 4);
    }
    const float* bias_rows[16];
    for (int r = 0; r < 16; ++r)
      bias_rows[r] = bias ? bias_row(bias, bias_len, 0, std::min(i + r, n - 1)) : nullptr;
    float inv_sum[16];
    softmax_to_bf16(s, p16, 16, n_keys, n_pad, scale, bias ? bias_rows : nullptr, inv_sum);
    for (int64_t c0 = 0; c0 < d; c0 += 16) {
      _tile_zero(5);
      for (int64_t kb = 0; kb < n_pad; kb += 32) {
        _tile_loadd(3, p16 + kb, n_pad * 2);
        _tile_loadd(4, v2 + ((kb / 2) * d + c0) * 2, d * 4);
        _tile_dpbf16ps(5, 3, 4);
      }
      _tile_stored(5, o + c0, d * 4);
    }
    for (int r = 0; r < 16 && i + r < n; ++r) from_float(o + r * d, o_base + (i + r) * hidden, d, inv_sum[r]);
  }
}

__attribute__((target("amx-tile,amx-bf16,avx512bf16"))) void attend_bf16(
    const c10::BFloat16* qkv_, c10::BFloat16* out, int64_t start, int64_t n, int64_t n_keys, int64_t h0, int64_t h1,
    int64_t heads, int64_t d, float scale, const float* bias, int64_t bias_len, bool amx, BuffersBF16& buf) {
  const uint16_t* qkv = reinterpret_cast<const uint16_t*>(qkv_);
  const int64_t hidden = heads * d, stride = 3 * hidden, cols = (h1 - h0) * d, off = h0 * d, nh = h1 - h0;
  const int64_t n_pad = (n_keys + 31) / 32 * 32, n_pairs = n_pad / 2, half = d / 2;  // pairs past n_keys: 0
  const int64_t n_rows = (n + 15) / 16 * 16;
  buf.q.assign(n_rows * cols, 0);
  buf.kt.assign(nh * half * n_pad, 0);
  buf.v2.assign(nh * n_pairs * d * 2, 0);
  buf.s.resize(16 * n_pad);
  buf.p.resize(16 * n_pad);
  buf.o.resize(16 * d);
  for (int64_t i = 0; i < n; ++i) std::memcpy(buf.q.data() + i * cols, qkv + (start + i) * stride + off, cols * 2);
  // keys as (feature pair) x key, 16 keys x 16 pairs at a time transposed in registers
  for (int64_t i0 = 0; i0 < n_keys; i0 += 16)
    transpose_rows16(reinterpret_cast<const uint32_t*>(qkv + (start + i0) * stride + off + hidden), stride / 2,
                     std::min<int64_t>(16, n_keys - i0), cols / 2, buf.kt.data() + i0, n_pad);
  // values of keys 2m and 2m+1 interleaved feature by feature
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                      5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55, 23, 54, 22,
                                      53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
  for (int64_t m = 0; m < (n_keys + 1) / 2; ++m) {
    const uint16_t* a = qkv + (start + 2 * m) * stride + 2 * hidden + off;
    const uint16_t* b = 2 * m + 1 < n_keys ? a + stride : nullptr;
    for (int64_t hh = 0; hh < nh; ++hh) {
      uint16_t* dst = buf.v2.data() + (hh * n_pairs + m) * d * 2;
      for (int64_t c0 = 0; c0 < d; c0 += 32) {
        __m512i va = _mm512_loadu_si512(a + hh * d + c0);
        __m512i vb = b ? _mm512_loadu_si512(b + hh * d + c0) : _mm512_setzero_si512();
        _mm512_storeu_si512(dst + c0 * 2, _mm512_permutex2var_epi16(va, lo, vb));
        _mm512_storeu_si512(dst + c0 * 2 + 32, _mm512_permutex2var_epi16(va, hi, vb));
      }
    }
  }
  if (amx) {
    for (int64_t hh = 0; hh < nh; ++hh)
      amx_head(buf.q.data() + hh * d, cols, buf.kt.data() + hh * half * n_pad, buf.v2.data() + hh * n_pairs * d * 2, d,
               n, n_keys, n_pad, scale, bias ? bias_row(bias, bias_len, h0 + hh, 0) : nullptr, bias_len, buf,
               out + start * hidden + off + hh * d, hidden);
    return;
  }
  std::vector<c10::BFloat16> scratch(kRows * d);
  for (int64_t hh = 0; hh < nh; ++hh) {
    c10::BFloat16* o = out + start * hidden + off + hh * d;
    for (int64_t i = 0; i < n; i += kRows) {
      c10::BFloat16* rows[kRows];
      const float* bias_rows[kRows];
      for (int r = 0; r < kRows; ++r) {
        rows[r] = i + r < n ? o + (i + r) * hidden : scratch.data() + r * d;
        bias_rows[r] = bias ? bias_row(bias, bias_len, h0 + hh, std::min(i + r, n - 1)) : nullptr;
      }
      query_block_bf16<kRows>(buf.q.data() + i * cols + hh * d, cols, buf.kt.data() + hh * half * n_pad,
                              buf.v2.data() + hh * n_pairs * d * 2, d, buf.s.data(), buf.p.data(), n_keys, n_pad,
                              scale, bias ? bias_rows : nullptr, rows, buf.o.data());
    }
  }
}

#endif

// Sequences this long go to PyTorch's CPU flash-attention kernel instead (see `long_sequence_min`).
template <typename T>
void run(const T* qkv, T* out, const int64_t* cu, const int64_t* key_lens, const float* bias_all, int64_t bias_len,
         int64_t batch, int64_t heads, int64_t d, float scale, int64_t long_min) {
  // Whole sequences per task when there are enough of them to share out; otherwise (a few long
  // sequences) one head per task, so every thread has work.
  const int64_t per_seq = batch >= 4 * at::get_num_threads() ? heads : 1;
  const int64_t groups = heads / per_seq;
#ifdef POLYVEC_DPBF16
  const bool dpbf16 = std::is_same_v<T, c10::BFloat16> && d % 32 == 0 && has_avx512_bf16();
  const bool amx = dpbf16 && amx_ready();
#endif
  // Work items longest first, handed out one at a time (longest-processing-time first): a static split of
  // the batch in halves left one thread with most of the quadratic work whenever long sequences clustered.
  std::vector<int64_t> order;
  order.reserve(batch * groups);
  for (int64_t k = 0; k < batch * groups; ++k)
    if (cu[k / groups + 1] - cu[k / groups] < long_min) order.push_back(k);
  const int64_t items = static_cast<int64_t>(order.size());
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    return cu[x / groups + 1] - cu[x / groups] > cu[y / groups + 1] - cu[y / groups];
  });
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Buffers buf;
#ifdef POLYVEC_DPBF16
    BuffersBF16 buf16;
    if (amx) amx_begin();  // the tile configuration belongs to the thread
#endif
    for (int64_t k = next++; k < items; k = next++) {
      const int64_t item = order[k];
      const int64_t b = item / groups, h0 = item % groups * per_seq;
      const int64_t n = cu[b + 1] - cu[b];
      if (n <= 0) continue;
      const int64_t n_keys = key_lens ? std::max<int64_t>(1, std::min(key_lens[b], n)) : n;
      // a sliding window (bias_len = -(half width + 1)) that spans the whole sequence masks nothing
      const float* bias = bias_all && !(bias_len < 0 && std::max(n, n_keys) <= -bias_len) ? bias_all : nullptr;
#ifdef POLYVEC_DPBF16
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (dpbf16) {
          attend_bf16(qkv, out, cu[b], n, n_keys, h0, h0 + per_seq, heads, d, scale, bias, bias_len, amx, buf16);
          continue;
        }
      }
#endif
#ifdef POLYVEC_F32_AVX512
      if constexpr (std::is_same_v<T, float>) {
        attend_f32(qkv, out, cu[b], n, n_keys, h0, h0 + per_seq, heads, d, scale, bias, bias_len, buf);
        continue;
      }
#endif
      attend(qkv, out, cu[b], n, n_keys, h0, h0 + per_seq, heads, d, scale, bias, bias_len, buf);
    }
#ifdef POLYVEC_DPBF16
    if (amx) amx_end();
#endif
  });
}

// The shortest sequence that PyTorch's flash-attention kernel (blocked over queries and keys) computes faster
// than this file's, which keeps a head's whole key set in cache and suits encoder lengths: float32 from 2048
// tokens, bf16 on the AVX512-BF16 / AMX paths from 1024, other half-precision cases (bf16 without those paths
// or with head_dim % 32 != 0, as Qwen2-VL's 80; fp16) from 128. Only where no bias, window or key mask applies.
int64_t long_sequence_min(at::ScalarType dtype, int64_t d, bool has_bias) {
  constexpr int64_t never = std::numeric_limits<int64_t>::max();
  if (has_bias) return never;
  if (dtype == at::kFloat) return 2048;
#ifdef POLYVEC_DPBF16
  if (dtype == at::kBFloat16 && d % 32 == 0 && has_avx512_bf16()) return 1024;
#endif
  return 128;
}

// Each long sequence alone through SDPA (flash attention on CPU, parallel over heads and query blocks inside):
// q, k, v are strided views of its rows of qkv, its first n_keys keys attended.
void attend_long(const at::Tensor& qkv, at::Tensor& out, const int64_t* cu, const int64_t* key_lens, int64_t batch,
                 int64_t heads, int64_t d, double scale, int64_t long_min) {
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = cu[b + 1] - cu[b];
    if (n < long_min) continue;
    const int64_t n_keys = key_lens ? std::max<int64_t>(1, std::min(key_lens[b], n)) : n;
    auto parts = qkv.narrow(0, cu[b], n).view({n, 3, heads, d}).permute({1, 2, 0, 3});  // [3, H, n, d]
    auto q = parts[0].unsqueeze(0), k = parts[1].narrow(1, 0, n_keys).unsqueeze(0);
    auto v = parts[2].narrow(1, 0, n_keys).unsqueeze(0);
    auto o = at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, false, scale);  // [1, H, n, d]
    out.narrow(0, cu[b], n).view({n, heads, d}).copy_(o[0].transpose(0, 1));
  }
}

at::Tensor varlen_attention(const at::Tensor& qkv, const at::Tensor& cu_seqlens,
                            const std::optional<at::Tensor>& key_lens, const std::optional<at::Tensor>& bias,
                            int64_t num_heads, double scale, int64_t window) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 2 && qkv.is_contiguous(), "qkv: contiguous CPU [T, 3*H*d]");
  TORCH_CHECK(qkv.size(1) % (3 * num_heads) == 0, "qkv width is not 3 * num_heads * head_dim");
  const int64_t d = qkv.size(1) / (3 * num_heads);
  TORCH_CHECK(d % kW == 0, "head_dim must be a multiple of ", kW);
  auto cu = cu_seqlens.to(at::kLong).contiguous();
  TORCH_CHECK(cu.dim() == 1 && cu.size(0) >= 1, "cu_seqlens: [B + 1]");
  at::Tensor kl;
  if (key_lens.has_value()) {
    kl = key_lens->to(at::kLong).contiguous();
    TORCH_CHECK(kl.numel() == cu.size(0) - 1, "key_lens: one per sequence");
  }
  at::Tensor bf;
  int64_t bias_len = 0;
  if (bias.has_value()) {  // [heads, L, L] (a leading 1 allowed), L >= the longest sequence
    bf = bias->to(at::kFloat).contiguous();
    bias_len = bf.size(-1);
    TORCH_CHECK(bf.numel() == num_heads * bias_len * bias_len, "bias: [heads, L, L]");
  }
  auto out = at::empty({qkv.size(0), num_heads * d}, qkv.options());
  const int64_t batch = cu.size(0) - 1;
  const int64_t* klp = kl.defined() ? kl.data_ptr<int64_t>() : nullptr;
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  std::vector<float> window_row;
  if (window >= 0) {  // keys within `window` positions of the query on either side (ModernBERT's local layers)
    TORCH_CHECK(!bp, "a sliding window and a bias together are not supported");
    auto cpu = cu.accessor<int64_t, 1>();
    int64_t longest = 0;
    for (int64_t b = 0; b < batch; ++b) longest = std::max(longest, cpu[b + 1] - cpu[b]);
    window_row.assign(2 * longest + 1, -std::numeric_limits<float>::infinity());
    for (int64_t c = std::max<int64_t>(0, longest - window); c <= std::min(2 * longest, longest + window); ++c)
      window_row[c] = 0.f;
    bp = window_row.data() + longest;
    bias_len = -(window + 1);
  } else if (bp) {
    auto cpu = cu.accessor<int64_t, 1>();
    for (int64_t b = 0; b < cu.size(0) - 1; ++b) TORCH_CHECK(cpu[b + 1] - cpu[b] <= bias_len, "bias shorter than a sequence");
  }
  const int64_t long_min = long_sequence_min(qkv.scalar_type(), d, bp != nullptr);
  attend_long(qkv, out, cu.data_ptr<int64_t>(), klp, batch, num_heads, d, scale, long_min);
  switch (qkv.scalar_type()) {
    case at::kFloat:
      run(qkv.data_ptr<float>(), out.data_ptr<float>(), cu.data_ptr<int64_t>(), klp, bp, bias_len, batch, num_heads, d, scale,
          long_min);
      break;
    case at::kBFloat16:
      run(qkv.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), cu.data_ptr<int64_t>(), klp, bp, bias_len, batch,
          num_heads, d, scale, long_min);
      break;
    case at::kHalf:
      run(qkv.data_ptr<c10::Half>(), out.data_ptr<c10::Half>(), cu.data_ptr<int64_t>(), klp, bp, bias_len, batch, num_heads, d,
          scale, long_min);
      break;
    default:
      TORCH_CHECK(false, "varlen_attention: float32, bfloat16 or float16 only, got ", qkv.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(polyvec, m) {
  m.def("varlen_attention(Tensor qkv, Tensor cu_seqlens, Tensor? key_lens, Tensor? bias, int num_heads, "
        "float scale, int window=-1) -> Tensor");
  m.impl("varlen_attention", c10::DispatchKey::CPU, TORCH_FN(varlen_attention));
}
