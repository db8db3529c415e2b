// Attention whose result for one query row does not depend on the other rows of the call:
// row-invariant decoding (inference/engine/invariant.py, docs/acceptance.md "Row invariance").
//
// Each (batch row, query row, head) is computed on its own, over the keys the mask lets it see,
// in key order, with one fixed sequence of operations:
//   score_j = dot(q, k_j) * scaling   per key: 8 partial sums, lane l over d = l, l + 8, ... (fp32
//                                     FMA, d in order), then ((l0 + l1) + (l2 + l3)) + ((l4 + l5) +
//                                     (l6 + l7)), then the tail (D % 8) by FMA in order
//   (softcap: tanh(score / cap) * cap)
//   p_j = exp(score_j - max)          the max is exact whatever the order; exp is `exp8` below, a
//                                     function of its input alone
//   sum = p_0 + p_1 + ...             in key order
//   out = (sum_j p_j v_j) / sum       per output element, in key order (FMA), times 1 / sum
// So a row's output is a function of its query and of the sequence of keys and values it sees
// alone. Plain decoding's one-token forward at position t sees keys 0..t; the same token as a
// tree node sees the committed keys and its ancestors, which are the same vectors in the same
// order: the same bits. All arithmetic is fp32 (bf16 inputs widen exactly); a bf16 output is
// rounded once, at the end.
//
// Vectorized without changing that order: the scores of 8 keys at a time, one key per lane (the
// keys transposed to [D, keys], so lane j's 8 partial sums are 8 registers), which computes each
// key's dot product exactly as the per-key order above; and the weighted sum of values with the
// output row in registers, one key after another. Every score up to the last key a row sees is
// computed (a masked key's lane is simply not used), so the work a row does depends on its keys
// alone.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kLanes = 8;     // fp32 lanes of an AVX2 register: keys per score block
constexpr int64_t kOutRegs = 8;   // output registers of the value sum: 64 elements of the row

// exp(x) for x <= 0 (a score minus the row's max), 8 lanes: x = n ln2 + r with |r| <= ln2 / 2,
// exp(r) by a degree-7 polynomial (Horner, FMA), times 2^n through the exponent bits; below
// -87.3 (exp < 2^-126, no normal fp32) 0. Within 2 ulp of exp; deterministic per input.
inline __m256 exp8(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(-87.33654f);
  const __m256 underflow = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lowest);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2, high part: n * it is exact
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);       // ln 2, low part
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  // 2^n for n in [-126, 0]: (n + 127) << 23
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 out = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  return _mm256_andnot_ps(underflow, out);
}

// Widening loads (bf16 -> fp32 is exact: the bits shifted up) and the one rounding at the output.
inline float widen(float x) { return x; }
inline float widen(at::BFloat16 x) { return static_cast<float>(x); }
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline void narrow(float x, float* out) { *out = x; }
inline void narrow(float x, at::BFloat16* out) { *out = at::BFloat16(x); }  // nearest even, as .to() rounds

// scores[j] = dot(q, k_j) * scale for the 8 keys of one block kt [D, 8] (keys transposed)
inline void score_block(const float* q, const float* kt, int64_t D, float scale, float* scores) {
  __m256 acc[kLanes];
  for (int l = 0; l < kLanes; ++l) acc[l] = _mm256_setzero_ps();
  const int64_t whole = D / kLanes * kLanes;
  for (int64_t d = 0; d < whole; d += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] = _mm256_fmadd_ps(_mm256_set1_ps(q[d + l]), _mm256_loadu_ps(kt + (d + l) * kLanes), acc[l]);
  }
  __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])),
                           _mm256_add_ps(_mm256_add_ps(acc[4], acc[5]), _mm256_add_ps(acc[6], acc[7])));
  for (int64_t d = whole; d < D; ++d) s = _mm256_fmadd_ps(_mm256_set1_ps(q[d]), _mm256_loadu_ps(kt + d * kLanes), s);
  _mm256_storeu_ps(scores, _mm256_mul_ps(s, _mm256_set1_ps(scale)));
}

// out[0..n) = (sum_m p[m] v[keys[m]][0..n)) in m order, times 1 / total, where total = p[0] + p[1]
// + ... in m order. Columns in blocks of 64 held in registers, a tail of 8-lane vectors, then
// scalars; the total is summed in the first column pass (its chain of adds overlaps the FMAs).
template <typename T>
void weighted_values(const float* p, const int64_t* keys, int64_t count, const T* v, int64_t ldv, int64_t n, T* out) {
  float total = 0.f;
  bool summed = false;
  int64_t c = 0;
  auto finish = [&](const __m256* acc, int regs, int64_t at) {
    const float inv = 1.f / total;
    for (int r = 0; r < regs; ++r) {
      alignas(32) float lanes[kLanes];
      _mm256_store_ps(lanes, acc[r]);
      for (int64_t e = 0; e < kLanes; ++e) narrow(lanes[e] * inv, out + at + r * kLanes + e);
    }
  };
  for (; c + kOutRegs * kLanes <= n; c += kOutRegs * kLanes) {
    __m256 acc[kOutRegs];
    for (int r = 0; r < kOutRegs; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t m = 0; m < count; ++m) {
      if (!summed) total += p[m];
      const __m256 pm = _mm256_set1_ps(p[m]);
      const T* row = v + keys[m] * ldv + c;
      for (int r = 0; r < kOutRegs; ++r) acc[r] = _mm256_fmadd_ps(pm, load8(row + r * kLanes), acc[r]);
    }
    summed = true;
    finish(acc, kOutRegs, c);
  }
  if (!summed) {
    for (int64_t m = 0; m < count; ++m) total += p[m];
  }
  for (; c + kLanes <= n; c += kLanes) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t m = 0; m < count; ++m) acc = _mm256_fmadd_ps(_mm256_set1_ps(p[m]), load8(v + keys[m] * ldv + c), acc);
    finish(&acc, 1, c);
  }
  const float inv = 1.f / total;
  for (; c < n; ++c) {
    float acc = 0.f;
    for (int64_t m = 0; m < count; ++m) acc = std::fma(p[m], widen(v[keys[m] * ldv + c]), acc);
    narrow(acc * inv, out + c);
  }
}

// seen [B, Tq, Tk] (1: the query row sees the key) from a layer's attention mask [B, 1 or heads,
// Tq, >= Tk]: boolean (true: seen) or additive (0: seen); every head alike, so head 0's
template <typename M>
std::vector<uint8_t> seen_keys(const at::Tensor& mask, int64_t B, int64_t Tq, int64_t Tk) {
  std::vector<uint8_t> seen(B * Tq * Tk);
  const M* base = mask.data_ptr<M>();
  const int64_t sb = mask.stride(0), si = mask.stride(2), sj = mask.stride(3);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < Tq; ++i)
      for (int64_t j = 0; j < Tk; ++j) {
        const M value = base[b * sb + i * si + j * sj];
        if constexpr (std::is_same_v<M, bool>) {
          seen[(b * Tq + i) * Tk + j] = value;
        } else {
          seen[(b * Tq + i) * Tk + j] = static_cast<float>(value) == 0.f;
        }
      }
  return seen;
}

// q [B, H, Tq, D], k [B, Hkv, Tk, D], v [B, Hkv, Tk, Dv] of one dtype T (float32 or bfloat16, any
// strides), `seen` from seen_keys -> [B, Tq, H, Dv] in T. softcap <= 0: none.
template <typename T>
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::vector<uint8_t>& seen, float scale,
                  float cap) {
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Tk = k.size(2), Dv = v.size(3), groups = H / Hkv;
  const int64_t blocks = (Tk + kLanes - 1) / kLanes, ldk = blocks * kLanes;
  // keys in fp32, in blocks of 8 transposed: kt [B, Hkv, blocks, D, 8], zeros past Tk
  std::vector<float> kt(B * Hkv * D * ldk, 0.f);
  const T* kp = k.data_ptr<T>();
  const int64_t kb = k.stride(0), kh = k.stride(1), kj = k.stride(2), kd = k.stride(3);  // read once: stride() is no plain load
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bg = begin; bg < end; ++bg) {
      const T* src = kp + (bg / Hkv) * kb + (bg % Hkv) * kh;
      float* dst = kt.data() + bg * D * ldk;
      for (int64_t j = 0; j < Tk; ++j) {
        float* block = dst + (j / kLanes) * D * kLanes + j % kLanes;
        const T* key = src + j * kj;
        for (int64_t d = 0; d < D; ++d) block[d * kLanes] = widen(key[d * kd]);
      }
    }
  });
  const at::Tensor vc = v.stride(3) == 1 ? v : v.contiguous();
  at::Tensor out = at::empty({B, Tq, H, Dv}, q.options());
  const T* qp = q.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t qb = q.stride(0), qh = q.stride(1), qi = q.stride(2), qd = q.stride(3);
  const int64_t vb = vc.stride(0), vh = vc.stride(1), vj = vc.stride(2);

  at::parallel_for(0, B * Tq * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(ldk), p(ldk + kLanes), qrow(D);
    std::vector<int64_t> keys(Tk);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task % H, i = (task / H) % Tq, b = task / (H * Tq);
      const int64_t g = h / groups;
      const uint8_t* row_seen = seen.data() + (b * Tq + i) * Tk;
      T* o = op + ((b * Tq + i) * H + h) * Dv;
      int64_t last = Tk - 1;
      while (last >= 0 && !row_seen[last]) --last;
      if (last < 0) {  // a row that sees nothing (padding): zeros, never read
        for (int64_t d = 0; d < Dv; ++d) narrow(0.f, o + d);
        continue;
      }
      const T* qsrc = qp + b * qb + h * qh + i * qi;
      for (int64_t d = 0; d < D; ++d) qrow[d] = widen(qsrc[d * qd]);
      const float* kbase = kt.data() + (b * Hkv + g) * D * ldk;
      for (int64_t j = 0; j <= last; j += kLanes) score_block(qrow.data(), kbase + j * D, D, scale, scores.data() + j);
      int64_t n = 0;
      float top = -INFINITY;
      for (int64_t j = 0; j <= last; ++j) {
        if (!row_seen[j]) continue;
        float s = scores[j];
        if (cap > 0.f) s = std::tanh(s / cap) * cap;
        p[n] = s;
        keys[n++] = j;
        top = std::max(top, s);
      }
      const __m256 top8 = _mm256_set1_ps(top);
      for (int64_t m = 0; m < n; m += kLanes) _mm256_storeu_ps(p.data() + m, exp8(_mm256_sub_ps(_mm256_loadu_ps(p.data() + m), top8)));
      weighted_values(p.data(), keys.data(), n, vp + b * vb + g * vh, vj, Dv, o);
    }
  });
  return out;
}

// q [B, H, Tq, D], k [B, Hkv, Tk, D], v [B, Hkv, Tk, Dv] (all float32 or all bfloat16), mask [B, 1
// or H, Tq, >= Tk] (seen_keys) -> [B, Tq, H, Dv] in q's dtype. softcap <= 0: none.
at::Tensor row_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask, double scaling,
                         double softcap) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 4, "row_attention: bad ranks");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && mask.device().is_cpu(),
              "row_attention: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "row_attention: q, k, v all float32 or all bfloat16, got ", q.scalar_type(), k.scalar_type(), v.scalar_type());
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Tk = k.size(2);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && k.size(3) == D && v.size(1) == Hkv && v.size(2) == Tk,
              "row_attention: q, k, v shapes disagree: ", q.sizes(), k.sizes(), v.sizes());
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "row_attention: ", H, " query heads over ", Hkv, " key/value heads");
  TORCH_CHECK(mask.size(0) == B && mask.size(2) == Tq && mask.size(3) >= Tk, "row_attention: the mask is ", mask.sizes(),
              " for ", Tq, " queries over ", Tk, " keys");
  std::vector<uint8_t> seen;
  switch (mask.scalar_type()) {
    case at::kBool: seen = seen_keys<bool>(mask, B, Tq, Tk); break;
    case at::kFloat: seen = seen_keys<float>(mask, B, Tq, Tk); break;
    case at::kBFloat16: seen = seen_keys<at::BFloat16>(mask, B, Tq, Tk); break;
    case at::kHalf: seen = seen_keys<at::Half>(mask, B, Tq, Tk); break;
    default: TORCH_CHECK(false, "row_attention: a boolean or floating mask, got ", mask.scalar_type());
  }
  const float scale = static_cast<float>(scaling), cap = static_cast<float>(softcap);
  if (q.scalar_type() == at::kBFloat16) return attend<at::BFloat16>(q, k, v, seen, scale, cap);
  return attend<float>(q, k, v, seen, scale, cap);
}

}  // namespace

TORCH_LIBRARY(drafthead_attention, m) {
  m.def("row_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scaling, float softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(drafthead_attention, CPU, m) {
  m.impl("row_attention", &row_attention);
}
