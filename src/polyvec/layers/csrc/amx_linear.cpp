// act(x W^T + b) [+ residual] in bfloat16 on AMX tiles, for batches of a few rows (a short query alone).
//
// At ~10 rows a projection is bound by reading its weight and by per-call overhead, not by arithmetic, and
// oneDNN's prepacked matmul spends about half of a short query's time there. Here the weight is packed once, at load time, in the layout of AMX's B tiles, and each call is one pass over
// it: blocks of 32 (or 16) rows x 32 outputs (four or two float32 accumulator tiles) run over all of K, two
// threads take half the outputs each, and the next weight blocks are prefetched. At thousands of rows oneDNN
// is faster, so layers/linear.py routes only batches of up to AMX_MAX_ROWS rows here.
//
// Layout: W [N, K] is packed as [N/16][K/32][16][16][2]: for 16 outputs and 32 inputs, 16 rows of 16 (input
// pair) entries, the VNNI layout the tile multiply reads. The float32 sums of a block are stored to a thread
// buffer; its epilogue (bias, GELU, residual, one rounding to bf16) runs while the tiles compute the next
// block. A row's result depends on that row alone, and on nothing else in the batch.
//
// Registered as torch.ops.polyvec.amx_linear; built with the other kernels by polyvec/layers/kernels.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_common.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace polyvec_cpu;

#if defined(CPU_CAPABILITY_AVX512) && (defined(__GNUC__) || defined(__clang__))
#define POLYVEC_AMX_LINEAR 1

constexpr int kPrefetch = 2;  // K blocks ahead (the best of 0/2/4/8 when it was chosen)

// c [16 R x 32] = a [16 R rows, K] x (b0 | b1) [K, 16 + 16], float32 sums. R = 1 for blocks of at most 16 rows,
// which need half the tile multiplies.
template <int R>
__attribute__((target("amx-tile,amx-bf16"))) void tile_block(const uint16_t* a, int64_t lda, const uint16_t* b0,
                                                              const uint16_t* b1, int64_t k_blocks, float* c) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (R == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    // A prefetch past the weight's end is harmless (prefetches never fault).
    for (int line = 0; line < 1024; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(b0 + (kb + kPrefetch) * 512) + line, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(b1 + (kb + kPrefetch) * 512) + line, _MM_HINT_T0);
    }
    _tile_loadd(4, a + kb * 32, lda * 2);
    _tile_loadd(6, b0 + kb * 512, 64);
    _tile_loadd(7, b1 + kb * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (R == 2) {
      _tile_loadd(5, a + 16 * lda + kb * 32, lda * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16, 128);
  if constexpr (R == 2) {
    _tile_stored(2, c + 16 * 32, 128);
    _tile_stored(3, c + 16 * 32 + 16, 128);
  }
}

struct Epilogue {
  const float* bias;                // [N] or null
  const c10::BFloat16* residual;    // [M, N] or null
  int act;                          // as gelu16
  c10::BFloat16* out;               // [M, N]
  int64_t n;
};

// Rows [m0, m0 + rows) x outputs [col0, col0 + 32) from their float32 sums c: + bias, GELU, + residual, bf16.
void epilogue(const float* c, int64_t rows, int64_t m0, int64_t col0, const Epilogue& e) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t at = (m0 + r) * e.n + col0;
    for (int h = 0; h < 32; h += 16) {
      __m512 v = _mm512_loadu_ps(c + r * 32 + h);
      if (e.bias) v = _mm512_add_ps(v, _mm512_loadu_ps(e.bias + col0 + h));
      if (e.act) v = gelu16(v, e.act);
      if (e.residual) v = _mm512_add_ps(v, load16(e.residual + at + h));
      store16(e.out + at + h, v);
    }
  }
}

void amx_linear_rows(const uint16_t* x, int64_t m, int64_t k, const uint16_t* w, int64_t n, const Epilogue& e) {
  const int64_t k_blocks = k / 32, pairs = n / 32, m_blocks = (m + 31) / 32;
  // Outputs are shared out between threads, 32 at a time: each thread reads its part of the weight once per
  // 32 rows (the rows are few; the weight is what is large).
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    amx_begin();
    alignas(64) float sums[2][32 * 32];
    std::vector<uint16_t> tail;  // the last, partial block of rows, zero-padded to 32
    int64_t pending_rows = 0, pending_m0 = 0, pending_col = 0;
    int slot = 0;
    for (int64_t mb = 0; mb < m_blocks; ++mb) {
      const int64_t m0 = mb * 32, rows = std::min<int64_t>(32, m - m0);
      const uint16_t* a = x + m0 * k;
      if (rows % 16) {  // tile loads read 16 rows
        tail.assign(32 * k, 0);
        std::memcpy(tail.data(), a, rows * k * sizeof(uint16_t));
        a = tail.data();
      }
      for (int64_t p = p0; p < p1; ++p) {
        const uint16_t *b0 = w + 2 * p * k * 16, *b1 = b0 + k * 16;
        if (rows <= 16) {
          tile_block<1>(a, k, b0, b1, k_blocks, sums[slot]);
        } else {
          tile_block<2>(a, k, b0, b1, k_blocks, sums[slot]);
        }
        // The previous block's epilogue, while this block's tile multiplies run.
        if (pending_rows) epilogue(sums[slot ^ 1], pending_rows, pending_m0, pending_col, e);
        pending_rows = rows, pending_m0 = m0, pending_col = p * 32;
        slot ^= 1;
      }
    }
    if (pending_rows) epilogue(sums[slot ^ 1], pending_rows, pending_m0, pending_col, e);
    amx_end();
  });
}
#endif

bool amx_linear_available() {
#ifdef POLYVEC_AMX_LINEAR
  return amx_ready();
#else
  return false;
#endif
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                      const std::optional<at::Tensor>& residual, int64_t act) {
  TORCH_CHECK(amx_linear_available(), "amx_linear: this CPU (or build) has no AMX-BF16");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "amx_linear: x must be a contiguous CPU bfloat16 [rows, K] tensor");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.size(2) == 16 &&
                  packed.size(3) == 32 && packed.is_contiguous(),
              "amx_linear: packed must be a weight from pack_amx_weight ([N/16, K/32, 16, 32] bfloat16)");
  const int64_t m = x.size(0), k = packed.size(1) * 32, n = packed.size(0) * 16;
  TORCH_CHECK(x.size(1) == k, "amx_linear: x has ", x.size(1), " features, the weight ", k);
  TORCH_CHECK(n % 32 == 0, "amx_linear: the number of outputs must be a multiple of 32, got ", n);
  TORCH_CHECK(act >= 0 && act <= 2, "amx_linear: act is 0 (none), 1 (gelu) or 2 (gelu tanh)");
  if (bias)
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous(),
                "amx_linear: bias must be a contiguous float32 [N] tensor");
  if (residual)
    TORCH_CHECK(residual->scalar_type() == at::kBFloat16 && residual->dim() == 2 && residual->size(0) == m &&
                    residual->size(1) == n && residual->is_contiguous(),
                "amx_linear: residual must be a contiguous bfloat16 [rows, N] tensor");
  auto out = at::empty({m, n}, x.options());
#ifdef POLYVEC_AMX_LINEAR
  if (m == 0) return out;
  const Epilogue e{bias ? bias->data_ptr<float>() : nullptr,
                   residual ? residual->data_ptr<c10::BFloat16>() : nullptr, static_cast<int>(act),
                   out.data_ptr<c10::BFloat16>(), n};
  amx_linear_rows(reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>()), m, k,
                  reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>()), n, e);
#endif
  return out;
}

void set_amx_enabled(bool enabled) { amx_enabled.store(enabled, std::memory_order_relaxed); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(polyvec, m) {
  m.def("set_amx_enabled(bool enabled) -> ()", &set_amx_enabled);
  m.def("amx_linear_available() -> bool", &amx_linear_available);
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias, Tensor? residual, int act) -> Tensor");
  m.impl("amx_linear", c10::DispatchKey::CPU, TORCH_FN(amx_linear));
}
