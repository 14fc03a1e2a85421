/* The small per-layer ops of a CPU step, one C call each where torch takes several ops and
   temporaries: at batch 1 they are ~0.1 ms of arithmetic behind ~4 ms of dispatch a step
   (docs/benchmarks.md, issue 17). Contracts and torch references: kernels/norm.py,
   rope.py, kv_cache.py, activation.py. fp32 throughout; rows may be strided views (the
   fused qkv output), elements within a row contiguous. */
#include <stdint.h>
#include <string.h>
#include <math.h>

#include "common.h"

#define PAR_MIN (1 << 16)  /* elements below which a thread team costs more than it saves */

/* x (+)= residual, in place; out = x * rsqrt(mean(x^2) + eps) * w. residual may be NULL. */
CLONES int rms_norm(float *x, const float *residual, const float *w, float eps, float *out, int64_t rows,
                    int64_t n, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (rows * n >= PAR_MIN)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * n, *o = out + r * n;
        float ss = 0.0f;
        if (residual) {
            const float *rr = residual + r * n;
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < n; i++) { xr[i] += rr[i]; ss += xr[i] * xr[i]; }
        } else {
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < n; i++) ss += xr[i] * xr[i];
        }
        float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = xr[i] * inv * w[i];
    }
    return 0;
}

/* Rotate-half RoPE in place on heads [T][H][D] (row stride stride_t, head stride stride_h)
   with cos_sin [max_pos][D] = [cos | sin] over D/2 frequencies. */
CLONES int rope(float *x, int64_t T, int64_t H, int64_t stride_t, int64_t stride_h, int64_t D,
                const int64_t *positions, const float *cos_sin, int nthreads) {
    const int64_t half = D / 2;
#pragma omp parallel for num_threads(nthreads) if (T * H * D >= PAR_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_sin + positions[t] * D, *s = c + half;
        for (int64_t h = 0; h < H; h++) {
            float *a = x + t * stride_t + h * stride_h, *b = a + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                float x1 = a[i], x2 = b[i];
                a[i] = x1 * c[i] - x2 * s[i];
                b[i] = x2 * c[i] + x1 * s[i];
            }
        }
    }
    return 0;
}

/* k_cache[slot[t]] = k[t], v_cache[slot[t]] = v[t] for each token whose slot is not -1: rows
   of width Hkv*D, row t of k at k + t * stride_k floats (its heads contiguous). bf16: the
   cache holds bf16 (rounded to nearest even, as torch's cast; caches hold no NaN), else
   fp32. Returns -1, writing nothing, if a slot is past the cache's num_slots. */
static inline void put_row(void *cache, int64_t slot, const float *x, int64_t width, int bf16) {
    if (!bf16) {
        memcpy((float *)cache + slot * width, x, (size_t)width * 4);
        return;
    }
    uint16_t *dst = (uint16_t *)cache + slot * width;
    for (int64_t i = 0; i < width; i++) {
        uint32_t u;
        memcpy(&u, x + i, 4);
        dst[i] = (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
    }
}

CLONES int write_kv(const float *k, const float *v, int64_t T, int64_t stride_k, int64_t stride_v, int64_t width,
                    const int64_t *slots, int64_t num_slots, void *k_cache, void *v_cache, int bf16) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] >= num_slots) return -1;
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        put_row(k_cache, slots[t], k + t * stride_k, width, bf16);
        put_row(v_cache, slots[t], v + t * stride_v, width, bf16);
    }
    return 0;
}

/* out[r] = silu(x[r][:n]) * x[r][n:2n]; silu(a) = a / (1 + e^-a), from e = exp(-|a|) <= 1. */
CLONES int silu_and_mul(const float *x, int64_t rows, int64_t n, float *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (rows * n >= PAR_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *a = x + r * 2 * n, *b = a + n;
        float *o = out + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            float v = a[i], e = exp_neg(v < 0.0f ? v : -v);
            o[i] = (v < 0.0f ? v * e : v) / (1.0f + e) * b[i];
        }
    }
    return 0;
}
