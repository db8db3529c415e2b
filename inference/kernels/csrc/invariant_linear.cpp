// Row-invariant bf16 linears on the CPU's native bf16 instructions: y = x @ w^T (+ bias) for bf16 x
// and w, where each output element sums its K products in one fixed order whatever the number of
// rows of the call (docs/acceptance.md "Row invariance", inference/kernels/invariant_linear.py).
//
// Two paths, chosen at run time by what the CPU has (`paths()`, fastest first):
//
//   amx           AMX tiles (amx_tile, amx_bf16): C[16 x 16] fp32 += A[16 rows x 32 k] . B[32 k x 16]
//                 (_tile_dpbf16ps). Every call uses one tile shape, 16 rows x 64 bytes, whatever
//                 the row count: x is read as whole 16-row blocks of whole 32-k blocks, zeros past
//                 its rows and K, so an output element is the same sequence of tile instructions
//                 (k blocks in order) applied to a row of the same kind of tile, alone or among 64.
//   avx512_bf16   vdpbf16ps (Zen 4, Cooper Lake and later Xeons): acc[16 columns] += the products
//                 of one k pair, for each pair in order; a register tile of up to 6 rows x 4
//                 panels (24 accumulators), each row with its own accumulators, so the row count
//                 changes only how many rows share a weight load.
//
// Both read one weight layout, `pack(w)`: w [N, K] -> [P = ceil(N / 32) * 2, K2 = ceil(K / 32) * 16,
// 16, 2] bf16, panel p holding output columns 16p..16p+15 as k pairs (k = 2j, 2j + 1) in k order:
// one k pair of a panel is 64 contiguous bytes (one zmm), and 16 pairs of a panel are one AMX B
// tile. Columns past N and k past K are zeros.
//
// Numerics: the products of two bf16 values are exact in fp32; the instructions add them into fp32
// accumulators (round to nearest even, denormals flushed), so an output is within the fp32
// accumulation bound of the exact sum (tests/test_invariant_linear.py checks it against float64).
// Bias is added in fp32 and the result rounded to bf16 once, at the end, as the panel kernel does.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#if defined(__clang__)
#define DRAFTHEAD_BF16_ISA (__clang_major__ >= 9)
#define DRAFTHEAD_AMX_ISA (__clang_major__ >= 12)
#elif defined(__GNUC__)
#define DRAFTHEAD_BF16_ISA (__GNUC__ >= 10)
#define DRAFTHEAD_AMX_ISA (__GNUC__ >= 11)
#else
#define DRAFTHEAD_BF16_ISA 0
#define DRAFTHEAD_AMX_ISA 0
#endif

namespace {

constexpr int64_t kCols = 16;   // output columns per panel: 16 fp32 lanes, one tile row of C
constexpr int64_t kTileK = 32;  // k per AMX step: a tile row of A is 32 bf16 (64 bytes)
constexpr int64_t kTileRows = 16;
constexpr int64_t kPanelGroup = 2;  // panels are padded to a multiple of this (the AMX kernel's 2 C tiles)

#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,amx-tile,amx-bf16")))
#define AVX512_TARGET __attribute__((target("avx512f")))

// Rounding to bf16 as c10::BFloat16 does (nearest even; any NaN -> 0x7FC0), 16 lanes at a time.
AVX512_TARGET inline void store_bf16(const float* acc, const float* bias, int64_t width, uint16_t* out) {
  const __mmask16 lanes = static_cast<__mmask16>((1u << width) - 1u);
  __m512 v = _mm512_maskz_loadu_ps(lanes, acc);
  if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(lanes, bias));
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm512_mask_cvtepi32_storeu_epi16(out, lanes, r);
}

// acc [rows, ld] fp32 -> out rows [rows, N] bf16 at columns n0..n0+width (bias [N] or null)
AVX512_TARGET void store_rows(const float* acc, int64_t ld, int64_t rows, const float* bias, int64_t n0, int64_t width,
                              uint16_t* out, int64_t N) {
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t c = 0; c < width; c += kCols) {
      store_bf16(acc + i * ld + c, bias == nullptr ? nullptr : bias + n0 + c, std::min(kCols, width - c), out + i * N + n0 + c);
    }
  }
}

// ---- the CPU: which paths may run --------------------------------------------------------------

bool request_amx() {
  // Linux hands out AMX tile state only to a process that asked for it (arch_prctl
  // ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); the grant holds for every thread of the process.
#if defined(__linux__) && defined(SYS_arch_prctl)
  constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

// CPUID leaf 7 sub-leaf `sub` (eax, ebx, ecx, edx), or zeros where the CPU has no such leaf
void leaf7(unsigned sub, unsigned r[4]) {
  r[0] = r[1] = r[2] = r[3] = 0;
  if (__get_cpuid_max(0, nullptr) >= 7) __cpuid_count(7, sub, r[0], r[1], r[2], r[3]);
}

// The state components the OS saves for us (XCR0), 0 where it has no XSAVE
uint64_t os_state() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0;  // OSXSAVE
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

std::vector<std::string> runnable_paths() {
  unsigned l0[4], l1[4];
  leaf7(0, l0);
  leaf7(1, l1);
  const uint64_t xcr0 = os_state();
  const bool zmm_state = (xcr0 & 0xE6) == 0xE6;  // SSE, AVX, opmask and both ZMM halves
  const bool avx512 = zmm_state && (l0[1] & (1u << 16)) && (l0[1] & (1u << 30)) && (l0[1] & (1u << 31));  // f, bw, vl
  std::vector<std::string> found;
#if DRAFTHEAD_AMX_ISA
  const bool tiles = (xcr0 & (3ull << 17)) == (3ull << 17);  // XTILECFG, XTILEDATA
  if (avx512 && tiles && (l0[3] & (1u << 24)) && (l0[3] & (1u << 22)) && request_amx()) found.push_back("amx");  // amx_tile, amx_bf16
#endif
#if DRAFTHEAD_BF16_ISA
  if (avx512 && (l1[0] & (1u << 5))) found.push_back("avx512_bf16");
#endif
  return found;
}

const std::vector<std::string>& cpu_paths() {
  static const std::vector<std::string> found = runnable_paths();  // asked once per process
  return found;
}

bool runnable(const std::string& path) {
  const auto& found = cpu_paths();
  return std::find(found.begin(), found.end(), path) != found.end();
}

// ---- avx512_bf16 --------------------------------------------------------------------------------

#if DRAFTHEAD_BF16_ISA
constexpr int kRowsBf16 = 6;    // rows per register tile
constexpr int kPanelsBf16 = 4;  // panels per register tile: 6 x 4 accumulators + 4 weights + 1 broadcast

// acc[i][n * 16 + c] = sum over k pairs j < K2 (in order) of x[i, 2j..2j+1] . panel_n[j][c][0..1]
template <int MR, int NR>
BF16_TARGET void dp_tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t panel_stride, int64_t K2, float* acc) {
  __m512 c[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int n = 0; n < NR; ++n) c[i][n] = _mm512_setzero_ps();
  for (int64_t j = 0; j < K2; ++j) {
    __m512bh b[NR];
    for (int n = 0; n < NR; ++n) b[n] = (__m512bh)_mm512_loadu_si512(w + n * panel_stride + j * 2 * kCols);
    for (int i = 0; i < MR; ++i) {
      int32_t pair;
      std::memcpy(&pair, x + i * ldx + 2 * j, sizeof pair);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int n = 0; n < NR; ++n) c[i][n] = _mm512_dpbf16_ps(c[i][n], a, b[n]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int n = 0; n < NR; ++n) _mm512_storeu_ps(acc + i * kPanelsBf16 * kCols + n * kCols, c[i][n]);
}

template <int NR>
BF16_TARGET void dp_rows(int rows, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t panel_stride, int64_t K2, float* acc) {
  switch (rows) {
    case 1: dp_tile<1, NR>(x, ldx, w, panel_stride, K2, acc); break;
    case 2: dp_tile<2, NR>(x, ldx, w, panel_stride, K2, acc); break;
    case 3: dp_tile<3, NR>(x, ldx, w, panel_stride, K2, acc); break;
    case 4: dp_tile<4, NR>(x, ldx, w, panel_stride, K2, acc); break;
    case 5: dp_tile<5, NR>(x, ldx, w, panel_stride, K2, acc); break;
    default: dp_tile<6, NR>(x, ldx, w, panel_stride, K2, acc); break;
  }
}

// panel groups [g0, g1) of kPanelsBf16 panels, every row
BF16_TARGET void bf16_chunk(int64_t g0, int64_t g1, const uint16_t* x, int64_t M, int64_t ldx, const uint16_t* w, int64_t P,
                            int64_t K2, int64_t K2p, const float* bias, uint16_t* y, int64_t N) {
  alignas(64) float acc[kRowsBf16 * kPanelsBf16 * kCols];
  const int64_t panel_stride = K2p * 2 * kCols;
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t p0 = g * kPanelsBf16, panels = std::min<int64_t>(kPanelsBf16, P - p0);
    const int64_t n0 = p0 * kCols, width = std::min(panels * kCols, N - n0);
    const uint16_t* wg = w + p0 * panel_stride;
    for (int64_t m = 0; m < M; m += kRowsBf16) {
      const int rows = static_cast<int>(std::min<int64_t>(kRowsBf16, M - m));
      const uint16_t* xm = x + m * ldx;
      switch (panels) {
        case 1: dp_rows<1>(rows, xm, ldx, wg, panel_stride, K2, acc); break;
        case 2: dp_rows<2>(rows, xm, ldx, wg, panel_stride, K2, acc); break;
        case 3: dp_rows<3>(rows, xm, ldx, wg, panel_stride, K2, acc); break;
        default: dp_rows<4>(rows, xm, ldx, wg, panel_stride, K2, acc); break;
      }
      store_rows(acc, kPanelsBf16 * kCols, rows, bias, n0, width, y + m * N, N);
    }
  }
}

void run_bf16(const uint16_t* x, int64_t M, int64_t ldx, int64_t K, const uint16_t* w, int64_t P, int64_t K2p, const float* bias,
              uint16_t* y, int64_t N) {
  // the panels that hold columns < N (pack pads to whole pairs of panels)
  const int64_t panels = (N + kCols - 1) / kCols, groups = (panels + kPanelsBf16 - 1) / kPanelsBf16, K2 = (K + 1) / 2;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) { bf16_chunk(g0, g1, x, M, ldx, w, panels, K2, K2p, bias, y, N); });
}
#endif

// ---- amx ------------------------------------------------------------------------------------------

#if DRAFTHEAD_AMX_ISA
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// x as whole 16-row blocks of whole 32-k blocks: rows past M and k past K read zeros. Where K is a
// multiple of 32 the full blocks are x itself and only the last, partial one is a copy.
struct RowBlocks {
  const uint16_t* x;  // full blocks: rows of `ld` bf16
  int64_t ld;
  int64_t full;       // blocks read from x
  std::vector<uint16_t> rest;  // the blocks after them, zero-padded, rows of `ld_rest`
  int64_t ld_rest;

  RowBlocks(const uint16_t* rows, int64_t M, int64_t K, int64_t Kp) : x(rows), ld(K), full(K == Kp ? M / kTileRows : 0), ld_rest(Kp) {
    const int64_t first = full * kTileRows, blocks = (M + kTileRows - 1) / kTileRows - full;
    rest.assign(blocks * kTileRows * Kp, 0);
    for (int64_t m = first; m < M; ++m) std::memcpy(rest.data() + (m - first) * Kp, rows + m * K, K * sizeof(uint16_t));
  }
  const uint16_t* block(int64_t b) const { return b < full ? x + b * kTileRows * ld : rest.data() + (b - full) * kTileRows * ld_rest; }
  int64_t stride(int64_t b) const { return (b < full ? ld : ld_rest) * 2; }  // bytes
};

// Tiles: 0..3 accumulators C[m block][panel], 4..5 x blocks, 6..7 weight tiles; all 16 x 64 bytes.
template <bool TwoBlocks>
AMX_TARGET void amx_block(const RowBlocks& x, int64_t m_block, const uint16_t* b0, const uint16_t* b1, int64_t KB, float* acc) {
  _tile_zero(0);
  _tile_zero(1);
  if (TwoBlocks) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const uint16_t* x0 = x.block(m_block);
  const uint16_t* x1 = TwoBlocks ? x.block(m_block + 1) : nullptr;
  const int64_t s0 = x.stride(m_block), s1 = TwoBlocks ? x.stride(m_block + 1) : 0;
  for (int64_t kb = 0; kb < KB; ++kb) {
    _tile_loadd(6, b0 + kb * kTileK * kCols, 2 * kCols * 2);
    _tile_loadd(7, b1 + kb * kTileK * kCols, 2 * kCols * 2);
    _tile_loadd(4, x0 + kb * kTileK, s0);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (TwoBlocks) {
      _tile_loadd(5, x1 + kb * kTileK, s1);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  constexpr int64_t ld = 2 * kCols * 4;  // acc [32 rows][32 columns] fp32, in bytes
  _tile_stored(0, acc, ld);
  _tile_stored(1, acc + kCols, ld);
  if (TwoBlocks) {
    _tile_stored(2, acc + kTileRows * 2 * kCols, ld);
    _tile_stored(3, acc + kTileRows * 2 * kCols + kCols, ld);
  }
}

// panel pairs [q0, q1), every row
AMX_TARGET void amx_chunk(int64_t q0, int64_t q1, const RowBlocks& x, int64_t M, const uint16_t* w, int64_t K2p, const float* bias,
                          uint16_t* y, int64_t N) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kTileRows;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
  alignas(64) float acc[2 * kTileRows * 2 * kCols];
  const int64_t panel_stride = K2p * 2 * kCols, KB = K2p * 2 / kTileK, blocks = (M + kTileRows - 1) / kTileRows;
  for (int64_t q = q0; q < q1; ++q) {
    const int64_t n0 = q * 2 * kCols, width = std::min(2 * kCols, N - n0);
    if (width <= 0) continue;
    const uint16_t* b0 = w + 2 * q * panel_stride;
    for (int64_t blk = 0; blk < blocks; blk += 2) {
      if (blk + 1 < blocks) {
        amx_block<true>(x, blk, b0, b0 + panel_stride, KB, acc);
      } else {
        amx_block<false>(x, blk, b0, b0 + panel_stride, KB, acc);
      }
      const int64_t m = blk * kTileRows;
      store_rows(acc, 2 * kCols, std::min(2 * kTileRows, M - m), bias, n0, width, y + m * N, N);
    }
  }
  _tile_release();
}

void run_amx(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t P, int64_t K2p, const float* bias, uint16_t* y, int64_t N) {
  const RowBlocks blocks(x, M, K, 2 * K2p);
  at::parallel_for(0, P / 2, 1, [&](int64_t q0, int64_t q1) { amx_chunk(q0, q1, blocks, M, w, K2p, bias, y, N); });
}
#endif

// ---- ops ------------------------------------------------------------------------------------------

std::vector<std::string> paths() { return cpu_paths(); }

// w [N, K] bfloat16 -> [P, K2, 16, 2] (module comment)
at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.device().is_cpu(),
              "invariant_linear.pack: a bfloat16 CPU weight [N, K] only, got ", w.scalar_type(), " ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t P = (N + kPanelGroup * kCols - 1) / (kPanelGroup * kCols) * kPanelGroup;
  const int64_t Kp = (K + kTileK - 1) / kTileK * kTileK;
  at::Tensor padded = at::zeros({P * kCols, Kp}, w.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
  // [P, 16 columns, K2, 2] -> [P, K2, 16 columns, 2]
  return padded.view({P, kCols, Kp / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// x [M, K] bfloat16, packed from pack(), bias [N] or none -> [M, N] bfloat16
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t N,
                  const std::string& path) {
  TORCH_CHECK(runnable(path), "invariant_linear: path '", path, "' cannot run on this CPU or build");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "invariant_linear.linear: a bfloat16 CPU input [M, K] only, got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.size(2) == kCols && packed.size(3) == 2,
              "invariant_linear.linear: weights must come from pack(), got ", packed.sizes());
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0), K2p = packed.size(1);
  TORCH_CHECK(K <= 2 * K2p && K > 2 * K2p - kTileK, "invariant_linear.linear: x has ", K, " features, the weight ", 2 * K2p, " (padded)");
  TORCH_CHECK(N <= P * kCols && N > P * kCols - kPanelGroup * kCols, "invariant_linear.linear: N = ", N, " does not match ", P, " panels");
  at::Tensor b32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "invariant_linear.linear: bias has ", bias->numel(), " entries, N = ", N);
    b32 = bias->to(at::kFloat).contiguous();
  }
  const float* b = b32.defined() ? b32.data_ptr<float>() : nullptr;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  uint16_t* out = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
#if DRAFTHEAD_AMX_ISA
  if (path == "amx") {
    const at::Tensor xc = x.contiguous();
    run_amx(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), M, K, w, P, K2p, b, out, N);
    return y;
  }
#endif
#if DRAFTHEAD_BF16_ISA
  if (path == "avx512_bf16") {
    // an odd K reads one k pair past the row: pad it with a zero
    const at::Tensor xp = K % 2 == 0 ? x.contiguous() : at::constant_pad_nd(x, {0, 1}, 0).contiguous();
    run_bf16(reinterpret_cast<const uint16_t*>(xp.data_ptr<at::BFloat16>()), M, xp.size(1), K, w, P, K2p, b, out, N);
    return y;
  }
#endif
  TORCH_CHECK(false, "invariant_linear: unknown path '", path, "'");
}

}  // namespace

TORCH_LIBRARY(drafthead_invariant, m) {
  m.def("paths() -> str[]", &paths);
  m.def("pack(Tensor w) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int N, str path) -> Tensor");
}

TORCH_LIBRARY_IMPL(drafthead_invariant, CPU, m) {
  m.impl("pack", &pack);
  m.impl("linear", &linear);
}
