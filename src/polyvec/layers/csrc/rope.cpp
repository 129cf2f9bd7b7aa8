// Rotary position embedding applied in place to the query and key heads of a fused qkv projection, on CPU
// (Su et al., "RoFormer", 2021; the rotate-halves layout of GPT-NeoX and transformers).
//
// For each row t and each of the first 2 * heads heads (q, then k) of qkv [T, 3 * heads * d]:
// x[i] <- x[i] cos - x[i + d/2] sin, x[i + d/2] <- x[i + d/2] cos + x[i] sin, with cos and sin [T, d/2] in float32.
// One pass over q and k, where composing the rotation from tensor ops took five (negate, concatenate, two
// products, a sum) and a copy back into qkv. Float32 arithmetic, the storage dtype's rounding on the store,
// as the tensor-op version rounds each of its steps; rows are independent.
//
// Registered as torch.ops.polyvec.rope_; built with the attention kernel by polyvec/layers/kernels.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

namespace {

template <typename T>
void rotate(T* qkv, const float* cos, const float* sin, int64_t rows, int64_t heads, int64_t d) {
  const int64_t half = d / 2, stride = 3 * heads * d;
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t t = r0; t < r1; ++t) {
      const float* c = cos + t * half;
      const float* s = sin + t * half;
      for (int64_t h = 0; h < 2 * heads; ++h) {
        T* x = qkv + t * stride + h * d;
        for (int64_t i = 0; i < half; ++i) {  // the compiler vectorizes this loop
          const float a = static_cast<float>(x[i]), b = static_cast<float>(x[i + half]);
          x[i] = static_cast<T>(a * c[i] - b * s[i]);
          x[i + half] = static_cast<T>(b * c[i] + a * s[i]);
        }
      }
    }
  });
}

void rope_(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 2 && qkv.is_contiguous(), "qkv: contiguous CPU [T, 3*H*d]");
  TORCH_CHECK(qkv.size(1) % (3 * num_heads) == 0, "qkv width is not 3 * num_heads * head_dim");
  const int64_t d = qkv.size(1) / (3 * num_heads), rows = qkv.size(0);
  TORCH_CHECK(d % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.numel() == rows * d / 2 && sin.numel() == rows * d / 2,
              "cos, sin: contiguous float32 [T, head_dim / 2]");
  switch (qkv.scalar_type()) {
    case at::kFloat:
      rotate(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), rows, num_heads, d);
      break;
    case at::kBFloat16:
      rotate(qkv.data_ptr<c10::BFloat16>(), cos.data_ptr<float>(), sin.data_ptr<float>(), rows, num_heads, d);
      break;
    case at::kHalf:
      rotate(qkv.data_ptr<c10::Half>(), cos.data_ptr<float>(), sin.data_ptr<float>(), rows, num_heads, d);
      break;
    default:
      TORCH_CHECK(false, "rope_: float32, bfloat16 or float16 only, got ", qkv.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(polyvec, m) {
  m.def("rope_(Tensor(a!) qkv, Tensor cos, Tensor sin, int num_heads) -> ()");
  m.impl("rope_", c10::DispatchKey::CPU, TORCH_FN(rope_));
}
