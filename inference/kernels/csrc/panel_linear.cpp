// Linear layers for CPU decoding: y = x @ w^T (+ bias) with the weight stored in column panels.
//
// Why (docs/cpu-measurements.md "Panel linears"): a decode or verify forward multiplies 1 to a few
// dozen rows by every weight of the target once, so its time is the time to stream the weights
// from memory. MKL's fp32 GEMV reads them at about half the machine's bandwidth on the AMD CPU of
// the dev machine, and bf16 matmuls are emulated there. These kernels read each weight once per
// call, in the order it is stored, and they read bf16 weights as they are (16 bits a weight)
// while computing in fp32.
//
// Layout: w [N, K] -> panels [P = ceil(N / 16), K, 16]: panel p holds output columns 16p..16p+15,
// k-major, so one k step reads 16 contiguous weights (columns past N are zero). The micro-kernel
// keeps a tile of up to 6 rows x 16 columns in 12 AVX2 registers and, for each k, broadcasts
// x[m, k] and multiplies it into the panel's 16 weights (an outer-product update, the shape of a
// classic 6x16 SGEMM kernel). Panels are shared among threads (at::parallel_for).
//
// Numerics: every product and sum is fp32 (a bf16 weight or activation widens to fp32 exactly), and
// each output sums over k in increasing order. So the result is the fp32 matmul of the same values
// up to summation order, the same difference MKL and oneDNN have from each other. For a bf16 x the
// output is rounded to bf16 once, at the end, as a bf16 GEMM with fp32 accumulation does.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kCols = 16;  // columns per panel: two AVX2 vectors of 8 floats
constexpr int64_t kRows = 6;   // rows per tile: 12 accumulators + 2 weights + 1 broadcast = 15 registers

// Eight weights as fp32, from bf16 (bits << 16 is exact) or fp32.
inline __m256 load8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// acc[i][0..16) = sum_k x[i, k] * panel[k][0..16) for i < MT; x rows are `ldx` floats apart.
template <int MT, typename W>
inline void tile(const float* x, int64_t ldx, const W* panel, int64_t K, float* acc) {
  __m256 lo[MT], hi[MT];
  for (int i = 0; i < MT; ++i) {
    lo[i] = _mm256_setzero_ps();
    hi[i] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w_lo = load8(panel + k * kCols), w_hi = load8(panel + k * kCols + 8);
    for (int i = 0; i < MT; ++i) {
      const __m256 xk = _mm256_broadcast_ss(x + i * ldx + k);
      lo[i] = _mm256_fmadd_ps(xk, w_lo, lo[i]);
      hi[i] = _mm256_fmadd_ps(xk, w_hi, hi[i]);
    }
  }
  for (int i = 0; i < MT; ++i) {
    _mm256_storeu_ps(acc + i * kCols, lo[i]);
    _mm256_storeu_ps(acc + i * kCols + 8, hi[i]);
  }
}

template <typename W>
void tile_rows(int64_t rows, const float* x, int64_t ldx, const W* panel, int64_t K, float* acc) {
  switch (rows) {
    case 1: tile<1>(x, ldx, panel, K, acc); break;
    case 2: tile<2>(x, ldx, panel, K, acc); break;
    case 3: tile<3>(x, ldx, panel, K, acc); break;
    case 4: tile<4>(x, ldx, panel, K, acc); break;
    case 5: tile<5>(x, ldx, panel, K, acc); break;
    default: tile<6>(x, ldx, panel, K, acc); break;
  }
}

// y [M, N] (fp32) = x [M, K] (fp32, contiguous) @ panels^T + bias
template <typename W>
void run(const float* x, int64_t M, int64_t K, const W* panels, int64_t P, int64_t N, const float* bias, float* y) {
  at::parallel_for(0, P, 4, [&](int64_t p0, int64_t p1) {
    alignas(32) float acc[kRows * kCols];
    for (int64_t p = p0; p < p1; ++p) {
      const W* panel = panels + p * K * kCols;
      const int64_t n0 = p * kCols, width = std::min(kCols, N - n0);
      for (int64_t m = 0; m < M; m += kRows) {
        const int64_t rows = std::min(kRows, M - m);
        tile_rows(rows, x + m * K, K, panel, K, acc);
        for (int64_t i = 0; i < rows; ++i) {
          float* out = y + (m + i) * N + n0;
          const float* a = acc + i * kCols;
          if (bias != nullptr) {
            for (int64_t j = 0; j < width; ++j) out[j] = a[j] + bias[n0 + j];
          } else {
            std::memcpy(out, a, width * sizeof(float));
          }
        }
      }
    }
  });
}

// w [N, K] (float32 or bfloat16) -> panels [ceil(N / 16), K, 16] of the same dtype
at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "panel_linear.pack: weight must be [N, K], got ", w.sizes());
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16,
              "panel_linear.pack: float32 or bfloat16 weights only, got ", w.scalar_type());
  TORCH_CHECK(w.device().is_cpu(), "panel_linear.pack: CPU tensors only");
  const at::Tensor src = w.contiguous();
  const int64_t N = src.size(0), K = src.size(1), P = (N + kCols - 1) / kCols;
  // pad N to whole panels, then [P, 16, K] -> [P, K, 16]
  at::Tensor padded = at::zeros({P * kCols, K}, src.options());
  padded.narrow(0, 0, N).copy_(src);
  return padded.view({P, kCols, K}).transpose(1, 2).contiguous();
}

// x [M, K] float32 or bfloat16; panels from pack(); bias [N] or undefined; out [M, N] in x's dtype
at::Tensor linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && panels.size(2) == kCols, "panel_linear.linear: bad shapes ",
              x.sizes(), " and ", panels.sizes());
  TORCH_CHECK(x.size(1) == panels.size(1), "panel_linear.linear: x has ", x.size(1), " features, the weight ", panels.size(1));
  TORCH_CHECK(N <= panels.size(0) * kCols && N > (panels.size(0) - 1) * kCols, "panel_linear.linear: N = ", N,
              " does not match ", panels.size(0), " panels");
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu(), "panel_linear.linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "panel_linear.linear: float32 or bfloat16 input only, got ", x.scalar_type());
  const at::Tensor x32 = x.to(at::kFloat).contiguous();  // bf16 -> fp32 is exact
  at::Tensor b32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "panel_linear.linear: bias has ", bias->numel(), " entries, N = ", N);
    b32 = bias->to(at::kFloat).contiguous();
  }
  const int64_t M = x32.size(0), K = x32.size(1), P = panels.size(0);
  at::Tensor y = at::empty({M, N}, x32.options());
  const float* b = b32.defined() ? b32.data_ptr<float>() : nullptr;
  const at::Tensor pc = panels.contiguous();
  if (pc.scalar_type() == at::kBFloat16) {
    run(x32.data_ptr<float>(), M, K, reinterpret_cast<const uint16_t*>(pc.data_ptr<at::BFloat16>()), P, N, b,
        y.data_ptr<float>());
  } else {
    TORCH_CHECK(pc.scalar_type() == at::kFloat, "panel_linear.linear: panels must be float32 or bfloat16");
    run(x32.data_ptr<float>(), M, K, pc.data_ptr<float>(), P, N, b, y.data_ptr<float>());
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());  // one rounding, at the end
}

}  // namespace

TORCH_LIBRARY(drafthead_panel, m) {
  m.def("pack(Tensor w) -> Tensor");
  m.def("linear(Tensor x, Tensor panels, Tensor? bias, int N) -> Tensor");
}

TORCH_LIBRARY_IMPL(drafthead_panel, CPU, m) {
  m.impl("pack", &pack);
  m.impl("linear", &linear);
}
