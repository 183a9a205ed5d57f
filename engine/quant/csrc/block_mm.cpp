// Weight-only matmul over GGUF-style blocks for a few rows (decode batches, verify rows)
// on x86 CPUs with AVX2, FMA and F16C, the instruction sets of an AMD EPYC without
// AVX-512: y[M, N] = x[M, K] @ W^T, where per group of G along K
//     W[n, k] = d[n, g] * q[n, k] + m[n, g]       (d, m fp16: GGUF's own fields)
// with q either int8 codes (Q8_0: m = 0; codes [N, K] int8) or 4-bit codes 0..15 packed
// as GGUF stores them (codes [N, K/2] uint8, per block of 32: byte j holds element j in
// its low nibble and element j + 16 in its high one; Q4_0: m = -8d, Q4_1: m as stored).
// sm [N, K/G, 2] holds (d, m) per group: fp16 bits, as int16 (torch casts float buffers).
//
// Why our own: aten's int8/int4 weight-only kernels have no vectorised fp32 path and no
// block scales at all (Q8_0 had to be requantized per channel, which changed the
// model's tokens), and our AVX-512 int4 kernel (int4_mm.cpp) refuses an AVX2-only CPU.
//
// Exact within fp32 rounding: the codes become fp32 exactly, per group A = sum q x and
// the row's X = sum x are fp32 sums, y = sum_g d A + m X. Multiplied by the identity it
// returns d q + m rounded once: bit for bit the `gguf` package's dequantization.
// Each output's codes are unpacked once per pass of up to kMaxRows rows; a row's result
// depends only on how many rows share its pass (the accumulator chains it gets).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int kBlock = 32;   // codes per unpack: one GGUF block
constexpr int kMaxRows = 4;  // rows per pass (accumulators in the 16 ymm registers)

// 32 codes -> 4 x 8 fp32, in element order.
template <int Bits>
inline void unpack(const uint8_t* c, __m256 w[4]);

template <>
inline void unpack<8>(const uint8_t* c, __m256 w[4]) {
  for (int j = 0; j < 4; ++j)
    w[j] = _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8 * j))));
}

template <>
inline void unpack<4>(const uint8_t* c, __m256 w[4]) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(b, low4);                     // elements 0..15
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);  // elements 16..31
  w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// R rows of x (fp32, row stride K) times one output's codes. An FMA chain waits 4 cycles
// for its last result, so few rows split their sums over more chains.
template <int Bits, int R>
void output_rows(const uint8_t* codes, const uint16_t* sm, const float* x, const float* xsum,
                 float* y, int64_t K, int64_t G, int64_t ldy) {
  constexpr int kChains = R == 1 ? 4 : R == 2 ? 2 : 1;
  const int64_t groups = K / G;
  __m256 acc[R];
  float mins[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), mins[r] = 0.0f;
  for (int64_t g = 0; g < groups; ++g) {
    __m256 part[R][kChains];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < kChains; ++j) part[r][j] = _mm256_setzero_ps();
    for (int64_t k0 = g * G; k0 < (g + 1) * G; k0 += kBlock) {
      __m256 w[4];
      unpack<Bits>(codes + k0 * Bits / 8, w);
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j)
          part[r][j % kChains] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(x + r * K + k0 + 8 * j),
                                                 part[r][j % kChains]);
    }
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(sm[2 * g]));
    const float m = _cvtsh_ss(sm[2 * g + 1]);
    for (int r = 0; r < R; ++r) {
      __m256 a = part[r][0];
      for (int j = 1; j < kChains; ++j) a = _mm256_add_ps(a, part[r][j]);
      acc[r] = _mm256_fmadd_ps(d, a, acc[r]);
      mins[r] += m * xsum[r * groups + g];
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = hsum(acc[r]) + mins[r];
}

using RowsFn = void (*)(const uint8_t*, const uint16_t*, const float*, const float*, float*,
                        int64_t, int64_t, int64_t);

template <int Bits>
constexpr RowsFn kRowsFns[kMaxRows + 1] = {nullptr, output_rows<Bits, 1>, output_rows<Bits, 2>,
                                           output_rows<Bits, 3>, output_rows<Bits, 4>};

at::Tensor block_mm(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& sm,
                    int64_t group_size) {
  TORCH_CHECK(x_in.dim() == 2 && (x_in.scalar_type() == at::kFloat ||
                                  x_in.scalar_type() == at::kBFloat16),
              "tandem::block_mm: x must be [M, K] float32 or bfloat16");
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() &&
                  (codes.scalar_type() == at::kChar || codes.scalar_type() == at::kByte),
              "tandem::block_mm: codes must be contiguous [N, K] int8 or [N, K/2] uint8");
  const int bits = codes.scalar_type() == at::kChar ? 8 : 4;
  const int64_t M = x_in.size(0), K = x_in.size(1), N = codes.size(0), G = group_size;
  TORCH_CHECK(G > 0 && G % kBlock == 0 && K % G == 0 && codes.size(1) * 8 / bits == K,
              "tandem::block_mm: K ", K, " does not match the codes or the group size ", G);
  const int64_t groups = K / G;
  TORCH_CHECK(sm.scalar_type() == at::kShort && sm.is_contiguous() && sm.numel() == N * groups * 2,
              "tandem::block_mm: scales must be contiguous [N, K/G, 2] int16 (float16 bits)");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y.to(x_in.scalar_type());
  const float* xp = x.data_ptr<float>();
  std::vector<float> xs(M * groups);  // each row's sum per group (the mins' factor)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      __m256 s = _mm256_setzero_ps();
      for (int64_t k = g * G; k < (g + 1) * G; k += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(xp + m * K + k));
      xs[m * groups + g] = hsum(s);
    }
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(sm.data_ptr<int16_t>());
  float* yp = y.data_ptr<float>();
  const RowsFn* fns = bits == 8 ? kRowsFns<8> : kRowsFns<4>;
  const int64_t row_bytes = K * bits / 8;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, M - m0));
        fns[rows](cp + n * row_bytes, sp + n * groups * 2, xp + m0 * K, xs.data() + m0 * groups,
                  yp + m0 * N + n, K, G, N);
      }
  });
  return x_in.scalar_type() == at::kFloat ? y : y.to(x_in.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("block_mm(Tensor x, Tensor codes, Tensor sm, int group_size) -> Tensor");
}
TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("block_mm", &block_mm); }
