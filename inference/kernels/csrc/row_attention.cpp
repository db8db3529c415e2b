// Attention whose result for one query row does not depend on the other rows of the call:
// row-invariant decoding (inference/engine/invariant.py, docs/acceptance.md "Row invariance").
//
// Each (batch row, query row, head) is computed on its own, over the keys the mask lets it see,
// in key order, with one fixed sequence of operations:
//   score_j = dot(q, k_j) * scaling   8-lane FMA accumulators over the head dim, then a fixed
//                                     horizontal sum, then the tail (D % 8) in order
//   (softcap: tanh(score / cap) * cap)
//   p_j = exp(score_j - max)          the max is exact whatever the order
//   sum = p_0 + p_1 + ...             in key order
//   out = (sum_j p_j v_j) / sum       per output element, in key order (8 lanes of the value dim
//                                     at a time: each lane is its own element's sequential sum)
// So a row's output is a function of its query and of the sequence of keys and values it sees
// alone. Plain decoding's one-token forward at position t sees keys 0..t; the same token as a
// tree node sees the committed keys and its ancestors, which are the same vectors in the same
// order: the same bits. All arithmetic is fp32; the caller widens bf16 inputs (exact).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float s = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  for (; d < n; ++d) s = std::fma(a[d], b[d], s);
  return s;
}

// acc[0..n) += p * v[0..n)
inline void axpy(float p, const float* v, float* acc, int64_t n) {
  const __m256 pv = _mm256_set1_ps(p);
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + d), _mm256_loadu_ps(acc + d)));
  for (; d < n; ++d) acc[d] = std::fma(p, v[d], acc[d]);
}

// q [B, H, Tq, D], k [B, Hkv, Tk, D], v [B, Hkv, Tk, Dv] (float32, contiguous), seen [B, Tq, Tk]
// bool (the keys each query row sees, every head alike) -> [B, Tq, H, Dv] float32.
// softcap <= 0: none.
at::Tensor row_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& seen,
                         double scaling, double softcap) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && seen.dim() == 3, "row_attention: bad ranks");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "row_attention: float32 q, k, v only");
  TORCH_CHECK(seen.scalar_type() == at::kBool, "row_attention: seen must be bool");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && seen.device().is_cpu(),
              "row_attention: CPU tensors only");
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Tk = k.size(2), Dv = v.size(3);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && k.size(3) == D && v.size(1) == Hkv && v.size(2) == Tk,
              "row_attention: q, k, v shapes disagree: ", q.sizes(), k.sizes(), v.sizes());
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "row_attention: ", H, " query heads over ", Hkv, " key/value heads");
  TORCH_CHECK(seen.size(0) == B && seen.size(1) == Tq && seen.size(2) == Tk, "row_attention: seen is ", seen.sizes());
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), sc = seen.contiguous();
  at::Tensor out = at::empty({B, Tq, H, Dv}, q.options());
  const float* qp = qc.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  const bool* sp = sc.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const int64_t groups = H / Hkv;
  const float scale = static_cast<float>(scaling), cap = static_cast<float>(softcap);

  at::parallel_for(0, B * Tq * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(Tk);
    std::vector<int64_t> keys(Tk);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task % H, i = (task / H) % Tq, b = task / (H * Tq);
      const int64_t g = h / groups;
      const float* qrow = qp + ((b * H + h) * Tq + i) * D;
      const float* kbase = kp + (b * Hkv + g) * Tk * D;
      const float* vbase = vp + (b * Hkv + g) * Tk * Dv;
      const bool* row_seen = sp + (b * Tq + i) * Tk;
      int64_t n = 0;
      float top = -INFINITY;
      for (int64_t j = 0; j < Tk; ++j) {
        if (!row_seen[j]) continue;
        float s = dot(qrow, kbase + j * D, D) * scale;
        if (cap > 0.f) s = std::tanh(s / cap) * cap;
        scores[n] = s;
        keys[n++] = j;
        top = std::max(top, s);
      }
      float* o = op + ((b * Tq + i) * H + h) * Dv;
      for (int64_t d = 0; d < Dv; ++d) o[d] = 0.f;
      if (n == 0) continue;  // a row that sees nothing (padding): zeros, never read
      float total = 0.f;
      for (int64_t m = 0; m < n; ++m) {
        const float p = std::exp(scores[m] - top);
        scores[m] = p;
        total += p;
      }
      for (int64_t m = 0; m < n; ++m) axpy(scores[m], vbase + keys[m] * Dv, o, Dv);
      const float inv = 1.f / total;
      for (int64_t d = 0; d < Dv; ++d) o[d] *= inv;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(drafthead_attention, m) {
  m.def("row_attention(Tensor q, Tensor k, Tensor v, Tensor seen, float scaling, float softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(drafthead_attention, CPU, m) {
  m.impl("row_attention", &row_attention);
}
