// Paged prefill attention on the CPU: the queries of prompt chunks over their cached contexts,
// attended straight from the paged pool.
//
// The torch path gathers each chunk's K/V blocks into a buffer, repeats them per query head (GQA),
// and hands torch's SDPA a full [queries, keys] mask, so it also computes the half of the scores
// that the causal mask throws away. Here each chunk's keys are packed once per call (per KV head,
// in groups of 16 keys transposed to [head_dim][16], widened from bfloat16; bfloat16 values are
// widened once too), then tiles of queries of one KV head, with all the query heads that share it
// (GQA: they become more rows of the same tile), read them and stop at their last query's position.
//
// Per tile (rows = queries x the KV head's query heads, up to kTileRows):
//   1. scores = q . k * scale, a register-blocked product over a group of 16 keys (8 in float64)
//      at a time, each step one vector (or two) per row;
//   2. an exact softmax per row over the keys its position may see (causal, sliding window,
//      Gemma-2 soft-capping, gpt-oss sinks), as paged_decode.cpp computes it;
//   3. out = p . v, kValueRows rows at a time, their outputs held in registers across a block's keys.
// Sums run in a different order than SDPA's; values agree to rounding (the tests bound it).
//
// Layouts (elements, row-major, head_dim contiguous everywhere):
//   k_pool, v_pool : [num_kv_heads, num_blocks, block_size, head_dim], one layer of the pool
//   q, out         : [T, num_heads, head_dim] with strides (q_sn, q_sh) and (o_sn, o_sh): the packed
//                    batch's rows; chunk i owns rows [starts[i], starts[i + 1])
//   tables         : [n, width] block ids; ctx_lens: [n] tokens each chunk attends over (its own
//                    included: its last query sits at ctx_lens[i] - 1)
//   sinks          : [num_heads] or null; softcap <= 0: none; window <= 0: none
// Element types as in paged_decode.cpp: bfloat16 computes in float32 (the softmax's weights rounded to
// bfloat16 before p . v, as torch's CPU SDPA rounds them), float64 in float64. int8
// pools (the *_i8 kernels) come with k_scales and v_scales, [num_kv_heads, num_blocks, block_size]
// in bfloat16: their keys and values are packed dequantized (row x its scale, exact in float32).
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#if defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "attention_common.h"

namespace {

using namespace genq;

// Vectors of the compute type in the CPU's own width (GCC/Clang vector extensions: wider ones
// than the target has are split and spilled): 64 bytes with AVX-512, 32 with AVX, else 16. Scores are
// computed 64 bytes of keys at a time (16 in float32, 8 in float64): one vector or several.
#if defined(__AVX512F__)
constexpr int64_t kVectorBytes = 64;
#elif defined(__AVX__)
constexpr int64_t kVectorBytes = 32;
#else
constexpr int64_t kVectorBytes = 16;
#endif
constexpr int64_t kGroupVectors = 64 / kVectorBytes;
template <typename A> struct Vector {
    typedef A type __attribute__((vector_size(kVectorBytes)));
    static constexpr int64_t lanes = kVectorBytes / sizeof(A);
    static constexpr int64_t group = 64 / sizeof(A);  // keys per group of the score product
};
template <typename V, typename A> inline V load(const A *p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
}
template <typename V, typename A> inline void store(A *p, V v) { std::memcpy(p, &v, sizeof v); }

constexpr int64_t kTileRows = 128;  // query rows per tile (fewer where the threads would lack tiles)
constexpr int kBlockRows = 6;      // rows per register block of scores: 12 accumulators of 16 ymm with AVX2
// groups of keys per register block of scores: with AVX-512 a group is one vector, and 6 rows of one group left
// 6 chains of dependent FMAs, each row's query element loaded for one FMA; two groups make 12 chains and two
// FMAs a load (float32, a 512-query chunk at 2,000 of context, two threads, on the Intel Xeon of 2026-11-28:
// 8.7-9.0 -> 8.3 ms). 12 rows of one group gained nothing.
constexpr int kBlockGroups = kGroupVectors == 1 ? 2 : 1;
constexpr int kValueRows = 6;      // rows per register block of p . v: 12 accumulators

template <typename A> struct Scratch {
    std::vector<A> q, scores, acc, denom_inv;
    std::vector<uint32_t> q_pairs, p_pairs;  // the pair products' queries and weights (bfloat16 pairs)
    std::vector<int64_t> lo, hi;  // each row's visible keys [lo, hi), absolute positions
};

// bfloat16 queries and keys at head size 64 or 128 where the CPU has avx512_bf16: keys are packed as
// bfloat16 pairs, [D/2][group] 32-bit words (key l's elements d and d + 1 in word (d/2, l)), and the
// scores come from its dot product, 32 products a step (exact; summed in float32), where the float32
// product widens each key and does 16. On the 2-core EPYC (Zen 4), a chunk of 512 queries at 1,024-1,536
// of context, two threads: 162-164 -> 186-192 GFLOP/s (the tile's p . v is most of what is left).
#if defined(__AVX512BF16__)
constexpr bool kPairsBuilt = true;
#else
constexpr bool kPairsBuilt = false;
#endif
template <typename T, typename KV> constexpr bool pairs_for() {
    return kPairsBuilt && std::is_same<T, bf16>::value && std::is_same<KV, bf16>::value;
}
constexpr int kPairRows = 12;  // rows per register block of the pair product: 12 of the 32 zmm accumulate

#if defined(__AVX512BF16__)
// scores[i][0..16) = (q_i . key l) * scale for R rows; q: R rows of D/2 pairs; keys: [D/2][16] pairs
template <int R, int D>
inline void score_pairs(const uint32_t *q, const uint32_t *keys, float *scores, int64_t stride, float scale) {
    __m512 acc[R];
    for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
    for (int d = 0; d < D / 2; d++) {
        const __m512bh k = (__m512bh)_mm512_loadu_si512(keys + d * 16);
        for (int i = 0; i < R; i++)
            acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(static_cast<int>(q[i * (D / 2) + d])), k);
    }
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int i = 0; i < R; i++) _mm512_storeu_ps(scores + i * stride, _mm512_mul_ps(acc[i], vscale));
}

// acc[i] += sum over key pairs P in [from, to) of p[i][P] . values' pair row P, for R rows: p's words are two
// bfloat16 weights (keys 2P and 2P + 1), a pair row D words of the two keys' values (element d of each);
// pair row P lies at values + (P / 8) * group_words + (P % 8) * D (eight pairs to a group of 16 keys)
template <int R, int D>
inline void value_pairs(const uint32_t *p, int64_t p_stride, const uint32_t *values, int64_t group_words,
                        int64_t from, int64_t to, float *acc) {
    for (int d0 = 0; d0 < D; d0 += 64) {
        __m512 o[R][4];
        for (int i = 0; i < R; i++)
            for (int v = 0; v < 4; v++) o[i][v] = _mm512_setzero_ps();
        for (int64_t P = from; P < to; P++) {
            const uint32_t *row = values + (P >> 3) * group_words + (P & 7) * D + d0;
            __m512bh x[4];
            for (int v = 0; v < 4; v++) x[v] = (__m512bh)_mm512_loadu_si512(row + 16 * v);
            for (int i = 0; i < R; i++) {
                const __m512bh weight = (__m512bh)_mm512_set1_epi32(static_cast<int>(p[i * p_stride + P]));
                for (int v = 0; v < 4; v++) o[i][v] = _mm512_dpbf16_ps(o[i][v], weight, x[v]);
            }
        }
        for (int i = 0; i < R; i++)
            for (int v = 0; v < 4; v++) {
                float *out = acc + i * D + d0 + 16 * v;
                _mm512_storeu_ps(out, _mm512_add_ps(_mm512_loadu_ps(out), o[i][v]));
            }
    }
}
#endif

#if defined(__AVX512BF16__)
// The pair products' softmax for one row: its scores [lo, hi) scaled and their max as softmax_row16 takes them,
// then the numerators straight into bfloat16 pair words (rounded to nearest even; a hidden key 0) for the pairs
// [p_begin, p_end), 32 keys a step, never stored as float32 (one pass over the row less than the softmax and
// the pairs apart); returns the unrounded sum, the sink's numerator included.
inline float softmax_pairs16(float *sr, int64_t lo, int64_t hi, float scale, const float *sink, uint32_t *words,
                             int64_t p_begin, int64_t p_end) {
    const float max = scale_and_max16(sr, lo, hi, scale, sink);
    const __m512 vmax = _mm512_set1_ps(max);
    __m512 sum_low = _mm512_setzero_ps(), sum_high = _mm512_setzero_ps();
    for (int64_t P = p_begin; P < p_end; P += 16) {
        const int64_t t = 2 * P, count = std::min<int64_t>(16, p_end - P);
        const __mmask16 k_low = visible16(t, lo, hi), k_high = visible16(t + 16, lo, hi);
        const __m512 low = _mm512_maskz_mov_ps(
            k_low, exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k_low, sr + t), vmax)));
        const __m512 high = _mm512_maskz_mov_ps(
            k_high, exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k_high, sr + t + 16), vmax)));
        sum_low = _mm512_add_ps(sum_low, low);
        sum_high = _mm512_add_ps(sum_high, high);
        _mm512_mask_storeu_epi32(words + P, static_cast<__mmask16>((1u << count) - 1),
                                 (__m512i)_mm512_cvtne2ps_pbh(high, low));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(sum_low, sum_high)) + (sink ? exp_nonpositive(*sink - max) : 0.0f);
}
#endif

#if defined(__AMX_BF16__)
// AMX (Sapphire Rapids and later): the bfloat16 pair products above as tile products, 16 rows x 16 columns of
// float32 from 16 x 32 bfloat16 operands in one instruction. The pair layouts are the tiles' own: a group's keys,
// [D/2][16] words, are the B operand of the scores (16 pair rows of 16 keys for each 32 dimensions), and the
// values' pair rows, D words apart, the B operand of p . v (16 pair rows = 32 keys, 16 output dimensions).
// Tiles: 0-3 accumulate (four key groups, or four blocks of 16 output dimensions), 4 holds the A operand (16
// rows of queries or of weights), 5 and 6 take turns holding B. Sums in float32, in another order than the
// AVX-512 pair products; values agree to rounding (the tests bound it).
struct TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// Linux lends a process the tiles' 8 KiB of register state only once it asks (arch_prctl XCOMP_PERM for
// XTILEDATA); where the kernel refuses, the AVX-512 pair products run instead.
inline bool amx_permitted() {
    static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                          18 /* XFEATURE_XTILEDATA */) == 0;
    return permitted;
}
#endif

// the tile products on or off (genq_prefill_tiles: tests and benches compare the two paths in one process)
bool tiles_wanted = true;

inline bool use_tiles() {
#if defined(__AMX_BF16__)
    return tiles_wanted && amx_permitted();
#else
    return false;
#endif
}

#if defined(__AMX_BF16__)

// Every tile 16 rows of 64 bytes; loaded by each thread before its tile products (the configuration is a
// thread's register state), released after them.
inline void configure_tiles() {
    TileConfig config;
    for (int t = 0; t < 8; t++) config.rows[t] = 16, config.colsb[t] = 64;
    _tile_loadconfig(&config);
}

// tile J += tile 4 x B, B loaded from `b`: tiles 5 and 6 alternate so that one loads while the other multiplies
// (GCC's tile intrinsics take their tile numbers as literals: one function each)
template <int J> inline void tile_multiply_into(const void *b, int64_t b_stride);
#define GENQ_TILE_MULTIPLY_INTO(J, B)                                                     \
    template <> inline void tile_multiply_into<J>(const void *b, int64_t b_stride) {    \
        _tile_loadd(B, b, b_stride);                                                     \
        _tile_dpbf16ps(J, 4, B);                                                         \
    }
GENQ_TILE_MULTIPLY_INTO(0, 5)
GENQ_TILE_MULTIPLY_INTO(1, 6)
GENQ_TILE_MULTIPLY_INTO(2, 5)
GENQ_TILE_MULTIPLY_INTO(3, 6)
#undef GENQ_TILE_MULTIPLY_INTO

// scores[r][u * 16 + l] = q_r . key l of group u for 16 rows r and J <= 4 groups u (not yet scaled)
// q: 16 rows of D/2 pair words; keys: J groups of [D/2][16] words, D * 16 words apart (a float32 group's room);
// scores: row stride in floats
template <int J, int D>
inline void score_tiles(const uint32_t *q, const uint32_t *keys, float *scores, int64_t stride) {
    _tile_zero(0);
    if constexpr (J > 1) _tile_zero(1);
    if constexpr (J > 2) _tile_zero(2);
    if constexpr (J > 3) _tile_zero(3);
    for (int k = 0; k < D / 32; k++) {  // 32 dimensions (16 pair rows) a step
        _tile_loadd(4, q + 16 * k, D * 2);
        const uint32_t *b = keys + 16 * 16 * k;
        tile_multiply_into<0>(b, 64);
        if constexpr (J > 1) tile_multiply_into<1>(b + D * 16, 64);
        if constexpr (J > 2) tile_multiply_into<2>(b + 2 * D * 16, 64);
        if constexpr (J > 3) tile_multiply_into<3>(b + 3 * D * 16, 64);
    }
    _tile_stored(0, scores, stride * 4);
    if constexpr (J > 1) _tile_stored(1, scores + 16, stride * 4);
    if constexpr (J > 2) _tile_stored(2, scores + 32, stride * 4);
    if constexpr (J > 3) _tile_stored(3, scores + 48, stride * 4);
}

// acc[r][d0 .. d0 + 64) += sum over key pairs P in [from, from + 16 * steps) of p[r][P] . values' pair row P,
// for 16 rows r: p rows p_stride words apart; pair row P at values + P * D words
template <int D>
inline void value_tiles(const uint32_t *p, int64_t p_stride, const uint32_t *values, int64_t from, int64_t steps,
                        float *acc, int d0) {
    float *c = acc + d0;
    _tile_loadd(0, c, D * 4);
    _tile_loadd(1, c + 16, D * 4);
    _tile_loadd(2, c + 32, D * 4);
    _tile_loadd(3, c + 48, D * 4);
    for (int64_t s = 0; s < steps; s++) {
        const int64_t P = from + 16 * s;
        _tile_loadd(4, p + P, p_stride * 4);
        const uint32_t *b = values + P * D + d0;
        tile_multiply_into<0>(b, D * 4);
        tile_multiply_into<1>(b + 16, D * 4);
        tile_multiply_into<2>(b + 32, D * 4);
        tile_multiply_into<3>(b + 48, D * 4);
    }
    _tile_stored(0, c, D * 4);
    _tile_stored(1, c + 16, D * 4);
    _tile_stored(2, c + 32, D * 4);
    _tile_stored(3, c + 48, D * 4);
}
#endif

// scores[i][0..NG * group) = (q_i . keys_t[:, l]) * scale for R rows and NG consecutive groups of keys;
// keys_t: NG groups of [D][group], `group_stride` elements apart
template <int R, int NG, typename A>
inline void score_rows(const A *q, int64_t D, const A *keys_t, int64_t group_stride, A *scores, int64_t stride,
                       A scale) {
    using V = typename Vector<A>::type;
    constexpr int64_t L = Vector<A>::lanes, G = kGroupVectors;
    V acc[R][NG * G];
    for (int i = 0; i < R; i++)
        for (int v = 0; v < NG * G; v++) acc[i][v] = V{};
    for (int64_t d = 0; d < D; d++) {
        V k[NG * G];
        for (int g = 0; g < NG; g++)
            for (int v = 0; v < G; v++) k[g * G + v] = load<V>(keys_t + g * group_stride + (d * G + v) * L);
        for (int i = 0; i < R; i++) {
            const A qd = q[i * D + d];
            for (int v = 0; v < NG * G; v++) acc[i][v] += qd * k[v];
        }
    }
    for (int i = 0; i < R; i++)
        for (int v = 0; v < NG * G; v++) store(scores + i * stride + v * L, acc[i][v] * scale);
}

// acc[i] += sum over keys t in [a, b) of p[i][t] * values[t], for R rows; values indexed by position
// (rows of D). Two vectors of the output at a time, held in registers across the keys.
template <int R, int D, typename A>
inline void value_rows(const A *p, int64_t stride, const A *values, int64_t a, int64_t b, A *acc) {
    using V = typename Vector<A>::type;
    constexpr int64_t L = Vector<A>::lanes;
    for (int64_t d0 = 0; d0 < D; d0 += 2 * L) {
        V o[R][2];
        for (int i = 0; i < R; i++)
            for (int v = 0; v < 2; v++) o[i][v] = load<V>(acc + i * D + d0 + v * L);
        for (int64_t t = a; t < b; t++) {
            const V v0 = load<V>(values + t * D + d0), v1 = load<V>(values + t * D + d0 + L);
            for (int i = 0; i < R; i++) {
                const A weight = p[i * stride + t];
                o[i][0] += weight * v0;
                o[i][1] += weight * v1;
            }
        }
        for (int i = 0; i < R; i++)
            for (int v = 0; v < 2; v++) store(acc + i * D + d0 + v * L, o[i][v]);
    }
}

// A chunk's keys and values for one KV head, laid out for the tiles (built once per call):
//   keys_t : key groups [first_group, ...), each [D][group] (transposed, widened)
//   values : bfloat16 and int8 only, rows from position first_group * group on, widened (int8:
//            scaled); else null (the tiles read float32/float64 values where they lie)
template <typename A> struct PackedHead {
    const A *keys_t;
    const A *values;
    int64_t first_group;
};

// One tile: queries [0, nq) of a chunk at positions first_pos + j, each with the `rep` query heads of
// one KV head (row r = j * rep + h), over the keys [kmin, last position] of that KV head.
template <int FixedD, typename T, typename KV, typename A = typename Compute<T>::type>
void attend_tile(const T *q, int64_t q_sn, int64_t q_sh, const PackedHead<A> &packed, const KV *vh,
                 const int64_t *table, int64_t block_size, int64_t first_pos, int64_t nq, int64_t rep,
                 int64_t head_dim, int64_t window, A scale, A softcap, const A *sinks, T *out, int64_t o_sn,
                 int64_t o_sh, Scratch<A> &w) {
    constexpr int64_t L = Vector<A>::lanes, K = Vector<A>::group;
    const int64_t D = FixedD > 0 ? FixedD : head_dim;
    const int64_t M = nq * rep;
    constexpr bool kPairs = FixedD > 0 && pairs_for<T, KV>();
    const bool amx = kPairs && use_tiles();
    const int64_t Mp = amx ? (M + 15) / 16 * 16 : M;  // rows the tiles compute: 16 at a time, zeros past M
    const int64_t kmin = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
    const int64_t kmax = first_pos + nq;  // one past the last query's position
    const int64_t kbase = kmin / K * K;   // the first group's first key: column 0 of the scores
    const int64_t stride = kmax - kbase + K;  // room for the last group's unused columns
    w.q.resize(M * D);
    w.scores.resize(Mp * stride);
    w.acc.assign(Mp * D, A(0));
    w.denom_inv.resize(M);
    w.lo.resize(M);
    w.hi.resize(M);
    if constexpr (kPairs) {
        w.q_pairs.resize(Mp * D / 2);
        std::fill(w.q_pairs.begin() + M * D / 2, w.q_pairs.end(), 0u);
    }
    for (int64_t j = 0; j < nq; j++)
        for (int64_t h = 0; h < rep; h++) {
            const int64_t r = j * rep + h, pos = first_pos + j;
            const T *row = q + j * q_sn + h * q_sh;
            if constexpr (kPairs)
                for (int64_t d = 0; d < D; d += 2) w.q_pairs[(r * D + d) / 2] = pair(row[d], row[d + 1]);
            else
                for (int64_t d = 0; d < D; d++) w.q[r * D + d] = widen(row[d]);
            w.lo[r] = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
            w.hi[r] = pos + 1;
        }

    // 1. scores, a group of keys at a time (columns outside a row's visible keys are never read)
#if defined(__AMX_BF16__)
    if constexpr (kPairs) if (amx) {
        configure_tiles();
        const int64_t u0 = kbase / K, u1 = (kmax + K - 1) / K;  // the groups [u0, u1)
        for (int64_t r = 0; r < Mp; r += 16)
            for (int64_t u = u0; u < u1; u += 4) {
                const uint32_t *keys = reinterpret_cast<const uint32_t *>(packed.keys_t + (u - packed.first_group) * D * K);
                const uint32_t *qp = w.q_pairs.data() + r * D / 2;
                float *block = w.scores.data() + r * stride + (u * K - kbase);
                switch (std::min<int64_t>(4, u1 - u)) {
                    case 4: score_tiles<4, FixedD>(qp, keys, block, stride); break;
                    case 3: score_tiles<3, FixedD>(qp, keys, block, stride); break;
                    case 2: score_tiles<2, FixedD>(qp, keys, block, stride); break;
                    default: score_tiles<1, FixedD>(qp, keys, block, stride);
                }
            }
    }
#endif
#if defined(__AVX512BF16__)
    if constexpr (kPairs) if (!amx) {
        static_assert(K == 16, "a group is one vector of float32 scores");
        for (int64_t u = kbase / K; u * K < kmax; u++) {
            const uint32_t *keys = reinterpret_cast<const uint32_t *>(packed.keys_t + (u - packed.first_group) * D * K);
            float *column = w.scores.data() + (u * K - kbase);
            const uint32_t *qp = w.q_pairs.data();
            int64_t r = 0;
            for (; r + kPairRows <= M; r += kPairRows)
                score_pairs<kPairRows, FixedD>(qp + r * D / 2, keys, column + r * stride, stride, scale);
            for (; r < M; r++) score_pairs<1, FixedD>(qp + r * D / 2, keys, column + r * stride, stride, scale);
        }
    }
#endif
    if constexpr (!kPairs)
    for (int64_t u = kbase / K; u * K < kmax;) {
        const A *keys_t = packed.keys_t + (u - packed.first_group) * D * K;
        A *column = w.scores.data() + (u * K - kbase);
        const A *q = w.q.data();
        int64_t r = 0;
        if ((u + kBlockGroups - 1) * K < kmax) {  // kBlockGroups groups at once
            for (; r + kBlockRows <= M; r += kBlockRows)
                score_rows<kBlockRows, kBlockGroups>(q + r * D, D, keys_t, D * K, column + r * stride, stride, scale);
            for (; r < M; r++) score_rows<1, kBlockGroups>(q + r * D, D, keys_t, D * K, column + r * stride, stride, scale);
            u += kBlockGroups;
        } else {
            for (; r + kBlockRows <= M; r += kBlockRows)
                score_rows<kBlockRows, 1>(q + r * D, D, keys_t, D * K, column + r * stride, stride, scale);
            for (; r < M; r++) score_rows<1, 1>(q + r * D, D, keys_t, D * K, column + r * stride, stride, scale);
            u++;
        }
    }

    // the pair products' weights: p rounded to bfloat16, two keys to a word (as torch's CPU flash attention rounds p
    // for bfloat16 before its p . v product; the denominator is the unrounded sum, as there); a hidden key weighs 0
    const int64_t p_first = kmin / 2, p_count = (kmax + 1) / 2 - p_first;
    if constexpr (kPairs) {
        w.p_pairs.resize(Mp * p_count);
        std::fill(w.p_pairs.begin() + M * p_count, w.p_pairs.end(), 0u);  // the tiles' rows past M weigh 0
    }
    const bool pairs_done = kPairs && softcap <= 0;  // by step 2's softmax

    // 2. softmax per row over its visible keys; a sink is one more logit that takes mass but has no value
    for (int64_t r = 0; r < M; r++) {
        A *sr = w.scores.data() + r * stride - kbase;  // indexed by position
        const int64_t lo = w.lo[r], hi = w.hi[r];
        const A *sink = sinks ? sinks + r % rep : nullptr;
#if defined(__AVX512BF16__)
        if constexpr (kPairs)
            if (pairs_done) {
                w.denom_inv[r] = 1.0f / softmax_pairs16(sr, lo, hi, amx ? scale : 1.0f, sink,
                                                        w.p_pairs.data() + r * p_count - p_first, p_first,
                                                        p_first + p_count);
                continue;
            }
#endif
#if defined(__AVX512F__)
        if constexpr (std::is_same<A, float>::value && !kPairs)  // (the pair paths took their softmax above)
            if (softcap <= 0) {
                w.denom_inv[r] = 1.0f / softmax_row16(sr, lo, hi, 1.0f, sink);
                if constexpr (std::is_same<T, bf16>::value)  // rounded as the pair product rounds them
                    for (int64_t t = lo; t < hi; t++) sr[t] = widen(narrow<bf16>(sr[t]));
                std::fill(sr + kmin, sr + lo, A(0));  // hidden keys weigh nothing in step 3's row blocks
                std::fill(sr + hi, sr + kmax, A(0));
                continue;
            }
#endif
        if (amx)  // the tiles' scores are not scaled yet
            for (int64_t t = lo; t < hi; t++) sr[t] *= scale;
        if (softcap > 0)
            for (int64_t t = lo; t < hi; t++) sr[t] = std::tanh(sr[t] / softcap) * softcap;
        A m = sink ? *sink : sr[lo];
#pragma omp simd reduction(max : m)
        for (int64_t t = lo; t < hi; t++) m = sr[t] > m ? sr[t] : m;
        A sum = sink ? exp_nonpositive(*sink - m) : A(0);
#pragma omp simd reduction(+ : sum)
        for (int64_t t = lo; t < hi; t++) {
            sr[t] = exp_nonpositive(sr[t] - m);
            sum += sr[t];
        }
        w.denom_inv[r] = A(1) / sum;
        if constexpr (std::is_same<T, bf16>::value && !kPairs)  // rounded as the pair product rounds them
            for (int64_t t = lo; t < hi; t++) sr[t] = widen(narrow<bf16>(sr[t]));
        std::fill(sr + kmin, sr + lo, A(0));  // hidden keys weigh nothing in step 3's row blocks
        std::fill(sr + hi, sr + kmax, A(0));
    }

    // 3. out_r = sum_t p[r][t] v_t / sum
#if defined(__AVX512BF16__)
    if constexpr (kPairs) {
        if (!pairs_done)  // the weights into pair words (soft-capped rows: the plain softmax above)
            for (int64_t r = 0; r < M; r++) {
                const float *sr = w.scores.data() + r * stride - kbase;
                const int64_t lo = w.lo[r], hi = w.hi[r];
                uint32_t *words = w.p_pairs.data() + r * p_count - p_first;
                // 32 keys a step: the visible ones loaded (the rest 0), rounded to nearest even, 16 words stored
                for (int64_t P = p_first; P < p_first + p_count; P += 16) {
                    const int64_t t = 2 * P, count = std::min<int64_t>(16, p_first + p_count - P);
                    const __m512 low = _mm512_maskz_loadu_ps(visible16(t, lo, hi), sr + t);
                    const __m512 high = _mm512_maskz_loadu_ps(visible16(t + 16, lo, hi), sr + t + 16);
                    const __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(high, low);
                    _mm512_mask_storeu_epi32(words + P, static_cast<__mmask16>((1u << count) - 1), packed);
                }
            }
        // pair row P at values + P * D (a group's 8 pair rows fill half its room: see the packing)
        const uint32_t *values = reinterpret_cast<const uint32_t *>(packed.values) - packed.first_group * K / 2 * D;
#if defined(__AMX_BF16__)
        if (amx) {
            for (int64_t r = 0; r < Mp; r += 16) {
                int64_t a = kmax, b = kmin;  // the keys any of these rows sees
                for (int64_t i = r; i < std::min(r + 16, M); i++) a = std::min(a, w.lo[i]), b = std::max(b, w.hi[i]);
                const int64_t from = a / 2, to = (b + 1) / 2, steps = (to - from) / 16;
                const uint32_t *pr = w.p_pairs.data() + r * p_count - p_first;
                float *acc = w.acc.data() + r * D;
                for (int d0 = 0; d0 < FixedD; d0 += 64)
                    value_tiles<FixedD>(pr, p_count, values, from, steps, acc, d0);
                if (from + 16 * steps < to)  // the last pairs, fewer than a tile's 16
                    for (int64_t i = 0; i < std::min<int64_t>(16, M - r); i++)
                        value_pairs<1, FixedD>(pr + i * p_count, p_count, values, K / 2 * D, from + 16 * steps, to,
                                               acc + i * D);
            }
            _tile_release();
        }
#endif
        if (!amx)
        for (int64_t r = 0; r < M; r += kValueRows) {
            const int64_t rows_here = std::min<int64_t>(kValueRows, M - r);
            int64_t a = kmax, b = kmin;  // the keys any of these rows sees
            for (int64_t i = r; i < r + rows_here; i++) a = std::min(a, w.lo[i]), b = std::max(b, w.hi[i]);
            const uint32_t *pr = w.p_pairs.data() + r * p_count - p_first;
            float *acc = w.acc.data() + r * D;
            if (rows_here == kValueRows)
                value_pairs<kValueRows, FixedD>(pr, p_count, values, K / 2 * D, a / 2, (b + 1) / 2, acc);
            else
                for (int64_t i = 0; i < rows_here; i++)
                    value_pairs<1, FixedD>(pr + i * p_count, p_count, values, K / 2 * D, a / 2, (b + 1) / 2, acc + i * D);
        }
    }
#endif
    // a block of the pool (float32, float64) or of the widened rows (bfloat16, int8) at a time
    if constexpr (!kPairs)
    for_each_block(vh, table, kmin, kmax, block_size, D, [&](int64_t t0, int64_t t1, const KV *rows,
                                                             int64_t /* slot */) {
        const A *values;  // the block's rows, indexed by position
        if constexpr (std::is_same<KV, A>::value)
            values = rows - t0 * D;
        else
            values = packed.values - packed.first_group * K * D;
        for (int64_t r = 0; r < M; r += kValueRows) {
            const int64_t rows_here = std::min<int64_t>(kValueRows, M - r);
            // the keys any of these rows sees in this block (the others' weights there are 0)
            int64_t a = t1, b = t0;
            for (int64_t i = r; i < r + rows_here; i++) a = std::min(a, w.lo[i]), b = std::max(b, w.hi[i]);
            a = std::max(a, t0), b = std::min(b, t1);
            if (a >= b) continue;
            const A *pr = w.scores.data() + r * stride - kbase;
            A *acc = w.acc.data() + r * D;
            if constexpr (FixedD > 0 && FixedD % (2 * L) == 0) {
                if (rows_here == kValueRows) {
                    value_rows<kValueRows, FixedD>(pr, stride, values, a, b, acc);
                    continue;
                }
                for (int64_t i = 0; i < rows_here; i++)
                    value_rows<1, FixedD>(pr + i * stride, stride, values, a, b, acc + i * D);
            } else {
                for (int64_t i = 0; i < rows_here; i++)
                    for (int64_t t = a; t < b; t++) {
                        const A p = pr[i * stride + t];
                        const A *vrow = values + t * D;
#pragma omp simd
                        for (int64_t d = 0; d < D; d++) acc[i * D + d] += p * vrow[d];
                    }
            }
        }
    });
    for (int64_t j = 0; j < nq; j++)
        for (int64_t h = 0; h < rep; h++) {
            const int64_t r = j * rep + h;
            for (int64_t d = 0; d < D; d++)
                out[j * o_sn + h * o_sh + d] = narrow<T>(w.acc[r * D + d] * w.denom_inv[r]);
        }
}

template <typename T, typename KV, typename A = typename Compute<T>::type>
void paged_prefill(const T *q, int64_t q_sn, int64_t q_sh, const KV *k_pool, const KV *v_pool,
                   const bf16 *k_scales, const bf16 *v_scales, const int64_t *tables, int64_t width,
                   const int64_t *starts, const int64_t *ctx_lens,
                   T *out, int64_t o_sn, int64_t o_sh, int64_t n, int64_t num_heads, int64_t num_kv_heads,
                   int64_t head_dim, int64_t block_size, int64_t num_blocks, double scale, double softcap,
                   const A *sinks, int64_t window, int num_threads) {
    constexpr int64_t K = Vector<A>::group;
    constexpr bool kWiden = !std::is_same<KV, A>::value;
    constexpr bool kInt8 = std::is_same<KV, int8_t>::value;
    const int64_t D = head_dim, rep = num_heads / num_kv_heads;
    // keys packed as bfloat16 pairs (attend_tile's pair product: FixedD 64 or 128 only)
    const bool pairs = pairs_for<T, KV>() && (head_dim == 64 || head_dim == 128);
    const int64_t head_stride = num_blocks * block_size * head_dim, scale_stride = num_blocks * block_size;
    // each chunk's key groups [first, end) (a window spares the keys no query of the chunk sees),
    // and where its heads' packed keys and widened values start in the call's buffers
    std::vector<int64_t> first(n), groups(n), key_at(n + 1, 0), value_at(n + 1, 0);
    for (int64_t i = 0; i < n; i++) {
        const int64_t q_len = starts[i + 1] - starts[i];
        const int64_t kstart = window > 0 ? std::max<int64_t>(0, ctx_lens[i] - q_len - window + 1) : 0;
        first[i] = kstart / K;
        groups[i] = (ctx_lens[i] + K - 1) / K - first[i];
        key_at[i + 1] = key_at[i] + num_kv_heads * groups[i] * D * K;
        value_at[i + 1] = value_at[i] + (kWiden ? num_kv_heads * groups[i] * K * D : 0);
    }
    // the calling thread's buffers, kept across calls (two engines in two threads each have theirs)
    // (the OpenMP threads see them through pointers: a thread_local named inside the parallel region
    // would be each thread's own)
    static thread_local std::vector<A> keys_buffer, values_buffer;
    if (static_cast<int64_t>(keys_buffer.size()) < key_at[n]) keys_buffer.resize(key_at[n]);
    if (static_cast<int64_t>(values_buffer.size()) < value_at[n]) values_buffer.resize(value_at[n]);
    A *const keys_t = keys_buffer.data(), *const values = values_buffer.data();
    std::vector<int64_t> pack_at(n + 1, 0);  // pack items: (chunk, KV head, group)
    for (int64_t i = 0; i < n; i++) pack_at[i + 1] = pack_at[i] + num_kv_heads * groups[i];

    // queries per tile: kTileRows rows (a bigger tile reads each key for more rows), halved while
    // there are fewer than four tiles per thread
    int64_t tile_queries = std::max<int64_t>(1, kTileRows / rep);
    const auto count_tiles = [&](int64_t size) {
        int64_t count = 0;
        for (int64_t i = 0; i < n; i++) count += (starts[i + 1] - starts[i] + size - 1) / size;
        return count * num_kv_heads;
    };
    while (tile_queries > 1 && count_tiles(tile_queries) < 4 * num_threads) tile_queries /= 2;
    // tiles, the costliest (last in their chunk: the most keys) first, so the threads end together
    struct Tile {
        int64_t chunk, first;
    };
    std::vector<Tile> tiles;
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < starts[i + 1] - starts[i]; j += tile_queries) tiles.push_back({i, j});
    std::stable_sort(tiles.begin(), tiles.end(), [&](const Tile &x, const Tile &y) {
        return ctx_lens[x.chunk] - (starts[x.chunk + 1] - starts[x.chunk]) + x.first >
               ctx_lens[y.chunk] - (starts[y.chunk + 1] - starts[y.chunk]) + y.first;
    });
    const int64_t items = static_cast<int64_t>(tiles.size()) * num_kv_heads;
#pragma omp parallel num_threads(num_threads)
    {
        // pack: each group of keys transposed to [D][group] and widened, once for all its tiles
#pragma omp for schedule(static)
        for (int64_t item = 0; item < pack_at[n]; item++) {
            const int64_t i = std::upper_bound(pack_at.begin(), pack_at.end(), item) - pack_at.begin() - 1;
            const int64_t g = (item - pack_at[i]) / groups[i], u = (item - pack_at[i]) % groups[i];
            const int64_t *table = tables + i * width;
            A *dst = keys_t + key_at[i] + (g * groups[i] + u) * D * K;
            // a group's widened values: K rows of D; as bfloat16 pairs, 8 pair rows of D words, the groups'
            // pair rows back to back (half the room: the tiles read 16 pair rows across two groups)
            A *wide = kWiden ? values + value_at[i] + g * groups[i] * K * D + u * (pairs ? K / 2 : K) * D : nullptr;
            for (int64_t l = 0; l < K; l++) {
                const int64_t pos = (first[i] + u) * K + l;
                if (pos >= ctx_lens[i]) {  // past the context: zeros (pairs: a weight of 0 meets a value of 0)
                    for (int64_t d = 0; d < D; d++) dst[d * K + l] = A(0);
                    if constexpr (kWiden) {
                        if (pairs) {  // this key's half of its pair row
                            uint16_t *halves = reinterpret_cast<uint16_t *>(wide) + l / 2 * D * 2 + (l & 1);
                            for (int64_t d = 0; d < D; d++) halves[2 * d] = 0;
                        } else {
                            for (int64_t d = 0; d < D; d++) wide[l * D + d] = A(0);
                        }
                    }
                    continue;
                }
                const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
                const KV *key = k_pool + g * head_stride + slot * D;
                const A k_scale = kInt8 ? A(widen(k_scales[g * scale_stride + slot])) : A(1);
                const A v_scale = kInt8 ? A(widen(v_scales[g * scale_stride + slot])) : A(1);
                if constexpr (kInt8) {
                    for (int64_t d = 0; d < D; d++) dst[d * K + l] = A(widen(key[d])) * k_scale;
                } else if constexpr (std::is_same<KV, bf16>::value) {
                    if (pairs) {
                        uint32_t *words = reinterpret_cast<uint32_t *>(dst);  // [D/2][K] in the group's room
                        for (int64_t d = 0; d < D; d += 2) words[d / 2 * K + l] = pair(key[d], key[d + 1]);
                    } else {
                        for (int64_t d = 0; d < D; d++) dst[d * K + l] = widen(key[d]);
                    }
                } else {
                    for (int64_t d = 0; d < D; d++) dst[d * K + l] = widen(key[d]);
                }
                if constexpr (kWiden) {
                    const KV *value = v_pool + g * head_stride + slot * D;
                    if constexpr (kInt8) {
                        for (int64_t d = 0; d < D; d++) wide[l * D + d] = A(widen(value[d])) * v_scale;
                    } else if (pairs) {  // pair row l / 2: element d of keys l (low half) and l + 1 (high)
                        uint16_t *halves = reinterpret_cast<uint16_t *>(wide) + l / 2 * D * 2 + (l & 1);
                        for (int64_t d = 0; d < D; d++) halves[2 * d] = reinterpret_cast<const uint16_t &>(value[d]);
                    } else {
                        for (int64_t d = 0; d < D; d++) wide[l * D + d] = widen(value[d]);
                    }
                }
            }
        }
        Scratch<A> w;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            const Tile tile = tiles[item / num_kv_heads];
            const int64_t g = item % num_kv_heads, i = tile.chunk;
            const int64_t q_len = starts[i + 1] - starts[i];
            const int64_t nq = std::min(tile_queries, q_len - tile.first);
            const int64_t row = starts[i] + tile.first;
            const PackedHead<A> packed{keys_t + key_at[i] + g * groups[i] * D * K,
                                       kWiden ? values + value_at[i] + g * groups[i] * K * D : nullptr,
                                       first[i]};
            auto attend = head_dim == 64    ? attend_tile<64, T, KV>
                          : head_dim == 128 ? attend_tile<128, T, KV>
                                            : attend_tile<0, T, KV>;
            attend(q + row * q_sn + g * rep * q_sh, q_sn, q_sh, packed, v_pool + g * head_stride,
                   tables + i * width, block_size, ctx_lens[i] - q_len + tile.first, nq, rep, head_dim,
                   window, A(scale), A(softcap), sinks ? sinks + g * rep : nullptr, out + row * o_sn + g * rep * o_sh,
                   o_sn, o_sh, w);
        }
    }
}

}  // namespace

#define GENQ_EXPORT(NAME, T, KV, A)                                                                  \
    extern "C" void NAME(const T *q, int64_t q_sn, int64_t q_sh, const KV *k_pool,                   \
                         const KV *v_pool, const bf16 *k_scales, const bf16 *v_scales,               \
                         const int64_t *tables, int64_t width, const int64_t *starts,                \
                         const int64_t *ctx_lens, T *out, int64_t o_sn, int64_t o_sh, int64_t n,     \
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,                  \
                         int64_t block_size, int64_t num_blocks, double scale, double softcap,       \
                         const A *sinks, int64_t window, int num_threads) {                          \
        paged_prefill<T, KV>(q, q_sn, q_sh, k_pool, v_pool, k_scales, v_scales, tables, width,     \
                             starts, ctx_lens, out, o_sn, o_sh, n, num_heads, num_kv_heads,          \
                             head_dim, block_size, num_blocks, scale, softcap, sinks, window,        \
                             num_threads);                                                           \
    }

// Whether bfloat16 prefill runs on AMX tiles: `wanted` 0 or 1 sets it, -1 leaves it; returns what runs now
// (0 where the CPU or the build has no AMX, or Linux refused the tiles).
extern "C" int genq_prefill_tiles(int wanted) {
    if (wanted >= 0) tiles_wanted = wanted != 0;
    return use_tiles() ? 1 : 0;
}

GENQ_EXPORT(genq_paged_prefill_f32, float, float, float)
GENQ_EXPORT(genq_paged_prefill_f64, double, double, double)
GENQ_EXPORT(genq_paged_prefill_bf16, bf16, bf16, float)
GENQ_EXPORT(genq_paged_prefill_f32_i8, float, int8_t, float)
GENQ_EXPORT(genq_paged_prefill_f64_i8, double, int8_t, double)
GENQ_EXPORT(genq_paged_prefill_bf16_i8, bf16, int8_t, float)
