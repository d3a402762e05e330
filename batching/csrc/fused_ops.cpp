// The element-wise parts of a Llama-shaped decoder layer, one pass each over the step's rows
// (fused_layers.py calls them through ctypes; plain C++, no torch headers, as the attention kernels).
//
// Each reproduces what transformers computes for the same op, rounding where it rounds:
// - RMSNorm (optionally after the residual add): the sum of squares and the scaling in float32 (also for
//   a float64 model: transformers' RMSNorm casts to float32), the result cast back to the model's dtype,
//   then multiplied by the weight in the model's dtype;
// - RoPE: q * cos + rotate_half(q) * sin, each product and the sum rounded to the model's dtype;
// - SiLU(gate) * up: x / (1 + exp(-x)) rounded to the model's dtype, then the product rounded (torch's silu
//   and mul); exp by a polynomial that vectorizes (attention_common.h's), so float32 results lie within a few
//   ulps of torch's (4e-7 relative), float64 within 3e-15; bfloat16's round to torch's.
// Sums run in another order than torch's (vectorized): float32 results may differ in the last bits.

#include <cmath>
#include <cstdint>
#include <cstring>

#include "attention_common.h"  // genq::exp_finite

namespace {

// bfloat16 as its bits: a plain integer type, so that the loops over it vectorize (a struct's loads don't)
using bf16 = uint16_t;

inline float to_float(bf16 x) {
    uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

inline bf16 to_bf16(float f) {  // round to nearest even, as torch's cast; a NaN stays a (quiet) NaN
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t nan = (u >> 16) | 0x40u;
    return static_cast<bf16>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);  // a select, not a branch
}

// T: the storage type; C: what transformers computes an element-wise op of T in (torch's opmath)
template <typename T> struct Num;
template <> struct Num<float> {
    using C = float;
    static float load(float x) { return x; }
    static float store(float x) { return x; }
    static float round(float x) { return x; }
};
template <> struct Num<double> {
    using C = double;
    static double load(double x) { return x; }
    static double store(double x) { return x; }
    static double round(double x) { return x; }
};
template <> struct Num<bf16> {
    using C = float;
    static float load(bf16 x) { return to_float(x); }
    static bf16 store(float x) { return to_bf16(x); }
    static float round(float x) { return to_float(to_bf16(x)); }  // a value as the dtype holds it
};

constexpr int64_t PARALLEL_ELEMENTS = 1 << 16;  // below this a step's op runs on one thread

// rows = tokens x groups; row (t, g) of x starts at x + t * x_stride + g * cols (groups: the heads of a
// per-head norm, else 1). With residual: x + residual is stored to sum (rounded to T) and normalized.
template <typename T>
void rms_norm(const T* x, int64_t x_stride, const T* residual, int64_t r_stride, T* sum, int64_t s_stride,
              const T* weight, T* out, int64_t out_stride, int64_t tokens, int64_t groups, int64_t cols,
              double eps, int threads) {
    using N = Num<T>;
    using C = typename N::C;
    const int64_t rows = tokens * groups;
    const float feps = static_cast<float>(eps);
#pragma omp parallel for num_threads(threads) if (rows * cols >= PARALLEL_ELEMENTS) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t t = r / groups, g = r % groups;
        const T* xr = x + t * x_stride + g * cols;
        T* orow = out + t * out_stride + g * cols;
        if (residual != nullptr) {
            const T* rr = residual + t * r_stride + g * cols;
            T* sr = sum + t * s_stride + g * cols;
            for (int64_t i = 0; i < cols; ++i)
                sr[i] = N::store(static_cast<C>(N::load(xr[i]) + N::load(rr[i])));
            xr = sr;
        }
        float ss = 0.0f;
        for (int64_t i = 0; i < cols; ++i) {
            const float v = static_cast<float>(N::load(xr[i]));
            ss += v * v;
        }
        const float scale = 1.0f / std::sqrt(ss / static_cast<float>(cols) + feps);
        for (int64_t i = 0; i < cols; ++i) {
            const float y = static_cast<float>(N::load(xr[i])) * scale;
            const C yt = N::round(static_cast<C>(y));  // .to(input_dtype)
            orow[i] = N::store(static_cast<C>(N::load(weight[i]) * yt));
        }
    }
}

// In place on `heads` heads of head_dim at the start of each row of x; cos, sin: [rows, head_dim]
template <typename T>
void rope(T* x, int64_t x_stride, int64_t heads, int64_t head_dim, const T* cos, const T* sin,
          int64_t cs_stride, int64_t rows, int threads) {
    using N = Num<T>;
    using C = typename N::C;
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(threads) if (rows * heads * head_dim >= PARALLEL_ELEMENTS) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const T* c = cos + r * cs_stride;
        const T* s = sin + r * cs_stride;
        for (int64_t h = 0; h < heads; ++h) {
            T* v = x + r * x_stride + h * head_dim;
            for (int64_t i = 0; i < half; ++i) {
                const C a = N::load(v[i]), b = N::load(v[i + half]);
                const C a1 = N::round(a * N::load(c[i])), a2 = N::round(-b * N::load(s[i]));
                const C b1 = N::round(b * N::load(c[i + half])), b2 = N::round(a * N::load(s[i + half]));
                v[i] = N::store(a1 + a2);
                v[i + half] = N::store(b1 + b2);
            }
        }
    }
}

// out[r][i] = SiLU(gate_up[r][i]) * gate_up[r][cols + i]: gate and up side by side in each row (the merged
// projection's output); out [rows, cols]
template <typename T>
void silu_mul(const T* gate_up, int64_t gu_stride, T* out, int64_t out_stride, int64_t rows, int64_t cols,
              int threads) {
    using N = Num<T>;
    using C = typename N::C;
#pragma omp parallel for num_threads(threads) if (rows * cols >= PARALLEL_ELEMENTS) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const T* gate = gate_up + r * gu_stride;
        const T* up = gate + cols;
        T* orow = out + r * out_stride;
#pragma omp simd
        for (int64_t i = 0; i < cols; ++i) {
            const C x = N::load(gate[i]);
            // where exp(-x) overflows, torch's x / (1 + inf): zero (with -fno-signed-zeros, of either sign), not a
            // tiny x / (1 + exp(88))
            const C denom = -x > genq::ExpHighest<C>::value ? C(INFINITY) : C(1) + genq::exp_finite(-x);
            const C silu = N::round(x / denom);
            orow[i] = N::store(silu * N::load(up[i]));
        }
    }
}

}  // namespace

#define GENQ_FUSED_OPS(SUFFIX, T)                                                                              \
    extern "C" void genq_rms_norm_##SUFFIX(const void* x, int64_t x_stride, const void* residual,             \
                                           int64_t r_stride, void* sum, int64_t s_stride, const void* weight, \
                                           void* out, int64_t out_stride, int64_t tokens, int64_t groups,     \
                                           int64_t cols, double eps, int threads) {                           \
        rms_norm<T>(static_cast<const T*>(x), x_stride, static_cast<const T*>(residual), r_stride,            \
                    static_cast<T*>(sum), s_stride, static_cast<const T*>(weight), static_cast<T*>(out),      \
                    out_stride, tokens, groups, cols, eps, threads);                                          \
    }                                                                                                          \
    extern "C" void genq_rope_##SUFFIX(void* x, int64_t x_stride, int64_t heads, int64_t head_dim,            \
                                       const void* cos, const void* sin, int64_t cs_stride, int64_t rows,     \
                                       int threads) {                                                          \
        rope<T>(static_cast<T*>(x), x_stride, heads, head_dim, static_cast<const T*>(cos),                    \
                static_cast<const T*>(sin), cs_stride, rows, threads);                                        \
    }                                                                                                          \
    extern "C" void genq_silu_mul_##SUFFIX(const void* gate_up, int64_t gu_stride, void* out, int64_t out_stride, \
                                           int64_t rows, int64_t cols, int threads) {                         \
        silu_mul<T>(static_cast<const T*>(gate_up), gu_stride, static_cast<T*>(out), out_stride, rows, cols,  \
                    threads);                                                                                  \
    }

GENQ_FUSED_OPS(f32, float)
GENQ_FUSED_OPS(f64, double)
GENQ_FUSED_OPS(bf16, bf16)
