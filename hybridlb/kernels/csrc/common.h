/* What the kernels share: bfloat16 conversions, a vectorizable exp, 16-float vectors and
 * softmax, and abi.h's declarations. Header-only (static inline), included by every unit. */

#ifndef HYBRIDLB_KERNELS_COMMON_H
#define HYBRIDLB_KERNELS_COMMON_H

#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "abi.h"

typedef union {
    float f;
    uint32_t u;
} bits32;

static inline float bf16_to_float(uint16_t h) { return (bits32){.u = (uint32_t)h << 16}.f; }

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits = (bits32){.f = f}.u;
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* quiet NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest, ties to even */
    return (uint16_t)(bits >> 16);
}

/* exp(x) to about 2 ulp, written so that loops calling it vectorize (libm's expf does not). */
static inline float fast_exp(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = floorf(x * 1.44269504f + 0.5f);
    float r = x - n * 0.693145752f - n * 1.42860677e-6f; /* ln 2 split in two for precision */
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (0.166666672f + r * (4.16664891e-2f
                  + r * (8.33336823e-3f + r * (1.38942839e-3f + r * 1.98416017e-4f))))));
    return p * (bits32){.u = (uint32_t)((int32_t)n + 127) << 23}.f;
}

/* x * sigmoid(x) through exp(-|x|), which stays in (0, 1]: the textbook x / (1 + exp(-x))
 * lets the compiler divide by exp(87) in lanes it selects away, and those denormal
 * quotients cost a microcode assist per vector (5x slower on this machine's Xeon). */
static inline float silu(float x) {
    float e = fast_exp(-fabsf(x));
    return x * (x >= 0.0f ? 1.0f : e) / (1.0f + e);
}

/* 16 floats as one vector (GCC vector extensions: AVX-512 where the CPU has it, pairs
 * or quads of narrower registers elsewhere). Loads and stores go through memcpy, so
 * no alignment is assumed. */
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

static inline f32x16 load16_f32(const float *p) {
    f32x16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline f32x16 load16_bf16(const uint16_t *p) {
#ifdef __AVX512F__
    /* One widening load and a shift: GCC splits the generic conversion below into 8-lane
     * halves on some targets (znver4), which costs three times the instructions. */
    __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
    return (f32x16)_mm512_castsi512_ps(bits);
#else
    u16x16 h;
    memcpy(&h, p, sizeof h);
    u32x16 bits = __builtin_convertvector(h, u32x16) << 16;
    f32x16 v;
    memcpy(&v, &bits, sizeof v);
    return v;
#endif
}

static inline void store16_f32(float *p, f32x16 v) { memcpy(p, &v, sizeof v); }

/* float_to_bf16 on 16 lanes, the result widened back to float (torch rounding a float
 * intermediate to bfloat16): round to nearest, ties to even; NaN stays a quiet NaN. */
static inline u32x16 bf16_bits16(f32x16 v) {
    u32x16 bits;
    memcpy(&bits, &v, sizeof bits);
    u32x16 nan = (u32x16)((bits & 0x7fffffffu) > 0x7f800000u);
    u32x16 rounded = bits + 0x7fffu + ((bits >> 16) & 1u);
    return ((rounded & ~nan) | ((bits | 0x00400000u) & nan)) & 0xffff0000u;
}

static inline f32x16 round16_bf16(f32x16 v) {
    u32x16 bits = bf16_bits16(v);
    memcpy(&v, &bits, sizeof v);
    return v;
}

static inline void store16_bf16(uint16_t *p, f32x16 v) {
    u16x16 h = __builtin_convertvector(bf16_bits16(v) >> 16, u16x16);
    memcpy(p, &h, sizeof h);
}

/* x[0..n) = softmax(x[0..n)), in place. Maxima and sums run in 16 lanes, so every loop
 * vectorizes (a single running max or sum would be a serial chain). */
static inline void softmax(float *x, int64_t n) {
    float lanes[16];
    for (int l = 0; l < 16; l++) lanes[l] = -INFINITY;
    int64_t whole = n / 16 * 16;
    for (int64_t i = 0; i < whole; i += 16)
        for (int l = 0; l < 16; l++) lanes[l] = x[i + l] > lanes[l] ? x[i + l] : lanes[l];
    float top = -INFINITY;
    for (int l = 0; l < 16; l++) top = lanes[l] > top ? lanes[l] : top;
    for (int64_t i = whole; i < n; i++) top = x[i] > top ? x[i] : top;
    for (int64_t i = 0; i < n; i++) x[i] = fast_exp(x[i] - top);
    for (int l = 0; l < 16; l++) lanes[l] = 0.0f;
    for (int64_t i = 0; i < whole; i += 16)
        for (int l = 0; l < 16; l++) lanes[l] += x[i + l];
    float total = 0.0f;
    for (int l = 0; l < 16; l++) total += lanes[l];
    for (int64_t i = whole; i < n; i++) total += x[i];
    float inverse = 1.0f / total;
    for (int64_t i = 0; i < n; i++) x[i] *= inverse;
}

/* Sum of 16 partial sums as a tree. */
static inline float sum16(float *lanes) {
    for (int width = 8; width >= 1; width /= 2)
        for (int l = 0; l < width; l++) lanes[l] += lanes[l + width];
    return lanes[0];
}

/* Sum of a vector's 16 lanes, as sum16. */
static inline float hsum16(f32x16 v) {
    float lanes[16];
    memcpy(lanes, &v, sizeof lanes);
    return sum16(lanes);
}

/* The kernels run on torch's OpenMP thread pool (build.py links the same runtime), whose
 * workers are still spinning from the matmul before, so handing them work is cheap. Below
 * these sizes one thread is still faster: (context token, query head) pairs for attention,
 * elements for the row kernels. */
#define PARALLEL_MIN_WORK 2048
#define PARALLEL_MIN_ELEMENTS 16384
/* A matmul stays on one thread only while both its multiply-adds and its weights are few: at a
 * few rows a matmul streams its weights, and two cores stream them faster than one (SmolLM2 at
 * batch 1: its QKV, output and down projections, 0.3-0.9 M weights each, were on one thread). */
#define MATMUL_SERIAL(m, n, k) ((m) * (n) * (k) < 64 * PARALLEL_MIN_ELEMENTS && (n) * (k) < 4 * PARALLEL_MIN_ELEMENTS)

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)

#endif
