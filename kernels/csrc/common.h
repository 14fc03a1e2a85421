/* Shared by ridge's portable CPU kernels. */
#ifndef RIDGE_COMMON_H
#define RIDGE_COMMON_H
#include <stdint.h>

/* Compiled for AVX-512, AVX2 and baseline x86-64; the loader picks one per CPU. A machine
   whose torch is capped below what its CPU has (ATEN_CPU_CAPABILITY=avx2) gets a build capped
   the same way (kernels/native.py): RIDGE_MAX_AVX2 drops the AVX-512 clone, RIDGE_BASELINE
   both. */
#if defined(__x86_64__) && defined(RIDGE_BASELINE)
#define CLONES
#elif defined(__x86_64__) && defined(RIDGE_MAX_AVX2)
#define CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#elif defined(__x86_64__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

/* exp(x) for x <= 0 (softmax, after the max is taken): 2^(x log2 e), split into an integer
   n (into the exponent bits) and f in [-1/2, 1/2] (Cephes' exp2f polynomial, relative error
   about 1e-7). Below 2^-126 it returns about 2^-126: nothing against the block's max of 1. */
static inline float exp_neg(float x) {
    float t = x * 1.4426950408889634f;
    t = t < -126.0f ? -126.0f : t;
    float n = __builtin_floorf(t + 0.5f), f = t - n;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    union { int32_t i; float f; } e = {.i = ((int32_t)n + 127) << 23};
    return p * e.f;
}

#endif
