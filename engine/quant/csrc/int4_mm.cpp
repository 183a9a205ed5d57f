// Weight-only int4 matmul for a few rows (decode batches, speculative verify rows) on
// x86 CPUs with AVX-512 BF16: y[M, N] = x[M, K] @ W^T in bfloat16, where
// W[n, k] = (q[n, k] - 8) * s + z with (s, z) per group of G along K.
//
// Why our own: aten's _weight_int4pack_mm_for_cpu unpacks the weight again for every
// few rows, so 8 rows cost it 3x one row and a 1 + 7-token verify pass twice a plain
// step. Two paths, both unpacking each block of codes once per call:
// - from amx_min_rows rows (where the CPU has AMX): per tile and group of 32 k the codes
//   become a bf16 B tile (4 instructions per 32 codes: widen, shift, or, a vpermw table
//   lookup of the 16 small integers, exact) and one tdpbf16ps multiplies it by up to 16
//   rows of x at once, so the cost hardly grows with the rows;
// - from dot_min_rows rows without AMX (the AVX-512 BF16 CPUs that lack it, AMD EPYC):
//   the same bf16 pairs of codes, unpacked once per call into a tile buffer, and one
//   vdpbf16ps per row and pair of k (x's two bf16 broadcast against 16 outputs' two
//   codes: the dense bf16 GEMM's instruction, reading a quarter of its bytes);
// - below: AVX-512 FMAs, 16 outputs x 2 k unpacked to fp32 (widen, mask, shift, two
//   int -> float) and multiplied into each row's accumulators.
// gate_up [3072, 576] of the embedded model, 2 threads, 1 / 2 / 4 / 8 / 16 rows:
// 60 / 74 / 108 / 115 / 123 us against aten's 72 / 93 / 131 / 237 / 455.
// Without AMX (AMD EPYC, bench/dense_gemm.py --int4: a decode step's 120 GEMMs, cold),
// 8 / 16 / 32 rows: vdpbf16ps 9.9 / 14.3 / 26.6 ms, FMAs 11.2 / 20.6 / 41.4, the
// prepacked dense bf16 GEMM 11.2 / 15.0 / 23.0 (its 32-row GEMMs run at the bf16 dot
// product's rate too: unpacking, not bytes, is what the int4 path adds there).
//
// Layout (engine/quant/packed.py packs it), per tile of 16 outputs, contiguous:
//   codes uint8 [N/16, K/2, 16]: byte i of pair p = q[16t+i, 2p] | q[16t+i, 2p+1] << 4
//   sz    bf16  [N/16, K/G, 2, 16]: per group the tile's 16 scales, then its 16 zeros
// Per group the sums A = sum_k q x are exact products accumulated in fp32, then
// y += s * A + (z - 8 s) * sum_k x in fp32, rounded to bfloat16 once at the end. On the
// AMX and vdpbf16ps paths a row's arithmetic does not depend on the other rows of the
// call; on the FMA path it depends only on how many rows share its pass (the accumulators
// it gets).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <cstdint>
#include <vector>

namespace {

constexpr int kTile = 16;    // outputs per tile: one zmm of fp32
constexpr int kMaxRows = 8;  // rows per pass over a tile (accumulators in registers)

inline __m512 load_bf16(const at::BFloat16* p) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// R rows of x (fp32, row stride K) times one tile. Every FMA chain waits 4 cycles for
// its last result, so few rows split their sums over more accumulators: per row, by the
// parity of k (R <= 4) and, for one row, also by the parity of the pair.
template <int R>
void tile_rows(const uint8_t* codes, const at::BFloat16* sz, const float* x,
               const float* xsum, at::BFloat16* y, int64_t K, int64_t G, int64_t ldy) {
  constexpr int kChains = R == 1 ? 4 : R <= 4 ? 2 : 1;
  const int64_t groups = K / G, pairs = G / 2;
  const __m512i low4 = _mm512_set1_epi32(0xF);
  const __m512 eight = _mm512_set1_ps(8.0f);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 part[R][kChains];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < kChains; ++j) part[r][j] = _mm512_setzero_ps();
    const uint8_t* c = codes + g * pairs * kTile;
    const float* xg = x + g * G;
    for (int64_t p = 0; p < pairs; p += 2) {  // pairs = G / 2 is even
#pragma GCC unroll 2
      for (int u = 0; u < 2; ++u) {
        __m512i d = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + (p + u) * kTile)));
        __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(d, low4));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(d, 4));
        const int j0 = (2 * u) % kChains, j1 = (2 * u + 1) % kChains;
        for (int r = 0; r < R; ++r) {
          const float* xr = xg + r * K + 2 * (p + u);
          part[r][j0] = _mm512_fmadd_ps(lo, _mm512_set1_ps(xr[0]), part[r][j0]);
          part[r][j1] = _mm512_fmadd_ps(hi, _mm512_set1_ps(xr[1]), part[r][j1]);
        }
      }
    }
    const __m512 s = load_bf16(sz + g * 2 * kTile);
    const __m512 zz = _mm512_fnmadd_ps(eight, s, load_bf16(sz + g * 2 * kTile + kTile));
    for (int r = 0; r < R; ++r) {
      __m512 a = part[r][0];
      for (int j = 1; j < kChains; ++j) a = _mm512_add_ps(a, part[r][j]);
      acc[r] = _mm512_fmadd_ps(s, a, acc[r]);
      acc[r] = _mm512_fmadd_ps(zz, _mm512_set1_ps(xsum[r * groups + g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy),
                        (__m256i)_mm512_cvtneps_pbh(acc[r]));
}

using TileFn = void (*)(const uint8_t*, const at::BFloat16*, const float*, const float*,
                        at::BFloat16*, int64_t, int64_t, int64_t);
constexpr TileFn kTileFns[kMaxRows + 1] = {nullptr,      tile_rows<1>, tile_rows<2>,
                                           tile_rows<3>, tile_rows<4>, tile_rows<5>,
                                           tile_rows<6>, tile_rows<7>, tile_rows<8>};


// bf16 pairs of one pair of k's codes for a tile's 16 outputs: lane i holds
// (q[16t+i, 2p], q[16t+i, 2p+1]) (vpermw reads a word's low 5 bits: & 15 in the table).
inline __m512i code_pairs(const uint8_t* c, __m512i table) {
  const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
  return _mm512_permutexvar_epi16(_mm512_or_si512(d, _mm512_slli_epi32(d, 12)), table);
}

// ---- AMX path (a few rows and up, where the FMA path's cost grows with the rows) ----
// Per tile and group of 32 k, the 16 x 32 codes are unpacked once into a bf16 B tile
// (vpermw from a table of the 16 small integers: exact), multiplied by up to 16 rows'
// A tile of x straight from memory (tdpbf16ps: fp32 accumulation), the group's C tile
// scaled into fp32 accumulators: the vector work per weight does not grow with the rows.

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_permitted() {  // Linux lets a process use the tile registers once it asks
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

inline void kMemoryBarrier() { asm volatile("" ::: "memory"); }

#define TANDEM_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")))

TANDEM_AMX void amx_config(int rows) {
  TileConfig cfg;
  cfg.rows[0] = rows, cfg.colsb[0] = 64;  // C: rows x 16 fp32
  cfg.rows[1] = rows, cfg.colsb[1] = 64;  // A: rows x 32 bf16 of x
  cfg.rows[2] = 16, cfg.colsb[2] = 64;    // B: 16 k-pairs x 16 outputs x 2 bf16
  _tile_loadconfig(&cfg);
}

TANDEM_AMX void amx_tile(const uint8_t* codes, const at::BFloat16* sz, const at::BFloat16* x,
                         const float* xsum, at::BFloat16* y, int rows, int64_t K, int64_t G,
                         int64_t ldy, __m512i table) {
  const int64_t groups = K / G, pairs = G / 2;
  alignas(64) uint16_t b[16 * 32];
  alignas(64) float c[16 * 16];
  __m512 acc[16];
  for (int r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    _tile_zero(0);
    for (int64_t j = 0; j < G / 32; ++j) {
      const uint8_t* cp = codes + (g * pairs + j * 16) * kTile;
      for (int p = 0; p < 16; ++p) _mm512_store_si512(b + p * 32, code_pairs(cp + p * kTile, table));
      kMemoryBarrier();  // gcc's tile intrinsics are asm without a memory clobber
      _tile_loadd(1, x + g * G + j * 32, K * 2);
      _tile_loadd(2, b, 64);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, c, 64);
    kMemoryBarrier();
    const __m512 s = load_bf16(sz + g * 2 * kTile);
    const __m512 zz = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s,
                                       load_bf16(sz + g * 2 * kTile + kTile));
    for (int r = 0; r < rows; ++r) {
      acc[r] = _mm512_fmadd_ps(s, _mm512_load_ps(c + r * 16), acc[r]);
      acc[r] = _mm512_fmadd_ps(zz, _mm512_set1_ps(xsum[r * groups + g]), acc[r]);
    }
  }
  for (int r = 0; r < rows; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy),
                        (__m256i)_mm512_cvtneps_pbh(acc[r]));
}

TANDEM_AMX void amx_release() { _tile_release(); }

// ---- vdpbf16ps path (AVX-512 BF16 without AMX) ----
// A tile's codes become bf16 pairs once (b: K/2 x 32 words), then R rows at a time each
// row sums a group with one vdpbf16ps per pair (exact products, fp32 sums in two chains,
// by the pair's parity, for every R: a row's arithmetic is the same in any call) and
// scales it into fp32 as above.
template <int R>
void dot_rows(const uint16_t* b, const at::BFloat16* sz, const at::BFloat16* x,
              const float* xsum, at::BFloat16* y, int64_t K, int64_t G, int64_t ldy) {
  const int64_t groups = K / G, pairs = G / 2;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 part[R][2];
    for (int r = 0; r < R; ++r) part[r][0] = part[r][1] = _mm512_setzero_ps();
    const uint16_t* bg = b + g * pairs * 32;
    const at::BFloat16* xg = x + g * G;
    for (int64_t p = 0; p < pairs; p += 2) {  // pairs = G / 2 is even
#pragma GCC unroll 2
      for (int u = 0; u < 2; ++u) {
        const __m512bh w = (__m512bh)_mm512_loadu_si512(bg + (p + u) * 32);
        for (int r = 0; r < R; ++r) {
          int32_t two;  // x[r, 2(p+u)] and x[r, 2(p+u) + 1]: the pair vdpbf16ps multiplies
          std::memcpy(&two, xg + r * K + 2 * (p + u), sizeof two);
          part[r][u] = _mm512_dpbf16_ps(part[r][u], (__m512bh)_mm512_set1_epi32(two), w);
        }
      }
    }
    const __m512 s = load_bf16(sz + g * 2 * kTile);
    const __m512 zz = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s,
                                       load_bf16(sz + g * 2 * kTile + kTile));
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(s, _mm512_add_ps(part[r][0], part[r][1]), acc[r]);
      acc[r] = _mm512_fmadd_ps(zz, _mm512_set1_ps(xsum[r * groups + g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy),
                        (__m256i)_mm512_cvtneps_pbh(acc[r]));
}

using DotFn = void (*)(const uint16_t*, const at::BFloat16*, const at::BFloat16*, const float*,
                       at::BFloat16*, int64_t, int64_t, int64_t);
constexpr DotFn kDotFns[kMaxRows + 1] = {nullptr,     dot_rows<1>, dot_rows<2>,
                                         dot_rows<3>, dot_rows<4>, dot_rows<5>,
                                         dot_rows<6>, dot_rows<7>, dot_rows<8>};

__m512i small_int_table() {  // bf16 of (i & 15) for the 32 word indices vpermw reads
  alignas(64) uint16_t tab[32];
  for (int i = 0; i < 32; ++i) {
    float f = static_cast<float>(i & 15);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    tab[i] = static_cast<uint16_t>(u >> 16);
  }
  return _mm512_load_si512(tab);
}

at::Tensor int4_mm(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& sz,
                   int64_t group_size, int64_t amx_min_rows, int64_t dot_min_rows) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16,
              "tandem::int4_mm: x must be [M, K] bfloat16");
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.size(2) == kTile &&
                  codes.is_contiguous(),
              "tandem::int4_mm: codes must be contiguous [N/16, K/2, 16] uint8");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = codes.size(0) * kTile;
  const int64_t G = group_size;
  TORCH_CHECK(G > 0 && G % 32 == 0 && K % G == 0 && codes.size(1) * 2 == K,
              "tandem::int4_mm: K ", K, " does not match the codes or the group size ", G);
  const int64_t groups = K / G;
  TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.is_contiguous() &&
                  sz.numel() == (N / kTile) * groups * 2 * kTile,
              "tandem::int4_mm: scales must be contiguous [N/16, K/G, 2, 16] bfloat16");
  at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const bool amx = M >= amx_min_rows && amx_permitted(), dot = !amx && M >= dot_min_rows;
  // the rows' sums per group (and, for the FMA path, the rows in fp32), once for every tile
  std::vector<float> xf(amx || dot ? 0 : M * K), xs(M * groups);
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      __m512 sum = _mm512_setzero_ps();
      for (int64_t k = g * G; k < (g + 1) * G; k += 16) {  // G is a multiple of 16
        const __m512 v = load_bf16(xp + m * K + k);
        if (!xf.empty()) _mm512_storeu_ps(xf.data() + m * K + k, v);
        sum = _mm512_add_ps(sum, v);
      }
      xs[m * groups + g] = _mm512_reduce_add_ps(sum);
    }
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const at::BFloat16* sp = sz.data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  if (dot) {
    const __m512i table = small_int_table();
    at::parallel_for(0, N / kTile, 1, [&](int64_t t0, int64_t t1) {
      std::vector<uint16_t> b(K / 2 * 32);  // one tile's codes as bf16 pairs
      for (int64_t t = t0; t < t1; ++t) {
        const uint8_t* c = cp + t * (K / 2) * kTile;
        for (int64_t p = 0; p < K / 2; ++p)
          _mm512_storeu_si512(b.data() + p * 32, code_pairs(c + p * kTile, table));
        for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, M - m0));
          kDotFns[rows](b.data(), sp + t * groups * 2 * kTile, xp + m0 * K,
                        xs.data() + m0 * groups, yp + m0 * N + t * kTile, K, G, N);
        }
      }
    });
    return y;
  }
  if (amx) {
    const __m512i table = small_int_table();
    at::parallel_for(0, N / kTile, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t m0 = 0; m0 < M; m0 += 16) {
        const int rows = static_cast<int>(std::min<int64_t>(16, M - m0));
        amx_config(rows);  // per thread: the tile registers are a thread's state
        for (int64_t t = t0; t < t1; ++t)
          amx_tile(cp + t * (K / 2) * kTile, sp + t * groups * 2 * kTile, xp + m0 * K,
                   xs.data() + m0 * groups, yp + m0 * N + t * kTile, rows, K, G, N, table);
      }
      amx_release();
    });
    return y;
  }
  at::parallel_for(0, N / kTile, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* c = cp + t * (K / 2) * kTile;
      const at::BFloat16* s = sp + t * groups * 2 * kTile;
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, M - m0));
        kTileFns[rows](c, s, xf.data() + m0 * K, xs.data() + m0 * groups,
                       yp + m0 * N + t * kTile, K, G, N);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("int4_mm(Tensor x, Tensor codes, Tensor sz, int group_size, int amx_min_rows, "
        "int dot_min_rows=1073741824) -> Tensor");
}
TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("int4_mm", &int4_mm); }
