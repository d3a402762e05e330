// Paged decode attention on the CPU: one query per sequence, attended straight from the paged pool.
//
// The torch path gathers every sequence's K/V blocks into a contiguous buffer before a batched
// matmul, which writes and re-reads the whole context in every layer of every step; on a CPU that
// copy costs more than the attention itself. Here each (sequence, KV head) reads its blocks in
// place, once, for all the query heads that share the KV head (GQA), with an exact softmax.
//
// Layouts (elements, row-major, head_dim contiguous everywhere):
//   k_pool, v_pool : [num_kv_heads, num_blocks, block_size, head_dim], one layer of the pool
//   q, out         : [n, num_heads, head_dim] with strides (q_sn, q_sh) and (o_sn, o_sh)
//   tables         : [n, width] block ids;  lens: [n] context lengths (the query's own token included)
//   sinks          : [num_heads] or null (attention sinks); softcap <= 0: none; window <= 0: none
//
// Element types: float32 and float64 compute in their own type; bfloat16 (the pool, q and out in
// bfloat16, sinks in float32) computes in float32 (scores, softmax and the weighted sum of values),
// widening each element as it is read (with avx512_bf16, products of bfloat16 pairs, exact, summed in float32);
// the softmax's weights are rounded to bfloat16 before they weigh the values (as torch's CPU SDPA rounds them)
// and the output once, to nearest even.
// int8 pools (the *_i8 kernels; q and out in the model's type) come with k_scales and v_scales,
// [num_kv_heads, num_blocks, block_size] in bfloat16, a scale per row: a key's dot product is
// scaled once, and a value's softmax weight takes its row's scale.
//
// No torch headers: batching/cpu_attention.py builds it at run time with the system compiler in
// well under a second and calls it through ctypes on the tensors' memory.
#include <vector>

#include <omp.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "attention_common.h"

namespace {

using namespace genq;

#if defined(__AVX512F__)
// AVX-512 for the common case (float32 or bfloat16 pools, head size 64 or 128). The plain loops below
// reduce each key's dot product across a vector's lanes on its own (a dozen shuffles and adds for a few
// multiplies: on a 2-core EPYC the float32 kernel read its KV at a third of what a stream reads); here
// the keys go 16 at a time and their 16 lane vectors are summed together into one vector of scores, and
// bfloat16 keys meet bfloat16 queries in avx512_bf16's dot product (products exact, sums in float32),
// without widening either.
#define GENQ_DECODE_AVX512 1

inline __m512 load16(const float *p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16 *p) {  // 16 bfloat16 values, widened (exactly)
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// 16 lanes whose sum is q . k over D elements (bfloat16 without avx512_bf16: widened, as float32)
template <int D, typename T> inline __m512 dot_lanes(const T *q, const T *k) {
    __m512 acc = _mm512_mul_ps(load16(q), load16(k));
    for (int d = 16; d < D; d += 16) acc = _mm512_fmadd_ps(load16(q + d), load16(k + d), acc);
    return acc;
}
#if defined(__AVX512BF16__)
template <int D> inline __m512 dot_lanes(const bf16 *q, const bf16 *k) {
    __m512 acc = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + d), (__m512bh)_mm512_loadu_si512(k + d));
    return acc;
}
#endif

// lane j of the result: the sum of v[j]'s 16 lanes (a transpose and add in 15 steps of three instructions)
inline __m512 sum16(const __m512 *v) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)  // per 128-bit lane: v[2i]'s sums in 0 and 2, v[2i+1]'s in 1 and 3
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  // per 128-bit lane: keys 4i .. 4i+3 in order
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)  // 128-bit lanes: keys 8i..8i+3 twice, then 8i+4..8i+7 twice
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// s[t] = q . row_t * scale for `count` rows of D elements
template <int D, typename T>
inline void score_rows(const T *q, const T *rows, int64_t count, float scale, float *s) {
    const __m512 vscale = _mm512_set1_ps(scale);
    int64_t t = 0;
    for (; t + 16 <= count; t += 16) {
        __m512 lanes[16];
        for (int j = 0; j < 16; j++) lanes[j] = dot_lanes<D>(q, rows + (t + j) * D);
        _mm512_storeu_ps(s + t, _mm512_mul_ps(sum16(lanes), vscale));
    }
    for (; t < count; t++) s[t] = _mm512_reduce_add_ps(dot_lanes<D>(q, rows + t * D)) * scale;
}

// acc += sum_t p[t] row_t over `count` float rows of D elements; two keys at a time into two sets of
// accumulators, so that the adds into one register do not wait on each other
template <int D>
inline void accumulate_rows(const float *p, const float *rows, int64_t count, float *acc) {
    constexpr int kChunks = D / 16;
    __m512 even[kChunks], odd[kChunks];
    for (int j = 0; j < kChunks; j++) even[j] = _mm512_loadu_ps(acc + 16 * j), odd[j] = _mm512_setzero_ps();
    int64_t t = 0;
    for (; t + 2 <= count; t += 2) {
        const __m512 w0 = _mm512_set1_ps(p[t]), w1 = _mm512_set1_ps(p[t + 1]);
        for (int j = 0; j < kChunks; j++) {
            even[j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(rows + t * D + 16 * j), even[j]);
            odd[j] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(rows + (t + 1) * D + 16 * j), odd[j]);
        }
    }
    if (t < count) {
        const __m512 w = _mm512_set1_ps(p[t]);
        for (int j = 0; j < kChunks; j++) even[j] = _mm512_fmadd_ps(w, _mm512_loadu_ps(rows + t * D + 16 * j), even[j]);
    }
    for (int j = 0; j < kChunks; j++) _mm512_storeu_ps(acc + 16 * j, _mm512_add_ps(even[j], odd[j]));
}

#if defined(__AVX512BF16__)
// bfloat16 values by avx512_bf16's dot product, two keys a step: rows t and t + 1 interleaved element by element
// (unpacklo/hi_epi16: pairs (v_t[d], v_t+1[d])) meet the pair of weights (p_t, p_t+1), already rounded to
// bfloat16, in one vdpbf16ps for 16 elements, where the widened path stores the block's values in float32 and
// does one FMA a key and element. The unpacks work within 128-bit lanes, so the accumulators hold the elements
// in the order `pair_element` gives; `unpermute_pairs` puts them back once an item is done. On the 2-core EPYC
// (Zen 4), 64 sequences x ~250 tokens, two threads: from cache 47 -> 62 GB/s; from DRAM (8 layers of pools,
// blocks shuffled) unchanged at ~21, the reads bound there; the decode workload's attention 3.2-3.5 -> 3.0-3.4 s.

// the element of a head's row that lane j of accumulator c holds (c: 32-element chunk x 2 + 0 lo / 1 hi)
inline int pair_element(int c, int j) { return (c / 2) * 32 + (j / 4) * 8 + (c % 2) * 4 + j % 4; }

// acc[c] += p_t v_t[...] + p_t+1 v_t+1[...] over the keys [0, count) of one block, for one query head
template <int D>
inline void accumulate_pairs(const float *p, const bf16 *rows, int64_t count, float *acc) {
    constexpr int kChunks = D / 32;
    __m512 lo[kChunks], hi[kChunks];
    for (int c = 0; c < kChunks; c++) lo[c] = _mm512_loadu_ps(acc + 32 * c), hi[c] = _mm512_loadu_ps(acc + 32 * c + 16);
    for (int64_t t = 0; t < count; t += 2) {  // p holds bfloat16 values (rounded above): narrowing is exact
        const bool both = t + 1 < count;
        const uint32_t word = pair(narrow<bf16>(p[t]), both ? narrow<bf16>(p[t + 1]) : bf16{0});
        const __m512bh weight = (__m512bh)_mm512_set1_epi32(static_cast<int>(word));
        for (int c = 0; c < kChunks; c++) {
            const __m512i a = _mm512_loadu_si512(rows + t * D + 32 * c);
            const __m512i b = both ? _mm512_loadu_si512(rows + (t + 1) * D + 32 * c) : _mm512_setzero_si512();
            lo[c] = _mm512_dpbf16_ps(lo[c], weight, (__m512bh)_mm512_unpacklo_epi16(a, b));
            hi[c] = _mm512_dpbf16_ps(hi[c], weight, (__m512bh)_mm512_unpackhi_epi16(a, b));
        }
    }
    for (int c = 0; c < kChunks; c++) _mm512_storeu_ps(acc + 32 * c, lo[c]), _mm512_storeu_ps(acc + 32 * c + 16, hi[c]);
}

// rep rows of D accumulated in pair order, written back in element order
template <int D> inline void unpermute_pairs(float *acc, int64_t rep) {
    float row[D];
    for (int64_t r = 0; r < rep; r++) {
        float *a = acc + r * D;
        for (int c = 0; c < 2 * (D / 32); c++)
            for (int j = 0; j < 16; j++) row[pair_element(c, j)] = a[16 * c + j];
        std::memcpy(a, row, sizeof row);
    }
}
#endif

// `count` rows of D bfloat16 values widened into `wide` (the block's values once, for every query head)
template <int D> inline const float *widen_rows(const bf16 *rows, int64_t count, float *wide) {
    for (int64_t i = 0; i < count * D; i += 16) _mm512_storeu_ps(wide + i, load16(rows + i));
    return wide;
}
template <int D> inline const float *widen_rows(const float *rows, int64_t, float *) { return rows; }
#endif

// One (sequence, KV head): its `rep` query heads over its context. FixedD > 0 compiles the head
// size in (64 and 128 are common): the query and the output row then live in registers through a
// block's loop, where a runtime size reloads them for every key. Within a block each query head
// runs over the block's keys (still in L1 for the next head), so per-element sums keep the same
// order as one key at a time: every head size gives the same values.
template <int FixedD, typename T, typename KV, typename A = typename Compute<T>::type>
void attend_one(const T *q, int64_t q_sh, const KV *kh, const KV *vh, const bf16 *ksh,
                const bf16 *vsh, const int64_t *table,
                int64_t len, int64_t first, int64_t rep, int64_t head_dim, int64_t block_size, A scale,
                A softcap, const A *sinks, T *out, int64_t o_sh, std::vector<A> &qw,
                std::vector<A> &scores, std::vector<A> &acc, std::vector<A> &denom_inv) {
    const int64_t D = FixedD > 0 ? FixedD : head_dim;
    constexpr int64_t kRow = FixedD > 0 ? FixedD : 1;  // local copies' size (unused when 1)
    constexpr bool kInt8 = std::is_same<KV, int8_t>::value;
#if defined(GENQ_DECODE_AVX512)
    constexpr bool kVector = FixedD > 0 && std::is_same<T, KV>::value && std::is_same<A, float>::value;
#else
    constexpr bool kVector = false;
#endif
    const int64_t span = len - first;
    scores.resize(rep * span);
    acc.assign(rep * D, A(0));
    denom_inv.resize(rep);
#if defined(GENQ_DECODE_AVX512)
    if constexpr (kVector) {
        prefetch_blocks(vh, table, first / block_size, first / block_size + kPrefetchAhead, len, block_size, D);
        for_each_block(kh, table, first, len, block_size, D, [&](int64_t t0, int64_t t1, const KV *rows, int64_t) {
            for (int64_t r = 0; r < rep; r++)
                score_rows<FixedD>(q + r * q_sh, rows, t1 - t0, scale, scores.data() + r * span + (t0 - first));
        });
    }
#endif
    if constexpr (!kVector) {
    qw.resize(rep * D);
    for (int64_t r = 0; r < rep; r++)
        for (int64_t d = 0; d < D; d++) qw[r * D + d] = widen(q[r * q_sh + d]);
    // scores[r][t] = q_r . k_t * scale (soft-capped below)
    for_each_block(kh, table, first, len, block_size, D, [&](int64_t t0, int64_t t1, const KV *rows,
                                                             int64_t slot) {
        for (int64_t r = 0; r < rep; r++) {
            A local[kRow];
            const A *qr = qw.data() + r * D;
            if constexpr (FixedD > 0) {
                for (int64_t d = 0; d < D; d++) local[d] = qr[d];
                qr = local;
            }
            A *sr = scores.data() + r * span - first;
            for (int64_t t = t0; t < t1; t++) {
                const KV *krow = rows + (t - t0) * D;
                A s = 0;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < D; d++) s += qr[d] * widen(krow[d]);
                if constexpr (kInt8) s *= widen(ksh[slot + (t - t0)]);
                sr[t] = s * scale;
            }
        }
    });
    }
    // softmax per query head; a sink is one more logit that takes mass but has no value
    for (int64_t r = 0; r < rep; r++) {
        A *sr = scores.data() + r * span;
        bool done = false;  // by the AVX-512 softmax (attention_common.h)
#if defined(__AVX512F__)
        if constexpr (std::is_same<A, float>::value)
            if (softcap <= 0) {
                denom_inv[r] = 1.0f / softmax_row16(sr, 0, span, 1.0f, sinks ? sinks + r : nullptr);
                done = true;
            }
#endif
        if (!done) {
            if (softcap > 0)
                for (int64_t t = 0; t < span; t++) sr[t] = std::tanh(sr[t] / softcap) * softcap;
            A m = sinks ? sinks[r] : sr[0];
#pragma omp simd reduction(max : m)
            for (int64_t t = 0; t < span; t++) m = sr[t] > m ? sr[t] : m;
            A sum = sinks ? exp_nonpositive(sinks[r] - m) : A(0);
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < span; t++) {
                sr[t] = exp_nonpositive(sr[t] - m);
                sum += sr[t];
            }
            denom_inv[r] = A(1) / sum;
        }
        // bfloat16: p rounded to bfloat16 before p . v, as torch's CPU SDPA does (the sum above unrounded, as
        // there): on 32 sequences x 300 tokens the output then equals SDPA's in 86% of elements, against 60%
        if constexpr (std::is_same<T, bf16>::value)
            for (int64_t t = 0; t < span; t++) sr[t] = widen(narrow<bf16>(sr[t]));
    }
    // out_r = sum_t p[r][t] v_t / sum
#if defined(GENQ_DECODE_AVX512)
#if defined(__AVX512BF16__)
    if constexpr (kVector && std::is_same<KV, bf16>::value) {
        for_each_block(vh, table, first, len, block_size, D, [&](int64_t t0, int64_t t1, const KV *rows, int64_t) {
            for (int64_t r = 0; r < rep; r++)
                accumulate_pairs<FixedD>(scores.data() + r * span + (t0 - first), rows, t1 - t0, acc.data() + r * D);
        }, true);
        unpermute_pairs<FixedD>(acc.data(), rep);
    } else
#endif
    if constexpr (kVector) {
        qw.resize(block_size * D);  // a bfloat16 block's values widened, for every query head
        for_each_block(vh, table, first, len, block_size, D, [&](int64_t t0, int64_t t1, const KV *rows, int64_t) {
            const float *wide = widen_rows<FixedD>(rows, t1 - t0, qw.data());
            for (int64_t r = 0; r < rep; r++)
                accumulate_rows<FixedD>(scores.data() + r * span + (t0 - first), wide, t1 - t0, acc.data() + r * D);
        }, true);
    }
#endif
    if constexpr (!kVector)
    for_each_block(vh, table, first, len, block_size, D, [&](int64_t t0, int64_t t1, const KV *rows,
                                                             int64_t slot) {
        for (int64_t r = 0; r < rep; r++) {
            const A *pr = scores.data() + r * span - first;
            A local[kRow];
            A *ar = acc.data() + r * D;
            if constexpr (FixedD > 0) {
                for (int64_t d = 0; d < D; d++) local[d] = ar[d];
                ar = local;
            }
            for (int64_t t = t0; t < t1; t++) {
                A p = pr[t];
                if constexpr (kInt8) p *= widen(vsh[slot + (t - t0)]);
                const KV *vrow = rows + (t - t0) * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) ar[d] += p * widen(vrow[d]);
            }
            if constexpr (FixedD > 0)
                for (int64_t d = 0; d < D; d++) acc[r * D + d] = local[d];
        }
    });
    for (int64_t r = 0; r < rep; r++)
        for (int64_t d = 0; d < D; d++) out[r * o_sh + d] = narrow<T>(acc[r * D + d] * denom_inv[r]);
}

template <typename T, typename KV, typename A = typename Compute<T>::type>
void paged_decode(const T *q, int64_t q_sn, int64_t q_sh, const KV *k_pool, const KV *v_pool,
                  const bf16 *k_scales, const bf16 *v_scales, const int64_t *tables, int64_t width,
                  const int64_t *lens, T *out, int64_t o_sn,
                  int64_t o_sh, int64_t n, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                  int64_t block_size, int64_t num_blocks, double scale, double softcap,
                  const A *sinks, int64_t window, int num_threads) {
    const int64_t rep = num_heads / num_kv_heads;
    const int64_t head_stride = num_blocks * block_size * head_dim, scale_stride = num_blocks * block_size;
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<A> qw, scores, acc, denom_inv;
        const int64_t items = n * num_kv_heads, stride = omp_get_num_threads();
        const auto first_of = [&](int64_t i) { return window > 0 && lens[i] > window ? lens[i] - window : 0; };
#pragma omp for schedule(static, 1)
        for (int64_t item = 0; item < items; item++) {
            const int64_t i = item / num_kv_heads, g = item % num_kv_heads;
            const int64_t len = lens[i];
            const int64_t first = first_of(i);
            if (item + stride < items) {  // this thread's next item: its first blocks, while this one runs
                const int64_t ni = (item + stride) / num_kv_heads, ng = (item + stride) % num_kv_heads;
                const int64_t nb = first_of(ni) / block_size;
                prefetch_blocks(k_pool + ng * head_stride, tables + ni * width, nb, nb + 1, lens[ni], block_size, head_dim);
            }
            auto attend = head_dim == 64    ? attend_one<64, T, KV>
                          : head_dim == 128 ? attend_one<128, T, KV>
                                            : attend_one<0, T, KV>;
            attend(q + i * q_sn + g * rep * q_sh, q_sh, k_pool + g * head_stride, v_pool + g * head_stride,
                   k_scales ? k_scales + g * scale_stride : nullptr,
                   v_scales ? v_scales + g * scale_stride : nullptr, tables + i * width, len, first, rep,
                   head_dim, block_size, A(scale), A(softcap),
                   sinks ? sinks + g * rep : nullptr, out + i * o_sn + g * rep * o_sh, o_sh, qw, scores, acc,
                   denom_inv);
        }
    }
}

}  // namespace

#define GENQ_EXPORT(NAME, T, KV, A)                                                                \
    extern "C" void NAME(const T *q, int64_t q_sn, int64_t q_sh, const KV *k_pool,                 \
                         const KV *v_pool, const bf16 *k_scales, const bf16 *v_scales,             \
                         const int64_t *tables, int64_t width, const int64_t *lens, T *out,        \
                         int64_t o_sn, int64_t o_sh, int64_t n, int64_t num_heads,                 \
                         int64_t num_kv_heads, int64_t head_dim, int64_t block_size,               \
                         int64_t num_blocks, double scale, double softcap, const A *sinks,         \
                         int64_t window, int num_threads) {                                        \
        paged_decode<T, KV>(q, q_sn, q_sh, k_pool, v_pool, k_scales, v_scales, tables, width,     \
                            lens, out, o_sn, o_sh, n, num_heads, num_kv_heads, head_dim,           \
                            block_size, num_blocks, scale, softcap, sinks, window, num_threads);   \
    }

GENQ_EXPORT(genq_paged_decode_f32, float, float, float)
GENQ_EXPORT(genq_paged_decode_f64, double, double, double)
GENQ_EXPORT(genq_paged_decode_bf16, bf16, bf16, float)
GENQ_EXPORT(genq_paged_decode_f32_i8, float, int8_t, float)
GENQ_EXPORT(genq_paged_decode_f64_i8, double, int8_t, double)
GENQ_EXPORT(genq_paged_decode_bf16_i8, bf16, int8_t, float)
