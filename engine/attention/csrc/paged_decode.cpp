// Paged attention on CPU: decode (one query token per sequence) and, further down,
// prefill (a sequence's new tokens over its cached prefix: paged_prefill). Keys and
// values are read in place from the block-major paged cache through each sequence's
// block table (no gather copy). fp32 accumulation and softmax whatever the dtype.
//
// Decode:
//
// Parallel over (sequence, range of its tokens): a task takes every head of one
// sequence over one range, so it reads each block's K, then V, rows of all KV heads in
// memory order (the query heads of one GQA group share every row). With few sequences
// a context is split into ranges (kMinSplit tokens at least) so every thread has work;
// each range leaves a softmax state (max, sum, unnormalised output) per query head, and
// the states are merged at the end (flash-decoding style).
//
// Within a task the range is walked in tiles of kTile (16) tokens, with an online
// softmax (running max and sum per query head, the accumulator rescaled when the max
// grows), the next tile's rows (after the last, the thread's next task's first)
// prefetched into L2 while one runs, a share before each KV head's work. Per KV head
// and tile:
//  - the K rows are widened once into a float tile (ATen Vectorized conversions),
//    shared by the group's heads; bf16 queries and keys on AVX512_BF16 skip that: the
//    scores are bf16 dot products over the rows in the cache (vdpbf16ps: exact
//    products added in fp32), scaled afterwards (fma_only: the widened path);
//  - each head's 16 scores come out as one vector: per token the dot product is left
//    as a vector of partial sums, and one transpose-and-add tree (AVX-512) reduces
//    the 16 of them together, instead of a horizontal reduce per (token, head);
//  - V rows are widened chunk by chunk straight from the cache into up to kHeads
//    heads' accumulators held in registers.
// A sliding window (window > 0) starts a sequence's range at its last `window` keys:
// tokens (and so blocks) before that are never read, their table entries never looked
// at. A soft-cap (softcap > 0) maps each tile's scaled scores s to c * tanh(s / c)
// before the online softmax.
// Scores (h2o): a row with score_rows[i] = j >= 0 also leaves its scaled (capped)
// scores in logits[j] ([M, Hq, W] fp32, column = token position), copied from the tile
// as the online softmax takes it; the caller normalises them (no second pass over the
// cache). Other rows write nothing.
// An int8 cache (--kv-cache-dtype int8) is never multiplied by its scale element-wise:
// a row is D int8 codes then its bfloat16 scale s, and s is folded into the per-token
// scalars instead: score_t = s_t * (q . codes_t), and V's weight p_t * s_t, so
// acc += (p_t * s_t) * codes_t. No dequantized copy is made.
//
// kv: [num_blocks, num_layers, 2, block_size, Hkv, R] contiguous, R = D (q's dtype) or
//     D + 2 (int8 codes, then the row's bfloat16 scale as two bytes)
// q:  [N, Hq, D] contiguous; block_tables: [N, max_blocks] int64; seq_lens: [N] int64
// window: keys a query sees (0: all); softcap: the cap c (0: none); fma_only: widened
// fp32 K tiles and FMAs for the scores whatever the CPU (tests compare the two)
// returns [N, Hq, D] in q's dtype (zeros for a sequence of length 0).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kW = Vec::size();  // floats per vector
constexpr int kTile = 16;             // tokens per tile: one AVX-512 vector of scores
constexpr int kHeads = 4;             // query heads whose V accumulators live in registers

template <typename KV>
constexpr bool kQuant = std::is_same_v<KV, int8_t>;

// kW elements of a row -> floats (int8: the codes themselves, unscaled).
inline Vec load_chunk(const float* p) { return Vec::loadu(p); }
inline Vec load_chunk(const at::BFloat16* p) {
  Vec v;
  at::vec::load_fp32_from_bf16(p, v);
  return v;
}
inline Vec load_chunk(const at::Half* p) {
  Vec v;
  at::vec::load_fp32_from_fp16(p, v);
  return v;
}
inline Vec load_chunk(const int8_t* p) {
  return at::vec::convert<float>(at::vec::Vectorized<int8_t>::loadu_one_fourth(p));
}
inline Vec load_chunk(const double* p) {
  float f[kW];
  for (int64_t i = 0; i < kW; ++i) f[i] = static_cast<float>(p[i]);
  return Vec::loadu(f);
}

inline float row_scale(const int8_t* row, int64_t d) {  // the bfloat16 after the codes
  uint16_t bits;
  std::memcpy(&bits, row + d, sizeof(bits));  // two unaligned bytes
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float s;
  std::memcpy(&s, &wide, sizeof(s));
  return s;
}

// A tile's n K rows -> kt [kTile][dp] floats, zero past d and past row n (so every
// score lane is finite); ks[i] = row i's scale.
template <typename KV>
void load_k_tile(const KV* const* rows, int n, int64_t d, int64_t dp, float* kt, float* ks) {
  const int64_t full = d / kW * kW;
  for (int i = 0; i < n; ++i) {
    float* dst = kt + i * dp;
    for (int64_t c = 0; c < full; c += kW) load_chunk(rows[i] + c).store(dst + c);
    for (int64_t c = full; c < dp; ++c) dst[c] = c < d ? static_cast<float>(rows[i][c]) : 0.f;
    if constexpr (kQuant<KV>) ks[i] = row_scale(rows[i], d);
  }
  std::fill(kt + n * dp, kt + kTile * dp, 0.f);
  if constexpr (kQuant<KV>) std::fill(ks + n, ks + kTile, 0.f);
}

// sc[t] = the sum of part[t]'s lanes, t < kTile.
inline void sum_lanes(const Vec* part, float* sc) {
#if defined(CPU_CAPABILITY_AVX512)
  // Transpose-and-add: each level halves the vectors and doubles the tokens per vector.
  __m512 b[8], c[4], e[2];
  for (int i = 0; i < 8; ++i) {  // 128-bit lane j: [t0 t1 t0 t1] over lane j's halves
    const __m512 x = part[2 * i], y = part[2 * i + 1];
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lane j: [t0 t1 t2 t3] summed over lane j
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // [t0-3 t0-3 t4-7 t4-7], each a half of the lanes
    e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  _mm512_storeu_ps(sc, _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], 0x88),
                                     _mm512_shuffle_f32x4(e[0], e[1], 0xDD)));
#else
  for (int t = 0; t < kTile; ++t)
    sc[t] = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, part[t]);
#endif
}

// sc[t] = q . kt[t] for the tile's rows: one vector of partial sums per token, all
// kTile of them in registers across the chunks, then summed lane-wise together.
inline void tile_scores(const float* q, const float* kt, int64_t dp, float* sc) {
  Vec part[kTile];
  for (int t = 0; t < kTile; ++t) part[t] = Vec(0.f);
  for (int64_t c = 0; c < dp; c += kW) {
    const Vec qc = Vec::loadu(q + c);
    for (int t = 0; t < kTile; ++t)
      part[t] = at::vec::fmadd(qc, Vec::loadu(kt + t * dp + c), part[t]);
  }
  sum_lanes(part, sc);
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
constexpr bool kDotScores = true;
#else
constexpr bool kDotScores = false;
#endif

// tile_scores for bf16 queries and keys on AVX512_BF16 (kDotScores): each score from
// bf16 dot products (vdpbf16ps: pairs of exact products added in fp32) over the K rows
// in the cache, with no widened tile; then scaled (the fp32 path scales q instead). Rows
// past n read `zero`. d % 32 == 0. decode_kernel passes queries here only then.
template <typename KV>
inline void tile_scores_dot(const KV* q, const KV* const* rows, int n, int64_t d,
                            float scale, const at::BFloat16* zero, float* sc) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<KV, at::BFloat16>) {
    const at::BFloat16* r[kTile];
    for (int t = 0; t < kTile; ++t) r[t] = t < n ? rows[t] : zero;
    Vec part[kTile];
#pragma GCC unroll 16
    for (int t = 0; t < kTile; ++t) part[t] = Vec(0.f);
    for (int64_t c = 0; c < d; c += 32) {
      const __m512bh qc = (__m512bh)_mm512_loadu_si512(q + c);
#pragma GCC unroll 16
      for (int t = 0; t < kTile; ++t)
        part[t] = _mm512_dpbf16_ps(part[t], qc, (__m512bh)_mm512_loadu_si512(r[t] + c));
    }
    sum_lanes(part, sc);
    (Vec::loadu(sc) * Vec(scale)).store(sc);
    return;
  }
#endif
  TORCH_CHECK(false, "paged_decode: dot-product scores need bf16 on AVX512_BF16");
}

inline void scale_tile(float* x, const float* s) {  // x[t] *= s[t], t < kTile
  for (int t = 0; t < kTile; t += kW) (Vec::loadu(x + t) * Vec::loadu(s + t)).store(x + t);
}

inline void cap_tile(float* x, float cap) {  // x[t] = cap * tanh(x[t] / cap), t < kTile
  const Vec c(cap), inv(1.f / cap);
  for (int t = 0; t < kTile; t += kW) (c * (Vec::loadu(x + t) * inv).tanh()).store(x + t);
}

// Lane t of lane_mask(n, t0) is set where t0 + t < n (all-ones bits, else zero).
inline Vec lane_mask(int n, int t0) {
  alignas(64) static const uint32_t bits[2 * kTile] = {
      ~0u, ~0u, ~0u, ~0u, ~0u, ~0u, ~0u, ~0u, ~0u, ~0u, ~0u, ~0u, ~0u, ~0u, ~0u, ~0u};
  float f[kW];
  std::memcpy(f, bits + kTile - std::clamp(n - t0, 0, kTile), sizeof(f));
  return Vec::loadu(f);
}

// One head's online-softmax step over a tile: sc (scores, n valid) becomes the
// unnormalised weights exp(sc - m') (0 past n); m (running max) and l (running sum)
// are updated; returns the factor exp(m - m') the head's accumulator must be scaled by.
inline float softmax_step(float* sc, int n, float& m, float& l) {
  const float ninf = -std::numeric_limits<float>::infinity();
  Vec mx_v(m);
  for (int t = 0; t < kTile; t += kW)
    mx_v = at::vec::maximum(mx_v, Vec::blendv(Vec(ninf), Vec::loadu(sc + t), lane_mask(n, t)));
  const float mx = at::vec::vec_reduce_all<float>(
      [](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, mx_v);
  Vec sum_v(0.f);
  for (int t = 0; t < kTile; t += kW) {
    const Vec e = (Vec::loadu(sc + t) - Vec(mx)).exp_u20();
    const Vec p = Vec::blendv(Vec(0.f), e, lane_mask(n, t));
    p.store(sc + t);
    sum_v = sum_v + p;
  }
  const float alpha = mx == m ? 1.f : m == ninf ? 0.f : std::exp(m - mx);
  m = mx;
  l = l * alpha + at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sum_v);
  return alpha;
}

// acc[h][:d] += sum_t w[h][t] * v_t over NH heads (w [NH][kTile], acc [NH][dp]); each
// kW-wide chunk of the NH accumulators stays in registers across the tile's rows.
template <int NH, typename KV>
void accumulate_v(const KV* const* rows, int n, int64_t d, int64_t dp, const float* w,
                  float* acc) {
  const int64_t full = d / kW * kW;
  for (int64_t c = 0; c < full; c += kW) {
    Vec a[NH];
    for (int h = 0; h < NH; ++h) a[h] = Vec::loadu(acc + h * dp + c);
    for (int t = 0; t < n; ++t) {
      const Vec v = load_chunk(rows[t] + c);
      for (int h = 0; h < NH; ++h) a[h] = at::vec::fmadd(Vec(w[h * kTile + t]), v, a[h]);
    }
    for (int h = 0; h < NH; ++h) a[h].store(acc + h * dp + c);
  }
  for (int64_t c = full; c < d; ++c)
    for (int t = 0; t < n; ++t) {
      const float v = static_cast<float>(rows[t][c]);
      for (int h = 0; h < NH; ++h) acc[h * dp + c] += w[h * kTile + t] * v;
    }
}

template <typename KV>
void accumulate_v_heads(const KV* const* rows, int n, int64_t d, int64_t dp, const float* w,
                        float* acc, int64_t heads) {
  for (int64_t h0 = 0; h0 < heads; h0 += kHeads) {  // kHeads at a time: fits in registers
    const float* wh = w + h0 * kTile;
    float* ah = acc + h0 * dp;
    switch (std::min<int64_t>(heads - h0, kHeads)) {
      case 1: accumulate_v<1>(rows, n, d, dp, wh, ah); break;
      case 2: accumulate_v<2>(rows, n, d, dp, wh, ah); break;
      case 3: accumulate_v<3>(rows, n, d, dp, wh, ah); break;
      default: accumulate_v<4>(rows, n, d, dp, wh, ah); break;
    }
  }
}

// Where one sequence's K rows live (KV head 0; head h is h * rd further on, its V row
// v_offset further on).
template <typename KV>
struct RowMap {
  const KV* base;  // kv at this layer
  const int64_t* table;
  int64_t block_size, block_stride, row, v_offset;
  // K rows of tokens t0 .. t0 + n - 1 (one division per tile, not per token).
  void k_rows(int64_t t0, int n, const KV** rows) const {
    int64_t blk = t0 / block_size, off = t0 % block_size;
    for (int t = 0; t < n; ++t) {
      rows[t] = base + table[blk] * block_stride + off * row;
      if (++off == block_size) off = 0, ++blk;
    }
  }
};

// One decode task's keys: tokens [begin, end) through map.
template <typename KV>
struct Span {
  RowMap<KV> map;
  int64_t begin, end;
  int rows_in_first_tile() const {
    return static_cast<int>(std::clamp<int64_t>(end - begin, 0, kTile));
  }
};

// Asks for the cache lines of [p, p + bytes) ahead of their use.
inline void prefetch(const void* p, int64_t bytes) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63};
  const uintptr_t last = reinterpret_cast<uintptr_t>(p) + bytes - 1;
  for (uintptr_t line = first; line <= last; line += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 2);
}

// Scratch for one task, reused across the tasks of one thread.
struct Scratch {
  std::vector<float> q, acc, kt, w, m, l;
  std::vector<at::BFloat16> zero;  // a K row of zeros (the dot-product scores' padding)
  Scratch(int64_t hq, int64_t group, int64_t dp, int64_t d)
      : q(hq * dp), acc(hq * dp), kt(kTile * dp), w(group * kTile), m(hq), l(hq), zero(d) {}
};

// One KV head's group over one tile (n rows): scores, online softmax, V. qdot: the
// group's queries as they came (bf16, unscaled) when the scores are dot products
// (tile_scores_dot), else nullptr and q holds them scaled, in fp32.
template <typename KV>
void head_tile(const KV* const* krows, const KV* const* vrows, int n, int64_t group,
               int64_t d, int64_t dp, const float* q, const KV* qdot, float scale, float* acc,
               float* m, float* l, float softcap, float* sout, int64_t sstride, Scratch& s) {
  float ks[kTile] = {}, vs[kTile] = {};  // int8 row scales (0 past the tile's rows)
  if constexpr (kQuant<KV>)
    for (int t = 0; t < n; ++t) vs[t] = row_scale(vrows[t], d);
  if (!qdot) load_k_tile(krows, n, d, dp, s.kt.data(), ks);
  for (int64_t g = 0; g < group; ++g) {
    float* sc = s.w.data() + g * kTile;
    if (qdot)
      tile_scores_dot(qdot + g * d, krows, n, d, scale, s.zero.data(), sc);
    else
      tile_scores(q + g * dp, s.kt.data(), dp, sc);
    if constexpr (kQuant<KV>) scale_tile(sc, ks);
    if (softcap > 0.f) cap_tile(sc, softcap);
    if (sout) std::copy(sc, sc + n, sout + g * sstride);  // head g's scores, this tile
    const float alpha = softmax_step(sc, n, m[g], l[g]);
    if (alpha != 1.f)
      for (int64_t c = 0; c < dp; ++c) acc[g * dp + c] *= alpha;
    if constexpr (kQuant<KV>) scale_tile(sc, vs);
  }
  accumulate_v_heads(vrows, n, d, dp, s.w.data(), acc, group);
}

// One task: every head of one sequence over its tokens [t_begin, t_end), tile by tile
// (a tile's K, then V, rows of all KV heads are contiguous in a block: read in order),
// leaving in s the softmax state (running max m, sum l, unnormalised acc) per query
// head; s.q holds the sequence's queries already scaled, [hq][dp] zero-padded, or
// qdot (not null) the sequence's bf16 queries as they came, [hq][d].
// The next tile's rows are prefetched into L2 while a tile runs, a share of them before
// each KV head's work: all at once (or into L1) they stalled the loads of the tile
// running, and a step read its cache at half the speed (docs/performance.md). The last
// tile prefetches the first of `after` (the thread's next task; empty: none).
template <typename KV>
void decode_task(const Span<KV>& span, const Span<KV>& after, int64_t hkv, int64_t group,
                 int64_t d, int64_t dp, int64_t rd, const KV* qdot, float scale,
                 float softcap, float* srow, int64_t sstride, Scratch& s) {
  const RowMap<KV>& map = span.map;
  const int64_t t_begin = span.begin, t_end = span.end;
  std::fill(s.acc.begin(), s.acc.end(), 0.f);
  std::fill(s.m.begin(), s.m.end(), -std::numeric_limits<float>::infinity());
  std::fill(s.l.begin(), s.l.end(), 0.f);
  const KV* base[kTile];
  const KV* next[kTile];
  const KV* krows[kTile];
  const KV* vrows[kTile];
  const int64_t row_bytes = map.row * static_cast<int64_t>(sizeof(KV));
  int n_pf = 0;
  if (t_begin < t_end)
    map.k_rows(t_begin, static_cast<int>(std::min<int64_t>(kTile, t_end - t_begin)), next);
  for (int64_t t0 = t_begin; t0 < t_end; t0 += kTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, t_end - t0));
    std::copy(next, next + n, base);
    if (t0 + kTile < t_end) {  // the next tile's rows start coming in while this one runs
      const int n_next = static_cast<int>(std::min<int64_t>(kTile, t_end - t0 - kTile));
      map.k_rows(t0 + kTile, n_next, next);
      n_pf = n_next;
    } else {  // nothing is read through next after this tile
      n_pf = after.rows_in_first_tile();
      if (n_pf > 0) after.map.k_rows(after.begin, n_pf, next);
    }
    for (int64_t h = 0; h < hkv; ++h) {
      for (int t = static_cast<int>(h * n_pf / hkv); t < (h + 1) * n_pf / hkv; ++t) {
        prefetch(next[t], row_bytes);
        prefetch(next[t] + map.v_offset, row_bytes);  // after's rows are laid out alike
      }
      for (int t = 0; t < n; ++t) {
        krows[t] = base[t] + h * rd;
        vrows[t] = krows[t] + map.v_offset;
      }
      const int64_t q0 = h * group;
      head_tile(krows, vrows, n, group, d, dp, s.q.data() + q0 * dp,
                qdot ? qdot + q0 * d : nullptr, scale, s.acc.data() + q0 * dp,
                s.m.data() + q0, s.l.data() + q0, softcap,
                srow ? srow + q0 * sstride + t0 : nullptr, sstride, s);
    }
  }
}

// How many token ranges each sequence is split into: about 8 tasks a thread when there
// are few sequences (batch 1 would leave a thread idle), each at least kMinSplit tokens.
constexpr int64_t kMinSplit = 256;
inline int64_t splits_for(int64_t n_seq, int64_t max_len) {
  const int64_t want = (8 * at::get_num_threads() + n_seq - 1) / n_seq;
  return std::max<int64_t>(1, std::min(want, max_len / kMinSplit));
}

// out = sum_i acc_i e^(m_i - M) / sum_i l_i e^(m_i - M) over one head's splits
// (M = max_i m_i); state rows are [m, l, acc[dp]], one per split.
template <typename T>
void merge_splits(const float* state, int64_t splits, int64_t stride, int64_t d, T* o) {
  float mx = -std::numeric_limits<float>::infinity(), l = 0.f;
  for (int64_t i = 0; i < splits; ++i) mx = std::max(mx, state[i * stride]);
  std::vector<float> acc(d, 0.f);
  for (int64_t i = 0; i < splits; ++i) {
    const float* st = state + i * stride;
    if (st[1] == 0.f) continue;  // an empty range
    const float f = std::exp(st[0] - mx);
    l += st[1] * f;
    for (int64_t c = 0; c < d; ++c) acc[c] += st[2 + c] * f;
  }
  const float inv = l > 0.f ? 1.f / l : 0.f;  // length 0: zeros
  for (int64_t c = 0; c < d; ++c) o[c] = static_cast<T>(acc[c] * inv);
}

template <typename T, typename KV>
void decode_kernel(const T* q, const KV* kv, const int64_t* tables, const int64_t* lens, T* out,
                   int64_t n_seq, int64_t hq, int64_t hkv, int64_t d, int64_t block_size,
                   int64_t max_blocks, int64_t layer_stride, int64_t block_stride,
                   int64_t layer, double scale_d, int64_t rd, int64_t window,
                   double softcap, int64_t num_blocks, const int64_t* score_rows,
                   float* logits, int64_t lwidth, bool fma_only) {
  const int64_t group = hq / hkv, dp = (d + kW - 1) / kW * kW, stride = 2 + dp;
  const float scale = static_cast<float>(scale_d);
  // bf16 on AVX512_BF16: scores from bf16 dot products (tile_scores_dot)
  const bool dot = kDotScores && std::is_same_v<T, at::BFloat16> &&
                   std::is_same_v<KV, at::BFloat16> && d % 32 == 0 && !fma_only;
  const int64_t row = hkv * rd;  // one token's K (or V) at one layer
  // The first key each sequence reads: its window's, else 0.
  std::vector<int64_t> first(n_seq, 0);
  int64_t longest = 0;
  for (int64_t i = 0; i < n_seq; ++i) {
    if (window > 0) first[i] = std::max<int64_t>(0, lens[i] - window);
    longest = std::max(longest, lens[i] - first[i]);
  }
  const int64_t splits = splits_for(n_seq, longest);
  // Every block a row reads is in its table and in the cache (a freed entry is -1): a
  // window shorter than the KV manager's is an error here, never a read outside kv.
  for (int64_t i = 0; i < n_seq; ++i)
    for (int64_t b = first[i] / block_size; b * block_size < lens[i]; ++b) {
      TORCH_CHECK(b < max_blocks, "paged_decode: row ", i, "'s table has no block ", b);
      const int64_t id = tables[i * max_blocks + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "paged_decode: row ", i, " reads block ", b,
                  " of its table, whose entry ", id, " is not a block of the cache");
    }
  std::vector<float> state(n_seq * hq * splits * stride);  // [seq, head, split]
  at::parallel_for(0, n_seq * splits, 1, [&](int64_t begin, int64_t end) {
    Scratch s(hq, group, dp, d);
    auto span_of = [&](int64_t item) {
      const int64_t seq = item / splits, part = item % splits;
      const int64_t b = first[seq], len = lens[seq];
      const int64_t per = (len - b + splits - 1) / splits;
      const int64_t chunk = (per + kTile - 1) / kTile * kTile;  // whole tiles per split
      const RowMap<KV> map{kv + layer * layer_stride, tables + seq * max_blocks, block_size,
                           block_stride, row, block_size * row};
      return Span<KV>{map, std::min(len, b + part * chunk), std::min(len, b + (part + 1) * chunk)};
    };
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / splits, part = item % splits;
      const KV* qdot = nullptr;
      if constexpr (std::is_same_v<T, KV>)
        if (dot) qdot = q + seq * hq * d;
      if (!qdot)
        for (int64_t h = 0; h < hq; ++h)
          for (int64_t c = 0; c < dp; ++c)
            s.q[h * dp + c] = c < d ? static_cast<float>(q[(seq * hq + h) * d + c]) * scale : 0.f;
      float* srow = score_rows && score_rows[seq] >= 0
                        ? logits + score_rows[seq] * hq * lwidth : nullptr;
      const Span<KV> none{{}, 0, 0};
      decode_task(span_of(item), item + 1 < end ? span_of(item + 1) : none, hkv, group, d, dp,
                  rd, qdot, scale, static_cast<float>(softcap), srow, lwidth, s);
      for (int64_t h = 0; h < hq; ++h) {
        float* st = state.data() + ((seq * hq + h) * splits + part) * stride;
        st[0] = s.m[h];
        st[1] = s.l[h];
        std::copy(s.acc.begin() + h * dp, s.acc.begin() + (h + 1) * dp, st + 2);
      }
    }
  });
  for (int64_t head = 0; head < n_seq * hq; ++head)
    merge_splits(state.data() + head * splits * stride, splits, stride, d, out + head * d);
}


// ---------------------------------------------------------------------------------------
// Prefill attention over the paged cache: the T query tokens of one sequence (at
// positions slen - T .. slen - 1, causal; with a window, each sees its last `window`
// keys), K and V read through the block table from the first block any query sees.
//
// torch's CPU SDPA needed the context gathered into a contiguous copy first and ran at
// about 70 GFLOP/s on a 512-token prompt (fp32 FMA peak here is about 190). Here:
//  - K and V are read once per call into fp32 panels: K per tile of kPT keys
//    transposed ([D][kPT]: a query row's scores over a tile are one FMA chain per
//    dimension), V row-major, zero past the sequence's end;
//  - a task takes kSub x kRows query rows (position-major, the heads of one KV group
//    side by side, so they share every K and V panel) and walks the tiles its rows
//    can see, each tile once for all its rows, with an online softmax per row: scores
//    kChunk keys at a time in registers (one broadcast of q per row and dimension),
//    masks only on tiles that straddle a row's edge, V folded into kW-wide
//    accumulators of kRows rows at once;
//  - a tile is 2 x kChunk keys: the softmax's per-row reductions and exp are per tile,
//    and at 32 keys they cost half the FMAs' time (64 keys: 2.2 ms for a 512-token
//    layer instead of 3.0; 128: slower on short prompts, where the diagonal tiles
//    waste more);
//  - tasks are taken longest first from a shared counter (causal rows near the end
//    see the most keys), so two threads finish together;
//  - bf16 on a CPU with AVX512_BF16 keeps the cache's bf16 values in its panels, paired
//    for vdpbf16ps (two products per lane and instruction, fp32 sums), the softmax
//    weights rounded to bf16 for the V products (Bf16Panels; 1.6 against 2.2 ms for a
//    512-token layer). Elsewhere, and with fma_only, fp32 panels and FMAs (FmaPanels).
// Every row's arithmetic (its tiles, their order, fp32 throughout) depends only on its
// position and the keys: a prompt gives the same output whole, chunked or batched.
// ---------------------------------------------------------------------------------------
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kRows = 8;  // query rows computed together: 16 score accumulators
#else
constexpr int kRows = 6;  // 16 ymm registers: 12 score accumulators and 2 K vectors
#endif
constexpr int kTV = 2;                // score vectors per row in registers
constexpr int kChunk = kTV * kW;      // keys scored at once (32 on AVX-512, 16 on AVX2)
constexpr int kPT = 2 * kChunk;       // keys per tile: one softmax step per row
constexpr int kSub = 4;        // sub-tiles of kRows rows per task

// One task's rows over tile j: sc[r][t] = q_r . k_t (q pre-scaled), kt [d][kPT].
// (The unroll pragmas keep the kRows x kTV accumulators in registers: without them GCC
// left them on the stack, a load and a store around every FMA.)
inline void chunk_scores(const float* qf, int64_t d, const float* kt, float* sc) {
  Vec acc[kRows * kTV];
#pragma GCC unroll 16
  for (int a = 0; a < kRows * kTV; ++a) acc[a] = Vec(0.f);
  for (int64_t c = 0; c < d; ++c) {
    Vec k[kTV];
#pragma GCC unroll 2
    for (int v = 0; v < kTV; ++v) k[v] = Vec::loadu(kt + c * kPT + v * kW);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const Vec qb(qf[r * d + c]);
#pragma GCC unroll 2
      for (int v = 0; v < kTV; ++v)
        acc[r * kTV + v] = at::vec::fmadd(qb, k[v], acc[r * kTV + v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < kTV; ++v) acc[r * kTV + v].store(sc + r * kPT + v * kW);
}

// sc[r][t] for the tile's kPT keys, a chunk at a time (kt [d][kPT]).
inline void rows_scores(const float* qf, int64_t d, const float* kt, float* sc) {
  for (int c0 = 0; c0 < kPT; c0 += kChunk) chunk_scores(qf, d, kt + c0, sc + c0);
}

// o[r][:] = o[r][:] * alpha[r] + sum_t p[r][t] * v_t over the tile's kPT V rows.
inline void rows_values(const float* p, const float* alpha, const float* vp, int64_t dp,
                        float* o) {
  for (int64_t c = 0; c < dp; c += kW) {
    Vec a[kRows];
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) a[r] = Vec::loadu(o + r * dp + c) * Vec(alpha[r]);
    for (int t = 0; t < kPT; ++t) {
      const Vec v = Vec::loadu(vp + t * dp + c);
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) a[r] = at::vec::fmadd(Vec(p[r * kPT + t]), v, a[r]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) a[r].store(o + r * dp + c);
  }
}

// How a prefill kernel holds its panels and multiplies them: FmaPanels (fp32 panels,
// fp32 FMAs: any dtype, any ISA) and, for bf16 on AVX512_BF16 CPUs, Bf16Panels (the
// cache's bf16 values as they are, paired for vdpbf16ps: two products per lane and
// instruction, fp32 sums; the softmax weights are rounded to bf16 for the V products,
// as torch's SDPA does in bf16). Per tile of kPT keys: a K panel of d * kPT values and
// a V panel of kPT * dp.
struct FmaPanels {
  using E = float;
  // key t of the tile: kt [d][kPT] (transposed)
  template <typename T>
  static void pack_k(E* kt, int t, const T* k, int64_t d) {
    for (int64_t c = 0; c < d; ++c) kt[c * kPT + t] = k ? static_cast<float>(k[c]) : 0.f;
  }
  template <typename T>
  static void pack_v(E* vt, int t, const T* v, int64_t d, int64_t dp) {  // vt [kPT][dp]
    float* row = vt + t * dp;
    for (int64_t c = 0; c < dp; ++c) row[c] = v && c < d ? static_cast<float>(v[c]) : 0.f;
  }
  // a query row as the scores read it: fp32, pre-scaled ([kRows][d] floats)
  template <typename T>
  static void load_q(float* qb, int r, const T* q, int64_t d, float scale) {
    for (int64_t c = 0; c < d; ++c) qb[r * d + c] = static_cast<float>(q[c]) * scale;
  }
  static void scores(const float* qb, int64_t d, const E* kt, float /*scale: in q*/,
                     float* sc) {
    rows_scores(qb, d, kt, sc);
  }
  static void values(float* p, const float* alpha, const E* vt, int64_t dp, float* o) {
    rows_values(p, alpha, vt, dp, o);
  }
};

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
struct Bf16Panels {
  using E = uint16_t;  // bf16 bits
  // (templates so every dtype's dispatch compiles; only bf16 ever runs them)
  template <typename T>
  static uint16_t bits(const T* x, int64_t c) {
    if constexpr (std::is_same_v<T, at::BFloat16>) return x ? x[c].x : 0;
    return 0;
  }
  // kt [d/2][kPT][2]: dimension pairs of each key side by side
  template <typename T>
  static void pack_k(E* kt, int t, const T* k, int64_t d) {
    for (int64_t c = 0; c < d; c += 2) {
      kt[(c / 2) * kPT * 2 + t * 2] = bits(k, c);
      kt[(c / 2) * kPT * 2 + t * 2 + 1] = bits(k, c + 1);
    }
  }
  // vt [kPT/2][dp][2]: the values of keys 2i and 2i + 1 side by side per dimension
  template <typename T>
  static void pack_v(E* vt, int t, const T* v, int64_t d, int64_t dp) {
    E* row = vt + (t / 2) * dp * 2 + (t % 2);
    for (int64_t c = 0; c < dp; ++c) row[c * 2] = c < d ? bits(v, c) : 0;
  }
  // a query row as bf16 pairs (unscaled: the scale multiplies the fp32 scores), in the
  // first half of its d floats
  template <typename T>
  static void load_q(float* qb, int r, const T* q, int64_t d, float) {
    if constexpr (std::is_same_v<T, at::BFloat16>) std::memcpy(qb + r * d, q, d * sizeof(T));
  }
  static void scores(const float* qb, int64_t d, const E* kt, float scale, float* sc) {
    const __m512 sv = _mm512_set1_ps(scale);
    for (int c0 = 0; c0 < kPT; c0 += 32) {
      __m512 acc[kRows][2];
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
      const uint32_t* qw = reinterpret_cast<const uint32_t*>(qb);
      for (int64_t p = 0; p < d / 2; ++p) {
        const E* kp = kt + p * kPT * 2 + c0 * 2;
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp);
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kp + 32);
#pragma GCC unroll 8
        for (int r = 0; r < kRows; ++r) {
          const __m512bh qq = (__m512bh)_mm512_set1_epi32(qw[r * d + p]);
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qq, k0);
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qq, k1);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) {
        _mm512_storeu_ps(sc + r * kPT + c0, _mm512_mul_ps(acc[r][0], sv));
        _mm512_storeu_ps(sc + r * kPT + c0 + 16, _mm512_mul_ps(acc[r][1], sv));
      }
    }
  }
  // o[r] = o[r] * alpha[r] + p[r] . V, the weights rounded to bf16 pairs first
  static void values(float* p, const float* alpha, const E* vt, int64_t dp, float* o) {
    alignas(64) uint32_t pw[kRows][kPT / 2];
    for (int r = 0; r < kRows; ++r)
      for (int c0 = 0; c0 < kPT; c0 += 32)
        _mm512_storeu_si512(pw[r] + c0 / 2, (__m512i)_mm512_cvtne2ps_pbh(
            _mm512_loadu_ps(p + r * kPT + c0 + 16), _mm512_loadu_ps(p + r * kPT + c0)));
    for (int64_t c = 0; c < dp; c += 16) {
      __m512 a[kRows];
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r)
        a[r] = _mm512_mul_ps(_mm512_loadu_ps(o + r * dp + c), _mm512_set1_ps(alpha[r]));
      for (int i = 0; i < kPT / 2; ++i) {
        const __m512bh v = (__m512bh)_mm512_loadu_si512(vt + i * dp * 2 + c * 2);
#pragma GCC unroll 8
        for (int r = 0; r < kRows; ++r)
          a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_set1_epi32(pw[r][i]), v);
      }
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) _mm512_storeu_ps(o + r * dp + c, a[r]);
    }
  }
};
#endif

template <typename T, typename P>
void prefill_kernel(const T* q, const T* kv, const int64_t* table, int64_t n_table, T* out,
                    int64_t tq, int64_t slen, int64_t hq, int64_t hkv, int64_t d,
                    int64_t block_size, int64_t layer_stride, int64_t block_stride,
                    int64_t layer, double scale_d, int64_t window, double softcap_d,
                    int64_t num_blocks) {
  const float scale = static_cast<float>(scale_d), softcap = static_cast<float>(softcap_d);
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t group = hq / hkv, dp = (d + kW - 1) / kW * kW, q0 = slen - tq;
  // Keys from the first block any query sees (its window's) to the end.
  const int64_t first = window > 0 ? std::max<int64_t>(0, q0 - window + 1) : 0;
  const int64_t kbeg = first / block_size * block_size, nk = slen - kbeg;
  const int64_t ntiles = (nk + kPT - 1) / kPT;
  for (int64_t b = kbeg / block_size; b * block_size < slen; ++b) {
    TORCH_CHECK(b < n_table, "paged_prefill: the table has no block ", b);
    TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "paged_prefill: block ", b,
                " of the table, entry ", table[b], ", is not a block of the cache");
  }
  // Panels per (KV head, tile): K [d * kPT], V [kPT * dp] (layouts: P), zero past slen.
  using E = typename P::E;
  std::vector<E> kp(hkv * ntiles * d * kPT), vp(hkv * ntiles * kPT * dp);
  const T* base = kv + layer * layer_stride;
  const int64_t row = hkv * d, v_offset = block_size * row;
  at::parallel_for(0, hkv * ntiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / ntiles, j = item % ntiles;
      E* kt = kp.data() + item * d * kPT;
      E* vt = vp.data() + item * kPT * dp;
      for (int t = 0; t < kPT; ++t) {
        const int64_t key = kbeg + j * kPT + t;
        const T* k = key >= slen ? nullptr
                                 : base + table[key / block_size] * block_stride +
                                       (key % block_size) * row + h * d;
        P::pack_k(kt, t, k, d);
        P::pack_v(vt, t, k ? k + v_offset : nullptr, d, dp);
      }
    }
  });
  // A task: up to kSub sub-tiles of kRows rows, walked tile-major so each K and V panel
  // tile comes into L1 once for all of them (a long prompt's panels outgrow L2; here it
  // measured the same as a task of kRows rows).
  const int64_t nrows = tq * group, task_rows = kSub * kRows;
  const int64_t nblk = (nrows + task_rows - 1) / task_rows, ntasks = hkv * nblk;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> qf(task_rows * d), o(task_rows * dp), sc(kRows * kPT);
    float m[kSub * kRows], l[kSub * kRows], alpha[kRows];
    int64_t pos[kSub * kRows], lo[kSub * kRows], edges[kSub][4], span[kSub][2];
    for (int64_t t; (t = next.fetch_add(1)) < ntasks;) {
      const int64_t h = t % hkv, blk = nblk - 1 - t / hkv;  // longest first
      const int64_t r0 = blk * task_rows, n = std::min(task_rows, nrows - r0);
      const int nsub = static_cast<int>((n + kRows - 1) / kRows);
      for (int r = 0; r < nsub * kRows; ++r) {
        const int64_t rr = r0 + std::min<int64_t>(r, n - 1);  // padding rows repeat the last
        const int64_t i = rr / group, g = rr % group;
        pos[r] = q0 + i;
        lo[r] = window > 0 ? std::max<int64_t>(0, pos[r] - window + 1) : 0;
        P::load_q(qf.data(), r, q + (i * hq + h * group + g) * d, d, scale);
        m[r] = ninf, l[r] = 0.f;
      }
      std::fill(o.begin(), o.begin() + nsub * kRows * dp, 0.f);
      int64_t j_begin = ntiles, j_end = 0;
      for (int sb = 0; sb < nsub; ++sb) {  // lo min/max, pos min/max; the tiles it sees
        const int64_t* ps = pos + sb * kRows;
        const int64_t* ls = lo + sb * kRows;
        edges[sb][0] = *std::min_element(ls, ls + kRows);
        edges[sb][1] = *std::max_element(ls, ls + kRows);
        edges[sb][2] = *std::min_element(ps, ps + kRows);
        edges[sb][3] = *std::max_element(ps, ps + kRows);
        span[sb][0] = (std::max(edges[sb][0], kbeg) - kbeg) / kPT;
        span[sb][1] = (edges[sb][3] - kbeg) / kPT + 1;
        j_begin = std::min(j_begin, span[sb][0]);
        j_end = std::max(j_end, span[sb][1]);
      }
      for (int64_t j = j_begin; j < j_end; ++j) {
        const int64_t k0 = kbeg + j * kPT;  // the tile's first key
        const E* kt = kp.data() + (h * ntiles + j) * d * kPT;
        const E* vt = vp.data() + (h * ntiles + j) * kPT * dp;
        for (int sb = 0; sb < nsub; ++sb) {
          if (j < span[sb][0] || j >= span[sb][1]) continue;
          const int64_t* ps = pos + sb * kRows;
          const int64_t* ls = lo + sb * kRows;
          float* ms = m + sb * kRows;
          float* lsum = l + sb * kRows;
          P::scores(qf.data() + sb * kRows * d, d, kt, scale, sc.data());
          if (softcap > 0.f)
            for (int t0 = 0; t0 < kRows * kPT; t0 += kTile) cap_tile(sc.data() + t0, softcap);
          const bool edge = k0 < edges[sb][1] || k0 + kPT - 1 > edges[sb][2];
          for (int r = 0; r < kRows; ++r) {
            float* sr = sc.data() + r * kPT;
            if (edge)
              for (int c = 0; c < kPT; ++c)
                if (k0 + c > ps[r] || k0 + c < ls[r]) sr[c] = ninf;
            Vec mx_v(ms[r]);
            for (int v = 0; v < kPT / kW; ++v)
              mx_v = at::vec::maximum(mx_v, Vec::loadu(sr + v * kW));
            const float mx = at::vec::vec_reduce_all<float>(
                [](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, mx_v);
            if (mx == ninf) {  // nothing this row sees yet (a window's leading tiles)
              std::fill(sr, sr + kPT, 0.f);
              alpha[r] = 1.f;
              continue;
            }
            Vec sum_v(0.f);
            for (int v = 0; v < kPT / kW; ++v) {
              const Vec e = (Vec::loadu(sr + v * kW) - Vec(mx)).exp_u20();
              e.store(sr + v * kW);
              sum_v = sum_v + e;
            }
            alpha[r] = mx == ms[r] ? 1.f : ms[r] == ninf ? 0.f : std::exp(ms[r] - mx);
            ms[r] = mx;
            lsum[r] = lsum[r] * alpha[r] + at::vec::vec_reduce_all<float>(
                [](Vec& x, Vec& y) { return x + y; }, sum_v);
          }
          P::values(sc.data(), alpha, vt, dp, o.data() + sb * kRows * dp);
        }
      }
      for (int r = 0; r < n; ++r) {
        const int64_t rr = r0 + r, i = rr / group, g = rr % group;
        T* dst = out + (i * hq + h * group + g) * d;
        const float inv = 1.f / l[r];
        for (int64_t c = 0; c < d; ++c) dst[c] = static_cast<T>(o[r * dp + c] * inv);
      }
    }
  });
}

}  // namespace

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& kv, int64_t layer,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        double scale, int64_t window, double softcap,
                        const std::optional<at::Tensor>& score_rows,
                        const std::optional<at::Tensor>& logits, bool fma_only) {
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 6, "paged_decode: q [N, Hq, D], kv 6-D");
  TORCH_CHECK(q.is_contiguous() && kv.is_contiguous(), "paged_decode: contiguous inputs");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "paged_decode: int64 block tables and lengths");
  const bool q8 = kv.scalar_type() == at::kChar;
  TORCH_CHECK(q8 || q.scalar_type() == kv.scalar_type(), "paged_decode: q and kv dtypes differ");
  const int64_t n = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t hkv = kv.size(4), block_size = kv.size(3), rd = kv.size(5);
  TORCH_CHECK(rd == (q8 ? d + 2 : d) && hq % hkv == 0, "paged_decode: head shapes disagree");
  TORCH_CHECK(window >= 0 && softcap >= 0, "paged_decode: window and softcap >= 0 (0: none)");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = at::empty_like(q);
  const int64_t* rows = nullptr;
  float* lg = nullptr;
  int64_t lwidth = 0;
  at::Tensor rows_c;
  if (score_rows.has_value() && score_rows->defined()) {
    TORCH_CHECK(logits.has_value() && logits->scalar_type() == at::kFloat &&
                    logits->is_contiguous() && logits->dim() == 3 && logits->size(1) == hq,
                "paged_decode: logits [M, Hq, W] fp32 contiguous with score_rows");
    rows_c = score_rows->contiguous();
    TORCH_CHECK(rows_c.scalar_type() == at::kLong && rows_c.numel() == n,
                "paged_decode: score_rows [N] int64");
    rows = rows_c.data_ptr<int64_t>();
    lwidth = logits->size(2);
    for (int64_t i = 0; i < n; ++i)
      TORCH_CHECK(rows[i] < logits->size(0) &&
                      (rows[i] < 0 || lens.data_ptr<int64_t>()[i] <= lwidth),
                  "paged_decode: row ", i, "'s logits do not fit");
    lg = logits->data_ptr<float>();
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    if (q8)
      decode_kernel<scalar_t, int8_t>(q.data_ptr<scalar_t>(), kv.data_ptr<int8_t>(),
                                      tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                                      out.data_ptr<scalar_t>(), n, hq, hkv, d, block_size,
                                      tables.size(1), kv.stride(1), kv.stride(0), layer, scale,
                                      rd, window, softcap, kv.size(0), rows, lg, lwidth,
                                      fma_only);
    else
      decode_kernel<scalar_t, scalar_t>(q.data_ptr<scalar_t>(), kv.data_ptr<scalar_t>(),
                                        tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                                        out.data_ptr<scalar_t>(), n, hq, hkv, d, block_size,
                                        tables.size(1), kv.stride(1), kv.stride(0), layer,
                                        scale, rd, window, softcap, kv.size(0), rows, lg,
                                        lwidth, fma_only);
  });
  return out;
}


// A decode step's attention in one call, for a step compiled as one graph
// (engine/compile/decode.py): each row's new K and V (already in the cache's dtype) are
// copied into its slot of layer `layer`, then the rows attend as paged_decode does. A row
// whose slot block is negative is a bucket's padding: nothing is written for it, and
// with seq_len 0 it reads nothing and gets zeros.
at::Tensor paged_decode_write(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              at::Tensor& kv, const at::Tensor& slot_blocks,
                              const at::Tensor& slot_offsets, int64_t layer,
                              const at::Tensor& block_tables, const at::Tensor& seq_lens,
                              double scale, int64_t window, double softcap, bool fma_only) {
  TORCH_CHECK(kv.dim() == 6 && kv.is_contiguous(), "paged_decode_write: kv 6-D contiguous");
  TORCH_CHECK(k.scalar_type() == kv.scalar_type() && v.scalar_type() == kv.scalar_type(),
              "paged_decode_write: k and v in the cache's dtype");
  TORCH_CHECK(slot_blocks.scalar_type() == at::kLong && slot_offsets.scalar_type() == at::kLong,
              "paged_decode_write: int64 slots");
  TORCH_CHECK(layer >= 0 && layer < kv.size(1), "paged_decode_write: layer ", layer,
              " out of range");
  const int64_t n = k.size(0);
  const int64_t row = kv.size(4) * kv.size(5);  // one token's K (or V) of every KV head
  TORCH_CHECK(k.numel() == n * row && v.numel() == n * row && slot_blocks.numel() == n &&
                  slot_offsets.numel() == n,
              "paged_decode_write: k, v [N, Hkv, R] and slots [N] disagree with the cache");
  auto kc = k.contiguous(), vc = v.contiguous();
  auto blocks = slot_blocks.contiguous(), offsets = slot_offsets.contiguous();
  const int64_t* b = blocks.data_ptr<int64_t>();
  const int64_t* o = offsets.data_ptr<int64_t>();
  const size_t es = kv.element_size(), bytes = row * es;
  auto* base = static_cast<char*>(kv.data_ptr());
  const auto* ks = static_cast<const char*>(kc.data_ptr());
  const auto* vs = static_cast<const char*>(vc.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    if (b[i] < 0) continue;
    TORCH_CHECK(b[i] < kv.size(0) && o[i] >= 0 && o[i] < kv.size(3),
                "paged_decode_write: row ", i, "'s slot is outside the cache");
    char* dst = base + (b[i] * kv.stride(0) + layer * kv.stride(1) + o[i] * kv.stride(3)) * es;
    std::memcpy(dst, ks + i * bytes, bytes);
    std::memcpy(dst + kv.stride(2) * es, vs + i * bytes, bytes);
  }
  return paged_decode(q, kv, layer, block_tables, seq_lens, scale, window, softcap,
                      std::nullopt, std::nullopt, fma_only);
}

at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& kv, int64_t layer,
                         const at::Tensor& block_table, int64_t seq_len, double scale,
                         int64_t window, double softcap, bool fma_only) {
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 6, "paged_prefill: q [T, Hq, D], kv 6-D");
  TORCH_CHECK(q.is_contiguous() && kv.is_contiguous(), "paged_prefill: contiguous inputs");
  TORCH_CHECK(q.scalar_type() == kv.scalar_type(), "paged_prefill: q and kv dtypes differ");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 1,
              "paged_prefill: an int64 block table [B]");
  const int64_t tq = q.size(0), hq = q.size(1), d = q.size(2), hkv = kv.size(4);
  TORCH_CHECK(kv.size(5) == d && hq % hkv == 0, "paged_prefill: head shapes disagree");
  TORCH_CHECK(tq <= seq_len, "paged_prefill: ", tq, " queries in a sequence of ", seq_len);
  TORCH_CHECK(window >= 0 && softcap >= 0, "paged_prefill: window and softcap >= 0 (0: none)");
  auto table = block_table.contiguous();
  auto out = at::empty_like(q);
  if (tq == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_prefill", [&] {
    auto run = [&](auto panels) {
      prefill_kernel<scalar_t, decltype(panels)>(
          q.data_ptr<scalar_t>(), kv.data_ptr<scalar_t>(), table.data_ptr<int64_t>(),
          table.numel(), out.data_ptr<scalar_t>(), tq, seq_len, hq, hkv, d, kv.size(3),
          kv.stride(1), kv.stride(0), layer, scale, window, softcap, kv.size(0));
    };
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
      if (d % 2 == 0 && !fma_only) return run(Bf16Panels{});
    }
#endif
    run(FmaPanels{});
  });
  return out;
}

TORCH_LIBRARY(tandem, m) {
  m.def("paged_decode(Tensor q, Tensor kv, int layer, Tensor block_tables, Tensor seq_lens, "
        "float scale, int window=0, float softcap=0., Tensor? score_rows=None, "
        "Tensor(a!)? logits=None, bool fma_only=False) -> Tensor");
  m.def("paged_prefill(Tensor q, Tensor kv, int layer, Tensor block_table, int seq_len, "
        "float scale, int window=0, float softcap=0., bool fma_only=False) -> Tensor");
  m.def("paged_decode_write(Tensor q, Tensor k, Tensor v, Tensor(a!) kv, Tensor slot_blocks, "
        "Tensor slot_offsets, int layer, Tensor block_tables, Tensor seq_lens, float scale, "
        "int window=0, float softcap=0., bool fma_only=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("paged_prefill", &paged_prefill);
  m.impl("paged_decode_write", &paged_decode_write);
}
