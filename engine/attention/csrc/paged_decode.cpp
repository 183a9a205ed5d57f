// Paged decode attention on CPU: one query token per sequence, keys and values read
// in place from the block-major paged cache through each sequence's block table
// (no gather copy). Parallel over (sequence, KV head); the query heads of one GQA
// group share every K/V row load. fp32 accumulation and softmax whatever the dtype.
//
// kv: [num_blocks, num_layers, 2, block_size, Hkv, D] contiguous
// q:  [N, Hq, D] contiguous; block_tables: [N, max_blocks] int64; seq_lens: [N] int64
// returns [N, Hq, D] in q's dtype.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
void decode_kernel(const T* q, const T* kv, const int64_t* tables, const int64_t* lens, T* out,
                   int64_t n_seq, int64_t hq, int64_t hkv, int64_t d, int64_t block_size,
                   int64_t max_blocks, int64_t layer_stride, int64_t block_stride,
                   int64_t layer, double scale_d) {
  const int64_t group = hq / hkv;
  const float scale = static_cast<float>(scale_d);
  const int64_t row = hkv * d;             // one token's K (or V) at one layer
  const int64_t kv_half = block_size * row;  // K part of a block at one layer
  at::parallel_for(0, n_seq * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * d), acc(group * d), kf(d), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / hkv, h = item % hkv, len = lens[s];
      const int64_t* table = tables + s * max_blocks;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < d; ++i)
          qf[g * d + i] = static_cast<float>(q[(s * hq + h * group + g) * d + i]) * scale;
      scores.assign(group * len, 0.f);
      for (int64_t t = 0; t < len; ++t) {  // scores = q . k
        const T* k = kv + table[t / block_size] * block_stride + layer * layer_stride +
                     (t % block_size) * row + h * d;
        for (int64_t i = 0; i < d; ++i) kf[i] = static_cast<float>(k[i]);
        for (int64_t g = 0; g < group; ++g) {
          float dot = 0.f;
          const float* qg = qf.data() + g * d;
#pragma omp simd reduction(+ : dot)
          for (int64_t i = 0; i < d; ++i) dot += qg[i] * kf[i];
          scores[g * len + t] = dot;
        }
      }
      for (int64_t g = 0; g < group; ++g) {  // softmax over the context
        float* sc = scores.data() + g * len;
        float mx = -std::numeric_limits<float>::infinity(), sum = 0.f;
        for (int64_t t = 0; t < len; ++t) mx = std::max(mx, sc[t]);
        for (int64_t t = 0; t < len; ++t) { sc[t] = std::exp(sc[t] - mx); sum += sc[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) sc[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {  // out = p . v
        const T* v = kv + table[t / block_size] * block_stride + layer * layer_stride +
                     kv_half + (t % block_size) * row + h * d;
        for (int64_t i = 0; i < d; ++i) kf[i] = static_cast<float>(v[i]);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* a = acc.data() + g * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) a[i] += p * kf[i];
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < d; ++i)
          out[(s * hq + h * group + g) * d + i] = static_cast<T>(acc[g * d + i]);
    }
  });
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& kv, int64_t layer,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        double scale) {
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 6, "paged_decode: q [N, Hq, D], kv 6-D");
  TORCH_CHECK(q.is_contiguous() && kv.is_contiguous(), "paged_decode: contiguous inputs");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "paged_decode: int64 block tables and lengths");
  TORCH_CHECK(q.scalar_type() == kv.scalar_type(), "paged_decode: q and kv dtypes differ");
  const int64_t n = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t hkv = kv.size(4), block_size = kv.size(3);
  TORCH_CHECK(kv.size(5) == d && hq % hkv == 0, "paged_decode: head shapes disagree");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), kv.data_ptr<scalar_t>(),
                            tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                            out.data_ptr<scalar_t>(), n, hq, hkv, d, block_size,
                            tables.size(1), kv.stride(1), kv.stride(0), layer, scale);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(tandem, m) {
  m.def("paged_decode(Tensor q, Tensor kv, int layer, Tensor block_tables, Tensor seq_lens, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("paged_decode", &paged_decode); }
