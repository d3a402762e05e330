// What the CPU attention kernels share: a vectorizable exp, bfloat16 storage, int8 KV rows with
// their scales, and a walk over a sequence's paged blocks. Header-only; paged_decode.cpp and
// paged_prefill.cpp include it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace genq {

// exp(x) for the softmax's x <= 0, written so that the compiler vectorizes loops over it (std::exp
// is a scalar libm call): x = n ln2 + r with |r| <= ln2/2, exp(r) by its Taylor polynomial (degree 7
// for float, 13 for double: truncation under an ulp), then 2^n through the exponent bits. Below
// the clamp the true value is under 2e-38 (float) / 3e-308 (double): nothing beside the max's
// exp(0) = 1 in the sum.
constexpr double kInverse[] = {0, 1, 1 / 2., 1 / 3., 1 / 4., 1 / 5., 1 / 6., 1 / 7., 1 / 8., 1 / 9.,
                               1 / 10., 1 / 11., 1 / 12., 1 / 13.};
template <typename T> struct ExpConstants;
template <> struct ExpConstants<float> {
    using Bits = int32_t;
    static constexpr int degree = 7, mantissa_bits = 23, bias = 127;
    static constexpr float lowest = -87.0f;
};
template <> struct ExpConstants<double> {
    using Bits = int64_t;
    static constexpr int degree = 13, mantissa_bits = 52, bias = 1023;
    static constexpr double lowest = -708.0;
};

template <typename T>
inline T exp_nonpositive(T x) {
    using C = ExpConstants<T>;
    x = x < C::lowest ? C::lowest : x;
    const T n = std::floor(x * T(1.4426950408889634) + T(0.5));
    const T r = (x - n * T(0.693145751953125)) - n * T(1.428606820309417232e-06);   // ln2 = hi + lo
    T p = T(1);
    for (int k = C::degree; k >= 1; k--) p = T(1) + p * r * T(kInverse[k]);          // Horner on 1/k!
    const typename C::Bits bits = (static_cast<typename C::Bits>(n) + C::bias) << C::mantissa_bits;
    T scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

// exp(x) for any x that is not NaN: below the clamp as exp_nonpositive; above it the largest finite power its
// scaling reaches (exp(88) in float, exp(709) in double: the reduction and the exponent bits hold up to there),
// where the true value overflows or nearly does (SiLU's 1 + exp(-x) is then as good as infinite).
template <typename T> struct ExpHighest;
template <> struct ExpHighest<float> { static constexpr float value = 88.0f; };
template <> struct ExpHighest<double> { static constexpr double value = 709.0; };
template <typename T>
inline T exp_finite(T x) {
    return exp_nonpositive(x > ExpHighest<T>::value ? ExpHighest<T>::value : x);
}

#if defined(__AVX512F__)
// exp_nonpositive on 16 lanes: the same reduction and Taylor polynomial, written out for
// AVX-512, the polynomial by Horner's rule on its coefficients 1/k! (one FMA a degree, where the scalar form
// takes a product and an FMA: the same value to float32 rounding)
inline __m512 exp_nonpositive16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(ExpConstants<float>::lowest));
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.4426950408889634f), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606820309417232e-06f),
                                      _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x));
    static_assert(ExpConstants<float>::degree == 7, "the coefficients below");
    constexpr float kCoefficients[] = {1.0f, 1.0f, 1 / 2.0f, 1 / 6.0f, 1 / 24.0f, 1 / 120.0f, 1 / 720.0f, 1 / 5040.0f};
    __m512 p = _mm512_set1_ps(kCoefficients[7]);
    for (int k = 6; k >= 0; k--) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kCoefficients[k]));
    return _mm512_scalef_ps(p, n);
}

// the keys among the 16 from key t that lie in [lo, hi): bit k for key t + k
inline __mmask16 visible16(int64_t t, int64_t lo, int64_t hi) {
    const int64_t from = std::clamp<int64_t>(lo - t, 0, 16), to = std::clamp<int64_t>(hi - t, 0, 16);
    return static_cast<__mmask16>(((1u << to) - 1) & ~((1u << from) - 1));
}

// A softmax's first half: the row's scores [lo, hi) scaled in place; returns their max, and the sink's if there
// is one. Four vectors a step with four accumulators (as softmax_row16's sum).
inline float scale_and_max16(float *sr, int64_t lo, int64_t hi, float scale, const float *sink) {
    const __m512 vscale = _mm512_set1_ps(scale);
    const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512 m[4] = {lowest, lowest, lowest, lowest};
    int64_t t = lo;
    for (; t + 64 <= hi; t += 64)
        for (int v = 0; v < 4; v++) {
            const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(sr + t + 16 * v), vscale);
            _mm512_storeu_ps(sr + t + 16 * v, x);
            m[v] = _mm512_max_ps(m[v], x);
        }
    for (; t < hi; t += 16) {
        const __mmask16 k = visible16(t, lo, hi);
        const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, sr + t), vscale);
        _mm512_mask_storeu_ps(sr + t, k, x);
        m[0] = _mm512_mask_max_ps(m[0], k, m[0], x);
    }
    const float max = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3])));
    return sink ? std::max(max, *sink) : max;
}

// One row's softmax numerators in place over its visible keys [lo, hi) (scores scaled first by `scale`), the
// sink, if any, one more logit; returns their sum. Four vectors a step with four accumulators each for the max
// and the sum: the compiler's loops kept one of each, a chain of dependent adds (the sum's through the stack)
// that took ~40% of a bfloat16 prefill on AMX tiles. Both kernels' float32 softmax without soft-capping.
inline float softmax_row16(float *sr, int64_t lo, int64_t hi, float scale, const float *sink) {
    const float max = scale_and_max16(sr, lo, hi, scale, sink);
    const __m512 vmax = _mm512_set1_ps(max);
    int64_t t;
    __m512 sum[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (t = lo; t + 64 <= hi; t += 64)
        for (int v = 0; v < 4; v++) {
            const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(sr + t + 16 * v), vmax));
            _mm512_storeu_ps(sr + t + 16 * v, e);
            sum[v] = _mm512_add_ps(sum[v], e);
        }
    for (; t < hi; t += 16) {
        const __mmask16 k = visible16(t, lo, hi);
        const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sr + t), vmax));
        _mm512_mask_storeu_ps(sr + t, k, e);
        sum[0] = _mm512_mask_add_ps(sum[0], k, sum[0], e);
    }
    const float total = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(sum[0], sum[1]), _mm512_add_ps(sum[2], sum[3])));
    return total + (sink ? exp_nonpositive(*sink - max) : 0.0f);
}
#endif

// bfloat16: the upper half of a float32. Widening is exact; narrowing rounds to nearest even (the
// softmax's outputs are finite: no NaN case).
struct bf16 {
    uint16_t bits;
};
inline float widen(bf16 x) {
    const uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}
// two bfloat16 values in one 32-bit word, `lo` in the low half: an operand of avx512_bf16's pair products
inline uint32_t pair(bf16 lo, bf16 hi) { return uint32_t(lo.bits) | uint32_t(hi.bits) << 16; }
inline float widen(float x) { return x; }
inline double widen(double x) { return x; }
inline float widen(int8_t x) { return x; }  // an int8 cache's row, before its scale (kv_cache.py)
// the type a storage type computes in
template <typename T> struct Compute { using type = T; };
template <> struct Compute<bf16> { using type = float; };
template <typename T> inline T narrow(typename Compute<T>::type x) {
    if constexpr (std::is_same<T, bf16>::value) {
        uint32_t bits;
        std::memcpy(&bits, &x, sizeof bits);
        bits += 0x7FFFu + ((bits >> 16) & 1u);
        return bf16{static_cast<uint16_t>(bits >> 16)};
    } else {
        return x;
    }
}

// fn(t0, t1, rows, slot) for each block's share [t0, t1) of the positions [first, len) of one
// sequence and KV head: `head` is that head's pool, `table` the sequence's block ids, `rows` position
// t0's head_dim values (the block's rows follow it contiguously), `slot` its slot in the head's pool
// (an int8 cache's scales of the block's rows are at [slot, slot + t1 - t0) of the head's scales).
// While fn works on one block, the blocks two ahead are fetched into L2: a sequence's blocks lie anywhere in
// the pool, so the hardware's prefetchers, which follow addresses that advance steadily, see each block's
// start as a miss (decode attention ran 1.8x faster over blocks in pool order than over the same blocks
// shuffled, before prefetching). Into L2, not L1: a block is 32-64 lines, more than L1's miss buffers hold,
// and prefetches into L1 (`__builtin_prefetch`'s default) stalled on them. On the 2-core EPYC (Zen 4),
// DRAM-bound (8 layers of pools, 64 sequences x 300 tokens, two threads): one block ahead into L1 read
// 12.4 GB/s (float32) and 9.5 (bfloat16), two ahead into L2 18-20 and 17.
constexpr int64_t kPrefetchAhead = 2;  // blocks fetched ahead of the one being read

// One line fetched into L2 (prefetcht2). On x86 through an asm statement the compiler must keep: GCC 12 dropped
// every `__builtin_prefetch` of prefetch_blocks' loop from some instantiations when the loop's bound became a
// constant's minimum (the float32 decode then read its KV at 14 GB/s instead of 22, with no warning).
inline void fetch_line(const char *p) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    asm volatile("prefetcht2 %0" : : "m"(*p));
#else
    __builtin_prefetch(p, 0, 1);  // locality 1: prefetcht2's level where the target has one
#endif
}

// Blocks [from, to) of a sequence of `len` positions (as for_each_block numbers them) fetched into L2.
template <typename T>
inline void prefetch_blocks(const T *head, const int64_t *table, int64_t from, int64_t to, int64_t len,
                            int64_t block_size, int64_t D) {
    constexpr int64_t kLine = 64;  // bytes a prefetch brings
    const int64_t block_bytes = block_size * D * static_cast<int64_t>(sizeof(T));
    for (int64_t b = from; b < to && b * block_size < len; b++) {
        const char *rows = reinterpret_cast<const char *>(head + table[b] * block_size * D);
        for (int64_t offset = 0; offset < block_bytes; offset += kLine) fetch_line(rows + offset);
    }
}

// `fetched`: the caller has already fetched the first kPrefetchAhead blocks (prefetch_blocks): the decode
// kernel fetches the values' first blocks as it starts on the keys, and the next item's first key block as it
// starts on an item (on the same EPYC, the decode workload: float32 1,264-1,350 -> 1,362-1,451 tok/s,
// bfloat16 2,087-2,122 -> 2,272-2,356).
template <typename T, typename Fn>
inline void for_each_block(const T *head, const int64_t *table, int64_t first, int64_t len,
                           int64_t block_size, int64_t D, Fn &&fn, bool fetched = false) {
    const int64_t start = first / block_size;
    if (!fetched) prefetch_blocks(head, table, start + 1, start + kPrefetchAhead, len, block_size, D);
    for (int64_t b = start; b * block_size < len; b++) {
        const int64_t t0 = std::max(first, b * block_size), t1 = std::min(len, (b + 1) * block_size);
        const int64_t slot = table[b] * block_size + (t0 - b * block_size);
        prefetch_blocks(head, table, b + kPrefetchAhead, b + kPrefetchAhead + 1, len, block_size, D);
        fn(t0, t1, head + slot * D, slot);
    }
}

}  // namespace genq
