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
// the row's X = sum x are fp32 sums (8 lanes each), y = sum_g d A + m X. Multiplied by
// the identity it returns d q + m rounded as the `gguf` package rounds it (d q, then + m):
// bit for bit its dequantization.
// Cost (AMD EPYC 7xx3, one core, a 576 x 576 Q4_1 weight in cache, one row): 3.1 ns a
// block of 32, against 4.4 before the output's scales were converted once per output,
// the nibbles widened from memory and the group loop unrolled for G = 32.
// Each output's codes are unpacked once per pass of up to kMaxRows rows; a row's result
// depends only on how many rows share its pass (the accumulator chains it gets).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

constexpr int kBlock = 32;   // codes per unpack: one GGUF block
constexpr int kMaxRows = 4;  // rows per pass (accumulators in the 16 ymm registers)
constexpr int64_t kStackGroups = 2048;  // groups whose (d, m) a pass keeps on its stack (K 64k at G 32)

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
  // 8 bytes zero-extended to 8 lanes (a load and one shuffle): their low nibbles are
  // elements 8h..8h+7, their high ones 16 + 8h..
  const __m256i low4 = _mm256_set1_epi32(0x0F);
  for (int h = 0; h < 2; ++h) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8 * h)));
    w[h] = _mm256_cvtepi32_ps(_mm256_and_si256(b, low4));
    w[2 + h] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// R rows of x (fp32, row stride K) times one output's codes, as
//     y = sum_g d_g (sum_{k in g} q_k x_k) + m_g (sum_{k in g} x_k)
// with both sums kept as 8 lanes until the end: per group, A (the codes times x, one
// chain of FMAs per row) is scaled by d into one accumulator and xg (the row's 8-lane
// group sums, made once per call) by m into another. The output's (d, m) become fp32
// once, so a group broadcasts them from memory. At one row the sums over the groups
// alternate between two accumulator pairs: a group then costs less than an FMA's latency.
// PG: blocks per group where the caller knows it (GGUF's groups of 32), else 0.
template <int R>
struct Sums {
  static constexpr int kPairs = R == 1 ? 2 : 1;  // accumulator pairs per row
  __m256 d[R][kPairs], m[R][kPairs];
};

template <int Bits, int R, int PG, int P>
inline void one_group(const uint8_t* codes, const float* dm, const float* x, const float* xg,
                      Sums<R>& s, int64_t g, int64_t K, int64_t G, int64_t groups) {
  const int64_t per_group = PG ? PG : G / kBlock;
  __m256 part[R];
  for (int r = 0; r < R; ++r) part[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < per_group; ++b) {
    const int64_t k0 = g * G + b * kBlock;
    __m256 w[4];
    unpack<Bits>(codes + k0 * Bits / 8, w);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j)
        part[r] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(x + r * K + k0 + 8 * j), part[r]);
  }
  const __m256 d = _mm256_broadcast_ss(dm + 2 * g), m = _mm256_broadcast_ss(dm + 2 * g + 1);
  for (int r = 0; r < R; ++r) {
    s.d[r][P] = _mm256_fmadd_ps(d, part[r], s.d[r][P]);
    s.m[r][P] = _mm256_fmadd_ps(m, _mm256_loadu_ps(xg + (r * groups + g) * 8), s.m[r][P]);
  }
}

template <int Bits, int R, int PG>
void output_rows(const uint8_t* codes, const uint16_t* sm, const float* x, const float* xg,
                 float* y, int64_t K, int64_t G, int64_t ldy) {
  constexpr int kPairs = Sums<R>::kPairs;
  const int64_t groups = K / G;
  float stack[2 * kStackGroups];  // the output's (d, m) in fp32; a longer row's on the heap
  std::vector<float> heap(groups > kStackGroups ? 2 * groups : 0);
  float* dm = heap.empty() ? stack : heap.data();
  int64_t i = 0;
  for (; i + 8 <= 2 * groups; i += 8)
    _mm256_storeu_ps(dm + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sm + i))));
  for (; i < 2 * groups; ++i) dm[i] = _cvtsh_ss(sm[i]);
  Sums<R> s;
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < kPairs; ++p) s.d[r][p] = s.m[r][p] = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + kPairs <= groups; g += kPairs) {
    one_group<Bits, R, PG, 0>(codes, dm, x, xg, s, g, K, G, groups);
    if constexpr (kPairs == 2) one_group<Bits, R, PG, 1>(codes, dm, x, xg, s, g + 1, K, G, groups);
  }
  if (g < groups) one_group<Bits, R, PG, 0>(codes, dm, x, xg, s, g, K, G, groups);
  for (int r = 0; r < R; ++r) {
    __m256 t = _mm256_add_ps(s.d[r][0], s.m[r][0]);
    for (int p = 1; p < kPairs; ++p) t = _mm256_add_ps(t, _mm256_add_ps(s.d[r][p], s.m[r][p]));
    y[r * ldy] = hsum(t);
  }
}

using RowsFn = void (*)(const uint8_t*, const uint16_t*, const float*, const float*, float*,
                        int64_t, int64_t, int64_t);

template <int Bits, int PG>
constexpr RowsFn kRowsFns[kMaxRows + 1] = {nullptr, output_rows<Bits, 1, PG>, output_rows<Bits, 2, PG>,
                                           output_rows<Bits, 3, PG>, output_rows<Bits, 4, PG>};

struct Shape {
  int bits;
  int64_t M, K, N, G, groups;
};

// Both products' arguments: x [M, K] float32/bfloat16, codes and (d, m) as above.
Shape check_args(const char* op, const at::Tensor& x, const at::Tensor& codes,
                 const at::Tensor& sm, int64_t G) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              op, ": x must be [M, K] float32 or bfloat16");
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() &&
                  (codes.scalar_type() == at::kChar || codes.scalar_type() == at::kByte),
              op, ": codes must be contiguous [N, K] int8 or [N, K/2] uint8");
  const int bits = codes.scalar_type() == at::kChar ? 8 : 4;
  const int64_t K = x.size(1), N = codes.size(0);
  TORCH_CHECK(G > 0 && G % kBlock == 0 && K % G == 0 && codes.size(1) * 8 / bits == K,
              op, ": K ", K, " does not match the codes or the group size ", G);
  TORCH_CHECK(sm.scalar_type() == at::kShort && sm.is_contiguous() && sm.numel() == N * (K / G) * 2,
              op, ": scales must be contiguous [N, K/G, 2] int16 (float16 bits)");
  return {bits, x.size(0), K, N, G, K / G};
}

// pass(n, m0, rows) for every output n and pass of up to kMaxRows rows from m0; threads
// split the outputs, so each output's codes are read by one thread, once per pass.
template <class Pass>
void over_outputs(const Shape& sh, const Pass& pass) {
  at::parallel_for(0, sh.N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m0 = 0; m0 < sh.M; m0 += kMaxRows)
        pass(n, m0, static_cast<int>(std::min<int64_t>(kMaxRows, sh.M - m0)));
  });
}

at::Tensor block_mm(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& sm,
                    int64_t group_size) {
  const Shape sh = check_args("tandem::block_mm", x_in, codes, sm, group_size);
  const int64_t M = sh.M, K = sh.K, N = sh.N, G = sh.G, groups = sh.groups;
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y.to(x_in.scalar_type());
  const float* xp = x.data_ptr<float>();
  std::vector<float> xg(M * groups * 8);  // each row's sum per group in 8 lanes (m's factor)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      __m256 s = _mm256_setzero_ps();
      for (int64_t k = g * G; k < (g + 1) * G; k += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(xp + m * K + k));
      _mm256_storeu_ps(xg.data() + (m * groups + g) * 8, s);
    }
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(sm.data_ptr<int16_t>());
  float* yp = y.data_ptr<float>();
  const bool one = G == kBlock;  // GGUF's groups: one block each
  const RowsFn* fns = sh.bits == 8 ? (one ? kRowsFns<8, 1> : kRowsFns<8, 0>)
                                   : (one ? kRowsFns<4, 1> : kRowsFns<4, 0>);
  const int64_t row_bytes = K * sh.bits / 8;
  over_outputs(sh, [&](int64_t n, int64_t m0, int rows) {
    fns[rows](cp + n * row_bytes, sp + n * groups * 2, xp + m0 * K, xg.data() + m0 * groups * 8,
              yp + m0 * N + n, K, G, N);
  });
  return x_in.scalar_type() == at::kFloat ? y : y.to(x_in.scalar_type());
}

// The same blocks times int8 activations (tandem::block_mm_i8), as llama.cpp multiplies GGUF blocks
// on a CPU (its q4_1 x q8_1 and q8_0 x q8_0 dot products): on request only
// (--activation-quant int8), since it is not the file's exact product.
//
// Each call quantizes the activations x [M, K] once, per block of 32 along K:
//     dx = max|x| / 127,  qx = round(x / dx) (ties to even; dx = 0 gives qx = 0),
// then, with the weights as block_mm.cpp holds them (W = d q + m per group of G, codes q
// int8 or GGUF's nibbles 0..15, (d, m) fp16 bits),
//     y[r, n] = sum_g ( d_g sum_{b in g} dx_b I_b  +  m_g sum_{b in g} dx_b S_b )
// with I_b = sum q qx and S_b = sum qx over block b: integers, summed exactly in int32 by
// _mm256_maddubs_epi16 (u8 x s8 -> pairs in int16, at most 2 * 128 * 127: no saturation)
// and _mm256_madd_epi16. Nibbles are unsigned already; int8 codes go in as |q| with q's
// sign moved onto qx (_mm256_sign_epi8; qx is within +-127, so the flip cannot overflow).
// Per block of 32 that is one load and two masks (4-bit) per output, then per row
// maddubs, madd, one int->float and one FMA: a third of block_mm's fp32 unpacking.
//
// Why our own: aten has no int8 x int8 kernel over per-32 block scales (torch._int_mm is
// one scale per matrix), and llama.cpp's are not a library we can call on torch tensors.

// One row: K fp32 -> K int8 codes, a scale and the codes' sum per block of 32.
void quantize_row(const float* x, int8_t* q, float* dx, int32_t* sx, int64_t K) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo packs' lanes
  for (int64_t b = 0; b < K / kBlock; ++b) {
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(x + b * kBlock + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float d = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))) / 127.0f;
    const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    __m256i i[4];
    for (int j = 0; j < 4; ++j)
      i[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], id),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_hadd_epi32(s4, s4);
    sx[b] = _mm_cvtsi128_si32(_mm_hadd_epi32(s4, s4));
    dx[b] = d;
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]),
                                         _mm256_packs_epi32(i[2], i[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock),
                        _mm256_permutevar8x32_epi32(p, order));
  }
}

// 32 codes as unsigned bytes (nibbles, or |q| for int8 codes) in element order.
template <int Bits>
inline __m256i load_codes(const uint8_t* c);

template <>
inline __m256i load_codes<8>(const uint8_t* c) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
}

template <>
inline __m256i load_codes<4>(const uint8_t* c) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
}

// R rows of quantized x (codes qx row stride K, scales dx row stride K/32, xs: each row's
// sum_b dx S per group) times one output's codes.
template <int Bits, int R>
void output_rows_i8(const uint8_t* codes, const uint16_t* sm, const int8_t* qx, const float* dx,
                 const float* xs, float* y, int64_t K, int64_t G, int64_t ldy) {
  const int64_t groups = K / G, per_group = G / kBlock, blocks = K / kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  float mins[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), mins[r] = 0.0f;
  for (int64_t g = 0; g < groups; ++g) {
    const float d = _cvtsh_ss(sm[2 * g]), m = _cvtsh_ss(sm[2 * g + 1]);
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      const __m256i w = load_codes<Bits>(codes + b * kBlock * Bits / 8);
      const __m256i wu = Bits == 8 ? _mm256_sign_epi8(w, w) : w;
      for (int r = 0; r < R; ++r) {
        __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + r * K + b * kBlock));
        if (Bits == 8) xq = _mm256_sign_epi8(xq, w);
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wu, xq), ones);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * dx[r * blocks + b]),
                                 acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) mins[r] += m * xs[r * groups + g];
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = hsum(acc[r]) + mins[r];
}

using RowsI8Fn = void (*)(const uint8_t*, const uint16_t*, const int8_t*, const float*,
                        const float*, float*, int64_t, int64_t, int64_t);

template <int Bits>
constexpr RowsI8Fn kRowsI8Fns[kMaxRows + 1] = {
    nullptr, output_rows_i8<Bits, 1>, output_rows_i8<Bits, 2>, output_rows_i8<Bits, 3>,
    output_rows_i8<Bits, 4>};

// x [M, K] float32/bfloat16 -> (codes [M, K] int8, scales [M, K/32] fp32, sums [M, K/32]
// int32): what block_mm_i8 multiplies by, exposed so tests can check it against torch.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_act_q8(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) % kBlock == 0,
              "tandem::quantize_act_q8: x must be [M, K] with K a multiple of 32");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, K / kBlock}, x.options());
  at::Tensor s = at::empty({M, K / kBlock}, x.options().dtype(at::kInt));
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      quantize_row(x.data_ptr<float>() + m * K, q.data_ptr<int8_t>() + m * K,
                   d.data_ptr<float>() + m * (K / kBlock), s.data_ptr<int32_t>() + m * (K / kBlock), K);
  });
  return {q, d, s};
}

at::Tensor block_mm_i8(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& sm,
                       int64_t group_size) {
  const Shape sh = check_args("tandem::block_mm_i8", x_in, codes, sm, group_size);
  const int64_t M = sh.M, K = sh.K, N = sh.N, G = sh.G, groups = sh.groups, blocks = K / kBlock;
  at::Tensor y = at::empty({M, N}, x_in.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return y.to(x_in.scalar_type());
  auto [q, d, s] = quantize_act_q8(x_in);
  at::Tensor xs = (d * s.to(at::kFloat)).view({M, groups, G / kBlock}).sum(-1).contiguous();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float *dp = d.data_ptr<float>(), *xsp = xs.data_ptr<float>();
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(sm.data_ptr<int16_t>());
  float* yp = y.data_ptr<float>();
  const RowsI8Fn* fns = sh.bits == 8 ? kRowsI8Fns<8> : kRowsI8Fns<4>;
  const int64_t row_bytes = K * sh.bits / 8;
  over_outputs(sh, [&](int64_t n, int64_t m0, int rows) {
    fns[rows](cp + n * row_bytes, sp + n * groups * 2, qp + m0 * K, dp + m0 * blocks,
              xsp + m0 * groups, yp + m0 * N + n, K, G, N);
  });
  return x_in.scalar_type() == at::kFloat ? y : y.to(x_in.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("block_mm(Tensor x, Tensor codes, Tensor sm, int group_size) -> Tensor");
  m.def("quantize_act_q8(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("block_mm_i8(Tensor x, Tensor codes, Tensor sm, int group_size) -> Tensor");
}
TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("block_mm", &block_mm);
  m.impl("quantize_act_q8", &quantize_act_q8);
  m.impl("block_mm_i8", &block_mm_i8);
}
