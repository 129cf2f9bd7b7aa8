// LayerNorm over the last dimension of a [T, H] tensor, on CPU (Ba et al., "Layer Normalization", 2016).
//
// y = (x - mean) / sqrt(var + eps) * gamma + beta per row, in float32 arithmetic whatever the storage dtype
// (float32 or bfloat16 in, the same dtype out), as PyTorch's LayerNorm computes it. A row (1.5 KB for MiniLM)
// comes from memory once, for its sum; the variance (two-pass, about the mean) and the output pass read it
// again from L1 (PyTorch's kernel reads it from memory more often; encoder layers call LayerNorm twice on
// every token). Rows are independent: batch invariant.
//
// Registered as torch.ops.polyvec.layer_norm; built with the attention kernel by polyvec/layers/kernels.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_common.h"

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kW = Vec::size();

// kW floats of a row, from its storage dtype, and back (bf16 rounded to nearest even).
inline Vec load(const float* p) { return Vec::loadu(p); }
inline Vec load(const c10::BFloat16* p) {  // bf16 is the top half of a float32; the loop vectorizes
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(p);
  uint32_t u[kW];
  for (int64_t i = 0; i < kW; ++i) u[i] = static_cast<uint32_t>(bits[i]) << 16;
  float f[kW];
  std::memcpy(f, u, sizeof(f));
  return Vec::loadu(f);
}
inline void store(float* p, const Vec& v) { v.store(p); }
inline void store(c10::BFloat16* p, const Vec& v) {
  uint32_t u[kW];
  v.store(reinterpret_cast<float*>(u));
  uint16_t* bits = reinterpret_cast<uint16_t*>(p);
  for (int64_t i = 0; i < kW; ++i) bits[i] = static_cast<uint16_t>((u[i] + 0x7FFFu + ((u[i] >> 16) & 1u)) >> 16);
}

#if defined(CPU_CAPABILITY_AVX512)
using polyvec_cpu::load16;
using polyvec_cpu::store16;

// AVX-512, h a multiple of 16: 16 rows at a time, their sums and then their squared deviations reduced together
// (reduce_rows16) rather than row by row with a horizontal reduction, a square root and a divide each.
// Each row's arithmetic is the same in any lane, so rows stay independent.
template <typename T>
void layer_norm_block16(const T* x, const T* gamma, const T* beta, T* y, int64_t rows, int64_t h, float eps) {
  __m512 acc[16];
  for (int r = 0; r < 16; ++r) {
    __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
    const T* v = x + (r < rows ? r : 0) * h;
    int64_t c = 0;
    for (; c + 32 <= h; c += 32) {
      a = _mm512_add_ps(a, load16(v + c));
      b = _mm512_add_ps(b, load16(v + c + 16));
    }
    for (; c < h; c += 16) a = _mm512_add_ps(a, load16(v + c));
    acc[r] = _mm512_add_ps(a, b);
  }
  const __m512 inv_h = _mm512_set1_ps(1.f / h);
  alignas(64) float mean[16], rstd[16];
  auto add = [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); };
  _mm512_store_ps(mean, _mm512_mul_ps(polyvec_cpu::reduce_rows16(acc, add), inv_h));
  for (int r = 0; r < 16; ++r) {
    const T* v = x + (r < rows ? r : 0) * h;
    const __m512 m = _mm512_set1_ps(mean[r]);
    __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 32 <= h; c += 32) {
      const __m512 d0 = _mm512_sub_ps(load16(v + c), m), d1 = _mm512_sub_ps(load16(v + c + 16), m);
      a = _mm512_fmadd_ps(d0, d0, a);
      b = _mm512_fmadd_ps(d1, d1, b);
    }
    for (; c < h; c += 16) {
      const __m512 d0 = _mm512_sub_ps(load16(v + c), m);
      a = _mm512_fmadd_ps(d0, d0, a);
    }
    acc[r] = _mm512_add_ps(a, b);
  }
  const __m512 var = _mm512_fmadd_ps(polyvec_cpu::reduce_rows16(acc, add), inv_h, _mm512_set1_ps(eps));
  _mm512_store_ps(rstd, _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_sqrt_ps(var)));
  for (int r = 0; r < rows; ++r) {
    const T* v = x + r * h;
    T* o = y + r * h;
    const __m512 m = _mm512_set1_ps(mean[r]), rs = _mm512_set1_ps(rstd[r]);
    for (int64_t c = 0; c < h; c += 16)
      store16(o + c, _mm512_fmadd_ps(_mm512_mul_ps(_mm512_sub_ps(load16(v + c), m), rs), load16(gamma + c),
                                     load16(beta + c)));
  }
}
#endif

template <typename T>
void layer_norm_rows(const T* x, const T* gamma, const T* beta, T* y, int64_t rows, int64_t h, float eps) {
#if defined(CPU_CAPABILITY_AVX512)
  if (h % 16 == 0) {
    at::parallel_for(0, (rows + 15) / 16, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        layer_norm_block16(x + b * 16 * h, gamma, beta, y + b * 16 * h, std::min<int64_t>(16, rows - b * 16), h,
                           eps);
    });
    return;
  }
#endif
  // ~16 rows per task keeps the split coarse enough that scheduling costs nothing next to the rows.
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    const int64_t hv = h / kW * kW;
    for (int64_t r = r0; r < r1; ++r) {
      const T* v = x + r * h;
      T* o = y + r * h;
      // first pass from memory, the next two from L1
      Vec acc(0.f);
      for (int64_t c = 0; c < hv; c += kW) acc = acc + load(v + c);
      float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
      for (int64_t c = hv; c < h; ++c) sum += static_cast<float>(v[c]);
      const float mean = sum / h;
      const Vec mv(mean);
      Vec sq(0.f);
      for (int64_t c = 0; c < hv; c += kW) {
        const Vec dv = load(v + c) - mv;
        sq = at::vec::fmadd(dv, dv, sq);
      }
      float var = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sq);
      for (int64_t c = hv; c < h; ++c) var += (static_cast<float>(v[c]) - mean) * (static_cast<float>(v[c]) - mean);
      const float rstd = 1.f / std::sqrt(var / h + eps);
      const Vec rv(rstd);
      for (int64_t c = 0; c < hv; c += kW)
        store(o + c, at::vec::fmadd((load(v + c) - mv) * rv, load(gamma + c), load(beta + c)));
      for (int64_t c = hv; c < h; ++c)
        o[c] = static_cast<T>((static_cast<float>(v[c]) - mean) * rstd * static_cast<float>(gamma[c])
                              + static_cast<float>(beta[c]));
    }
  });
}

at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "x: CPU [T, H]");
  const int64_t h = x.size(1);
  TORCH_CHECK(weight.numel() == h && bias.numel() == h, "weight and bias: [H]");
  auto xc = x.contiguous();
  auto w = weight.to(x.scalar_type()).contiguous(), b = bias.to(x.scalar_type()).contiguous();
  auto y = at::empty_like(xc);
  switch (x.scalar_type()) {
    case at::kFloat:
      layer_norm_rows(xc.data_ptr<float>(), w.data_ptr<float>(), b.data_ptr<float>(), y.data_ptr<float>(),
                      xc.size(0), h, static_cast<float>(eps));
      break;
    case at::kBFloat16:
      layer_norm_rows(xc.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(), b.data_ptr<c10::BFloat16>(),
                      y.data_ptr<c10::BFloat16>(), xc.size(0), h, static_cast<float>(eps));
      break;
    default:
      TORCH_CHECK(false, "layer_norm: float32 or bfloat16 only, got ", x.scalar_type());
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(polyvec, m) {
  m.def("layer_norm(Tensor x, Tensor weight, Tensor bias, float eps) -> Tensor");
  m.impl("layer_norm", c10::DispatchKey::CPU, TORCH_FN(layer_norm));
}
