// Per-token (row) dynamic int8 quantization around oneDNN's int8 matmul, on CPU.
//
// quantize_rows maps each row of x to uint8 with its own affine grid: x ~= s * q + o, q in [0, 255],
// s = (max - min) / 255, o = min. Asymmetric because post-GELU activations are nearly one-signed
// (a symmetric grid wastes half its levels there); one grid per row so that a token's result cannot depend
// on the other tokens of the batch (a per-tensor scale would). The weights are int8 per output channel,
// symmetric (u8 x s8 is the native VNNI / AMX int8 product; oneDNN runs s8 x s8 on VNNI-only CPUs in its
// reference kernel, far slower), so with y' = q . Wq^T * w_scale (what oneDNN computes, exact in int32
// before the scale):
//
//     x . W^T = s * y' + o * colsum(W)        (colsum over the dequantized weight's input dimension)
//
// and dequantize_rows applies that rank-one correction, the bias, an optional GELU and an optional residual
// add in one pass over the output, writing the activation dtype (float32 or bfloat16).
//
// requantize_rows is dequantize_rows (with the GELU) followed by quantize_rows, a row at a time: the FFN's
// intermediate goes from the up projection's int32 sums to the down projection's uint8 grid without being
// written in the activation dtype.
//
// Registered as torch.ops.polyvec.quantize_rows / dequantize_rows / requantize_rows; built with the attention
// kernel by polyvec/layers/kernels.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "cpu_common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

using namespace polyvec_cpu;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t kW = Vec::size();

inline float load1(const float* p) { return *p; }
inline float load1(const c10::BFloat16* p) {
  uint32_t u = static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(p)) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void store1(float* p, float f) { *p = f; }
inline void store1(c10::BFloat16* p, float f) {  // round to nearest even (values are finite)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#if defined(CPU_CAPABILITY_AVX512)
// One row, AVX-512: a min/max pass and a quantize pass straight from the input, 16 values per step.
template <typename T>
void quantize_row16(const T* xr, uint8_t* qr, int64_t k, float* scale, float* offset) {
  __m512 vlo = load16(xr), vhi = vlo;
  for (int64_t c = 16; c < k; c += 16) {
    const __m512 v = load16(xr + c);
    vlo = _mm512_min_ps(vlo, v);
    vhi = _mm512_max_ps(vhi, v);
  }
  const float lo = _mm512_reduce_min_ps(vlo), hi = _mm512_reduce_max_ps(vhi);
  if (!(hi > lo)) {
    std::memset(qr, 0, k);
    *scale = 0.f;
    *offset = lo;
    return;
  }
  const float s = (hi - lo) / 255.f;
  const __m512 inv = _mm512_set1_ps(255.f / (hi - lo)), vl = _mm512_set1_ps(lo), top = _mm512_set1_ps(255.f);
  for (int64_t c = 0; c < k; c += 16) {
    __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_sub_ps(load16(xr + c), vl), inv), _mm512_setzero_ps()),
                             top);
    // nearest level, ties to even (the default rounding mode)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + c), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
  }
  *scale = s;
  *offset = lo;
}

template <typename T>
void dequantize_row16(const float* yr, float s, float o, const float* colsum, const float* bias, const T* res, int act,
                      T* outr, int64_t n) {
  const __m512 vs = _mm512_set1_ps(s), vo = _mm512_set1_ps(o);
  for (int64_t c = 0; c < n; c += 16) {
    __m512 v = _mm512_fmadd_ps(_mm512_loadu_ps(yr + c), vs, _mm512_mul_ps(vo, _mm512_loadu_ps(colsum + c)));
    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + c));
    if (act) v = gelu16(v, act);
    if (res) v = _mm512_add_ps(v, load16(res + c));
    store16(outr + c, v);
  }
}
#endif

// Row scratch of one thread: the float32 copy of a row (generic paths, and the fused pass's GELU output) and
// its levels.
struct RowScratch {
  std::vector<float> row;
  std::vector<int32_t> levels;
  explicit RowScratch(int64_t n) : row(n + kW), levels(n) {}
};

template <typename T>
void quantize_row(const T* xr, uint8_t* qr, int64_t k, float* scale, float* offset, RowScratch& tmp) {
#if defined(CPU_CAPABILITY_AVX512)
  if (k % 16 == 0) return quantize_row16(xr, qr, k, scale, offset);
#endif
  float* row = tmp.row.data();
  for (int64_t c = 0; c < k; ++c) row[c] = load1(xr + c);
  Vec vlo(row[0]), vhi(row[0]);
  int64_t c = 0;
  for (; c + kW <= k; c += kW) {
    const Vec v = Vec::loadu(row + c);
    vlo = at::vec::minimum(vlo, v);
    vhi = at::vec::maximum(vhi, v);
  }
  float lo = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::minimum(a, b); }, vlo);
  float hi = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vhi);
  for (; c < k; ++c) {
    lo = std::min(lo, row[c]);
    hi = std::max(hi, row[c]);
  }
  if (!(hi > lo)) {  // a constant row: x = o exactly, q = 0 and s = 0
    std::memset(qr, 0, k);
    *scale = 0.f;
    *offset = lo;
    return;
  }
  const float inv = 255.f / (hi - lo);
  const Vec vinv(inv), vl(lo), zero(0.f), top(255.f);
  int32_t* levels = tmp.levels.data();
  for (c = 0; c + kW <= k; c += kW) {  // nearest level, ties to even (the vector round)
    const Vec v = at::vec::clamp((Vec::loadu(row + c) - vl) * vinv, zero, top).round();
    at::vec::convert_to_int_of_same_size(v).store(levels + c);
  }
  for (; c < k; ++c)
    levels[c] = static_cast<int32_t>(std::nearbyint(std::min(std::max((row[c] - lo) * inv, 0.f), 255.f)));
  for (c = 0; c < k; ++c) qr[c] = static_cast<uint8_t>(levels[c]);  // vectorized narrowing
  *scale = (hi - lo) / 255.f;
  *offset = lo;
}

// act: 0 none, 1 GELU (erf), 2 GELU (tanh approximation), as gelu16.
template <typename T>
void dequantize_row(const float* yr, float s, float o, const float* colsum, const float* bias, const T* res, int act,
                    T* outr, int64_t n, RowScratch& tmp) {
#if defined(CPU_CAPABILITY_AVX512)
  if (n % 16 == 0) return dequantize_row16(yr, s, o, colsum, bias, res, act, outr, n);
#endif
  float* row = tmp.row.data();
  const Vec half(0.5f), one(1.f), rsqrt2(static_cast<float>(M_SQRT1_2)), c0(0.7978845608f), c1(0.044715f);
  const Vec vs(s), vo(o);
  int64_t c = 0;
  for (; c + kW <= n; c += kW) {
    Vec v = at::vec::fmadd(Vec::loadu(yr + c), vs, vo * Vec::loadu(colsum + c));
    if (bias) v = v + Vec::loadu(bias + c);
    if (act == 1) {
      v = half * v * (one + (v * rsqrt2).erf());
    } else if (act == 2) {
      v = half * v * (one + (c0 * (v + c1 * v * v * v)).tanh());
    }
    v.store(row + c);
  }
  for (; c < n; ++c) {
    float v = yr[c] * s + o * colsum[c] + (bias ? bias[c] : 0.f);
    if (act == 1) v = 0.5f * v * (1.f + std::erf(v * static_cast<float>(M_SQRT1_2)));
    if (act == 2) v = 0.5f * v * (1.f + std::tanh(0.7978845608f * (v + 0.044715f * v * v * v)));
    row[c] = v;
  }
  for (c = 0; c < n; ++c) store1(outr + c, res ? row[c] + load1(res + c) : row[c]);
}

template <typename T>
void quantize(const T* x, uint8_t* q, float* scale, float* offset, int64_t rows, int64_t k) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    RowScratch tmp(k);
    for (int64_t r = r0; r < r1; ++r) quantize_row(x + r * k, q + r * k, k, scale + r, offset + r, tmp);
  });
}

template <typename T>
void dequantize(const float* y, const float* scale, const float* offset, const float* colsum, const float* bias,
                const T* residual, int act, T* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    RowScratch tmp(n);
    for (int64_t r = r0; r < r1; ++r)
      dequantize_row(y + r * n, scale[r], offset[r], colsum, bias, residual ? residual + r * n : nullptr, act,
                     out + r * n, n, tmp);
  });
}

// dequantize then quantize again, a row at a time in L1: the FFN's GELU output goes straight to the grid of
// the down projection and is never written out in the activation dtype.
void requantize(const float* y, const float* scale, const float* offset, const float* colsum, const float* bias,
                int act, uint8_t* q, float* q_scale, float* q_offset, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    RowScratch tmp(n);
    std::vector<float> h(n);
    for (int64_t r = r0; r < r1; ++r) {
      dequantize_row<float>(y + r * n, scale[r], offset[r], colsum, bias, nullptr, act, h.data(), n, tmp);
      quantize_row<float>(h.data(), q + r * n, n, q_scale + r, q_offset + r, tmp);
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x_) {
  TORCH_CHECK(x_.device().is_cpu() && x_.dim() == 2, "quantize_rows: a CPU [rows, k] tensor");
  auto x = x_.contiguous();
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(k > 0, "quantize_rows: empty rows");
  auto q = at::empty({rows, k}, x.options().dtype(at::kByte));
  auto scale = at::empty({rows, 1}, x.options().dtype(at::kFloat));
  auto offset = at::empty({rows, 1}, x.options().dtype(at::kFloat));
  switch (x.scalar_type()) {
    case at::kFloat:
      quantize(x.data_ptr<float>(), q.data_ptr<uint8_t>(), scale.data_ptr<float>(), offset.data_ptr<float>(), rows, k);
      break;
    case at::kBFloat16:
      quantize(x.data_ptr<c10::BFloat16>(), q.data_ptr<uint8_t>(), scale.data_ptr<float>(), offset.data_ptr<float>(),
               rows, k);
      break;
    default:
      TORCH_CHECK(false, "quantize_rows: float32 or bfloat16 only, got ", x.scalar_type());
  }
  return {q, scale, offset};
}

struct Epilogue {  // the float32 operands of a dequantize pass, checked against y [rows, n]
  at::Tensor y, scale, offset, colsum, bias;
  int64_t rows, n;
  const float* bias_ptr() const { return bias.defined() ? bias.data_ptr<float>() : nullptr; }
};

Epilogue check_epilogue(const char* op, const at::Tensor& y, const at::Tensor& scale, const at::Tensor& offset,
                        const at::Tensor& colsum, const std::optional<at::Tensor>& bias, int64_t act) {
  TORCH_CHECK(y.device().is_cpu() && y.dim() == 2, op, ": a CPU [rows, n] tensor");
  TORCH_CHECK(act >= 0 && act <= 2, op, ": act is 0 (none), 1 (gelu) or 2 (gelu tanh)");
  Epilogue e{y.to(at::kFloat).contiguous(), scale.to(at::kFloat).contiguous(), offset.to(at::kFloat).contiguous(),
             colsum.to(at::kFloat).contiguous(), at::Tensor(), y.size(0), y.size(1)};
  TORCH_CHECK(e.scale.numel() == e.rows && e.offset.numel() == e.rows, op, ": one scale and offset per row");
  TORCH_CHECK(e.colsum.numel() == e.n, op, ": one column sum per output column");
  if (bias.has_value()) {
    e.bias = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(e.bias.numel() == e.n, op, ": one bias per output column");
  }
  return e;
}

at::Tensor dequantize_rows(const at::Tensor& y_, const at::Tensor& scale_, const at::Tensor& offset_,
                           const at::Tensor& colsum_, const std::optional<at::Tensor>& bias_,
                           const std::optional<at::Tensor>& residual_, int64_t act, at::ScalarType out_dtype) {
  const Epilogue e = check_epilogue("dequantize_rows", y_, scale_, offset_, colsum_, bias_, act);
  at::Tensor residual;
  if (residual_.has_value()) {
    residual = residual_->to(out_dtype).contiguous();
    TORCH_CHECK(residual.size(0) == e.rows && residual.size(1) == e.n, "dequantize_rows: residual shape");
  }
  auto out = at::empty({e.rows, e.n}, e.y.options().dtype(out_dtype));
  switch (out_dtype) {
    case at::kFloat:
      dequantize(e.y.data_ptr<float>(), e.scale.data_ptr<float>(), e.offset.data_ptr<float>(),
                 e.colsum.data_ptr<float>(), e.bias_ptr(), residual.defined() ? residual.data_ptr<float>() : nullptr,
                 static_cast<int>(act), out.data_ptr<float>(), e.rows, e.n);
      break;
    case at::kBFloat16:
      dequantize(e.y.data_ptr<float>(), e.scale.data_ptr<float>(), e.offset.data_ptr<float>(),
                 e.colsum.data_ptr<float>(), e.bias_ptr(),
                 residual.defined() ? residual.data_ptr<c10::BFloat16>() : nullptr, static_cast<int>(act),
                 out.data_ptr<c10::BFloat16>(), e.rows, e.n);
      break;
    default:
      TORCH_CHECK(false, "dequantize_rows: float32 or bfloat16 output only, got ", out_dtype);
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> requantize_rows(const at::Tensor& y_, const at::Tensor& scale_,
                                                               const at::Tensor& offset_, const at::Tensor& colsum_,
                                                               const std::optional<at::Tensor>& bias_, int64_t act) {
  const Epilogue e = check_epilogue("requantize_rows", y_, scale_, offset_, colsum_, bias_, act);
  auto q = at::empty({e.rows, e.n}, e.y.options().dtype(at::kByte));
  auto q_scale = at::empty({e.rows, 1}, e.y.options()), q_offset = at::empty({e.rows, 1}, e.y.options());
  requantize(e.y.data_ptr<float>(), e.scale.data_ptr<float>(), e.offset.data_ptr<float>(), e.colsum.data_ptr<float>(),
             e.bias_ptr(), static_cast<int>(act), q.data_ptr<uint8_t>(), q_scale.data_ptr<float>(),
             q_offset.data_ptr<float>(), e.rows, e.n);
  return {q, q_scale, q_offset};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(polyvec, m) {
  m.def("quantize_rows(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("dequantize_rows(Tensor y, Tensor scale, Tensor offset, Tensor colsum, Tensor? bias, Tensor? residual, "
        "int act, ScalarType out_dtype) -> Tensor");
  m.def("requantize_rows(Tensor y, Tensor scale, Tensor offset, Tensor colsum, Tensor? bias, int act) "
        "-> (Tensor, Tensor, Tensor)");
  m.impl("quantize_rows", c10::DispatchKey::CPU, TORCH_FN(quantize_rows));
  m.impl("requantize_rows", c10::DispatchKey::CPU, TORCH_FN(requantize_rows));
  m.impl("dequantize_rows", c10::DispatchKey::CPU, TORCH_FN(dequantize_rows));
}
