// Paged decode attention on CPU: one query token per sequence, keys and values read
// in place from the block-major paged cache through each sequence's block table
// (no gather copy). Parallel over (sequence, KV head); the query heads of one GQA
// group share every K/V row load. fp32 accumulation and softmax whatever the dtype.
// An int8 cache (--kv-cache-dtype int8) is dequantized row by row as it is read
// (code * the row's bfloat16 scale, stored after its D codes): no dequantized copy.
//
// kv: [num_blocks, num_layers, 2, block_size, Hkv, R] contiguous, R = D (q's dtype) or
//     D + 2 (int8 codes, then the row's bfloat16 scale as two bytes)
// q:  [N, Hq, D] contiguous; block_tables: [N, max_blocks] int64; seq_lens: [N] int64
// returns [N, Hq, D] in q's dtype.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void to_float<at::BFloat16>(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;  // vectorises
}

// One K or V row -> D floats (an int8 row: code * its scale, the scale after the codes).
template <typename KV>
inline void load_row(const KV* src, float* dst, int64_t d) { to_float(src, dst, d); }

template <>
inline void load_row<int8_t>(const int8_t* src, float* dst, int64_t d) {
  uint16_t bits;
  std::memcpy(&bits, src + d, sizeof(bits));  // the bfloat16 scale: two unaligned bytes
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float s;
  std::memcpy(&s, &wide, sizeof(s));
  for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]) * s;  // vectorises
}

inline float dot(const float* a, const float* b, int64_t d) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= d; i += Vec::size())
    acc = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
  float out = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; i < d; ++i) out += a[i] * b[i];
  return out;
}

inline void axpy(float p, const float* x, float* y, int64_t d) {  // y += p * x
  const Vec pv(p);
  int64_t i = 0;
  for (; i + Vec::size() <= d; i += Vec::size())
    at::vec::fmadd(pv, Vec::loadu(x + i), Vec::loadu(y + i)).store(y + i);
  for (; i < d; ++i) y[i] += p * x[i];
}

inline void softmax_inplace(float* sc, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) mx = std::max(mx, sc[t]);
  const Vec mv(mx);
  Vec sum_v(0.f);
  int64_t t = 0;
  for (; t + Vec::size() <= n; t += Vec::size()) {
    Vec e = (Vec::loadu(sc + t) - mv).exp_u20();
    e.store(sc + t);
    sum_v = sum_v + e;
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sum_v);
  for (; t < n; ++t) { sc[t] = std::exp(sc[t] - mx); sum += sc[t]; }
  const float inv = 1.f / sum;
  for (t = 0; t < n; ++t) sc[t] *= inv;
}

template <typename T, typename KV>
void decode_kernel(const T* q, const KV* kv, const int64_t* tables, const int64_t* lens, T* out,
                   int64_t n_seq, int64_t hq, int64_t hkv, int64_t d, int64_t block_size,
                   int64_t max_blocks, int64_t layer_stride, int64_t block_stride,
                   int64_t layer, double scale_d, int64_t rd) {
  const int64_t group = hq / hkv;
  const float scale = static_cast<float>(scale_d);
  const int64_t row = hkv * rd;              // one token's K (or V) at one layer
  const int64_t kv_half = block_size * row;  // K part of a block at one layer
  at::parallel_for(0, n_seq * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * d), acc(group * d), kf(d), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / hkv, h = item % hkv, len = lens[s];
      const int64_t* table = tables + s * max_blocks;
      to_float(q + (s * hq + h * group) * d, qf.data(), group * d);  // the group's heads
      for (auto& x : qf) x *= scale;
      scores.resize(group * len);
      for (int64_t t = 0; t < len; ++t) {  // scores = q . k
        const KV* k = kv + table[t / block_size] * block_stride + layer * layer_stride +
                      (t % block_size) * row + h * rd;
        load_row(k, kf.data(), d);
        for (int64_t g = 0; g < group; ++g) scores[g * len + t] = dot(qf.data() + g * d, kf.data(), d);
      }
      for (int64_t g = 0; g < group; ++g) softmax_inplace(scores.data() + g * len, len);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {  // out = p . v
        const KV* v = kv + table[t / block_size] * block_stride + layer * layer_stride +
                      kv_half + (t % block_size) * row + h * rd;
        load_row(v, kf.data(), d);
        for (int64_t g = 0; g < group; ++g) axpy(scores[g * len + t], kf.data(), acc.data() + g * d, d);
      }
      T* o = out + (s * hq + h * group) * d;
      for (int64_t i = 0; i < group * d; ++i) o[i] = static_cast<T>(acc[i]);
    }
  });
}

}  // namespace

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& kv, int64_t layer,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        double scale) {
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 6, "paged_decode: q [N, Hq, D], kv 6-D");
  TORCH_CHECK(q.is_contiguous() && kv.is_contiguous(), "paged_decode: contiguous inputs");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "paged_decode: int64 block tables and lengths");
  const bool q8 = kv.scalar_type() == at::kChar;
  TORCH_CHECK(q8 || q.scalar_type() == kv.scalar_type(), "paged_decode: q and kv dtypes differ");
  const int64_t n = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t hkv = kv.size(4), block_size = kv.size(3), rd = kv.size(5);
  TORCH_CHECK(rd == (q8 ? d + 2 : d) && hq % hkv == 0, "paged_decode: head shapes disagree");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    if (q8)
      decode_kernel<scalar_t, int8_t>(q.data_ptr<scalar_t>(), kv.data_ptr<int8_t>(),
                                      tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                                      out.data_ptr<scalar_t>(), n, hq, hkv, d, block_size,
                                      tables.size(1), kv.stride(1), kv.stride(0), layer, scale,
                                      rd);
    else
      decode_kernel<scalar_t, scalar_t>(q.data_ptr<scalar_t>(), kv.data_ptr<scalar_t>(),
                                        tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                                        out.data_ptr<scalar_t>(), n, hq, hkv, d, block_size,
                                        tables.size(1), kv.stride(1), kv.stride(0), layer,
                                        scale, rd);
  });
  return out;
}

TORCH_LIBRARY(tandem, m) {
  m.def("paged_decode(Tensor q, Tensor kv, int layer, Tensor block_tables, Tensor seq_lens, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("paged_decode", &paged_decode); }
