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
   of width Hkv*D, row t of k at k + t * stride_k floats (its heads contiguous). kind: the
   cache's element type, as in paged_attention.c. Returns -1, writing nothing, if a slot is
   past the cache's num_slots. */
enum { KV_FP32 = 0, KV_FP8 = 1, KV_BF16 = 2 };

/* fp32 -> e4m3fn, round to nearest even, for |v| <= 448 (the caller clamps): the normal range
   rounds the fp32 mantissa to 3 bits (a carry moves into the exponent, as it should); below
   2^-6 the value is a multiple of 2^-9, and 8 * 2^-9 = 2^-6 encodes as 0x08 on its own. */
static inline uint8_t e4m3_of(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    uint32_t sign = (u >> 24) & 0x80, b = u & 0x7fffffffu;
    uint32_t r = b + 0x7ffffu + ((b >> 20) & 1);
    uint32_t normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7);
    float a;
    memcpy(&a, &b, 4);
    uint32_t sub = (uint32_t)(int32_t)nearbyintf(a * 512.0f);  /* both computed: the loop vectorizes */
    return (uint8_t)(sign | (b >= 0x3c800000u ? normal : sub));  /* 2^-6 */
}

/* One (token, head) row of D values into an FP8 cache, as kernels/kv_cache.quantize_kv: the
   scale max(amax / 448, 2^-14) rounded to fp16 and stored, the values divided by that rounded
   scale, clamped to +-448, rounded to e4m3. */
static inline void put_fp8(uint8_t *dst, uint16_t *scale, const float *x, int64_t D) {
    float amax = 0.0f;
#pragma omp simd reduction(max : amax)
    for (int64_t i = 0; i < D; i++) {  /* comparisons, not fmaxf: that is a libm call per value */
        float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    float t = amax / 448.0f;
    _Float16 s = (_Float16)(t < 0x1p-14f ? 0x1p-14f : t);
    memcpy(scale, &s, 2);
    float sf = (float)s;
#pragma omp simd
    for (int64_t i = 0; i < D; i++) {
        float q = x[i] / sf;
        dst[i] = e4m3_of(q < -448.0f ? -448.0f : (q > 448.0f ? 448.0f : q));
    }
}

static inline void put_row(void *cache, uint16_t *scales, int64_t slot, const float *x, int64_t heads, int64_t D,
                           int kind) {
    const int64_t width = heads * D;
    if (kind == KV_FP32) {
        memcpy((float *)cache + slot * width, x, (size_t)width * 4);
    } else if (kind == KV_BF16) {  /* rounded to nearest even, as torch's cast; caches hold no NaN */
        uint16_t *dst = (uint16_t *)cache + slot * width;
        for (int64_t i = 0; i < width; i++) {
            uint32_t u;
            memcpy(&u, x + i, 4);
            dst[i] = (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
        }
    } else {
        for (int64_t h = 0; h < heads; h++)
            put_fp8((uint8_t *)cache + slot * width + h * D, scales + slot * heads + h, x + h * D, D);
    }
}

CLONES int write_kv(const float *k, const float *v, int64_t T, int64_t stride_k, int64_t stride_v, int64_t heads,
                    int64_t D, const int64_t *slots, int64_t num_slots, void *k_cache, void *v_cache,
                    uint16_t *k_scale, uint16_t *v_scale, int kind) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] >= num_slots) return -1;
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        put_row(k_cache, k_scale, slots[t], k + t * stride_k, heads, D, kind);
        put_row(v_cache, v_scale, slots[t], v + t * stride_v, heads, D, kind);
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

/* The memory's read bandwidth as a step's products see it: n bytes (a multiple of 64) read once
   by nthreads OpenMP threads, the team the products use, each word folded into a sum that the
   caller keeps so the reads are not dropped (ridge bench overhead's bound, issue 45). */
CLONES uint64_t read_bytes(const uint8_t *buf, int64_t n, int nthreads) {
    uint64_t total = 0;
    const uint64_t *w = (const uint64_t *)buf;
#pragma omp parallel for reduction(^ : total) schedule(static) num_threads(nthreads)
    for (int64_t i = 0; i < n / 8; i += 8)
        total ^= w[i] ^ w[i + 1] ^ w[i + 2] ^ w[i + 3] ^ w[i + 4] ^ w[i + 5] ^ w[i + 6] ^ w[i + 7];
    return total;
}

/* A mixture of experts' router over h [T][H] (kernels/moe.py, moe_route_ref): logits[e] =
   h . W[e] (+ bias[e]) in fp32; kind 0: softmax over the E logits, then the k largest
   probabilities, renormalized to sum 1 where norm (qwen3_moe, mixtral); kind 1: the k largest
   logits, then a softmax over them (gpt-oss). ids [T][k] int64 in descending order, weights
   [T][k] fp32. Returns the count of rows whose k-th value ties the best one left out (taken
   here: the lower expert), where torch.topk, which transformers runs, breaks the tie its own
   way: the caller then routes the call by torch (moe_route_native); -1 for E past 1024 or k
   past E. */
#define ROUTE_MAX_E 1024
CLONES int moe_route(const float *h, int64_t T, int64_t H, const float *W, const float *bias, int64_t E,
                     int64_t k, int kind, int norm, int64_t *ids, float *weights, int nthreads) {
    if (E > ROUTE_MAX_E || k > E || k < 1) return -1;
    int ties = 0;
#pragma omp parallel for num_threads(nthreads) if (T * E * H >= 4 * PAR_MIN) reduction(+ : ties)
    for (int64_t t = 0; t < T; t++) {
        const float *x = h + t * H;
        float p[ROUTE_MAX_E];
        for (int64_t e = 0; e < E; e++) {
            const float *w = W + e * H;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t j = 0; j < H; j++) s += x[j] * w[j];
            p[e] = bias ? s + bias[e] : s;
        }
        if (kind == 0) {  /* softmax over every expert first */
            float mx = p[0], sum = 0.0f;
            for (int64_t e = 1; e < E; e++) mx = p[e] > mx ? p[e] : mx;
            for (int64_t e = 0; e < E; e++) { p[e] = expf(p[e] - mx); sum += p[e]; }
            for (int64_t e = 0; e < E; e++) p[e] /= sum;
        }
        int64_t *id = ids + t * k;
        float *wt = weights + t * k;
        for (int64_t i = 0; i < k; i++) {  /* k passes: k is small, the taken ones skipped */
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t j = 0; j < i; j++) taken |= id[j] == e;
                if (!taken && (best < 0 || p[e] > p[best])) best = e;
            }
            id[i] = best;
            wt[i] = p[best];
        }
        for (int64_t e = 0; e < E; e++) {  /* a tie across the cut: which expert is in depends on the rule */
            int taken = 0;
            for (int64_t j = 0; j < k; j++) taken |= id[j] == e;
            if (!taken && p[e] == wt[k - 1]) { ties++; break; }
        }
        if (kind == 1) {  /* a softmax over the k logits taken */
            float sum = 0.0f, mx = wt[0];
            for (int64_t i = 0; i < k; i++) { wt[i] = expf(wt[i] - mx); sum += wt[i]; }
            for (int64_t i = 0; i < k; i++) wt[i] /= sum;
        } else if (norm) {
            float sum = 0.0f;
            for (int64_t i = 0; i < k; i++) sum += wt[i];
            for (int64_t i = 0; i < k; i++) wt[i] /= sum;
        }
    }
    return ties;
}

/* out[r] = the index of row r's largest value (x [rows][ld], n columns), as torch.argmax: the
   first of equal maxima, the first NaN where a row has one. Rows share the team; each row runs
   16 lanes a step, each lane keeping its first maximum, the lanes then folded by value and
   index (kernels/sample.py, argmax_ref). */
CLONES int argmax_rows(const float *x, int64_t rows, int64_t n, int64_t ld, int64_t *out, int nthreads) {
    if (n < 1) return -1;
#pragma omp parallel for num_threads(nthreads) if (rows * n >= 4 * PAR_MIN) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *v = x + r * ld;
        float best[16];
        int64_t at[16];
        int nan = 0;
        const int64_t full = n / 16 * 16;
        for (int l = 0; l < 16; l++) { best[l] = -INFINITY; at[l] = -1; }
        for (int64_t j = 0; j < full; j += 16) {
#pragma omp simd reduction(| : nan)
            for (int l = 0; l < 16; l++) {
                const float e = v[j + l];
                const int gt = e > best[l] || at[l] < 0;
                best[l] = gt ? e : best[l];
                at[l] = gt ? j + l : at[l];
                nan |= e != e;
            }
        }
        int64_t idx = -1;
        float m = -INFINITY;
        for (int l = 0; l < 16; l++)  /* the lanes: the largest value, the lowest index among its equals */
            if (at[l] >= 0 && (idx < 0 || best[l] > m || (best[l] == m && at[l] < idx))) { m = best[l]; idx = at[l]; }
        for (int64_t j = full; j < n; j++) {
            nan |= v[j] != v[j];
            if (idx < 0 || v[j] > m) { m = v[j]; idx = j; }
        }
        if (nan)  /* torch's rule: a NaN is the largest, the first one taken */
            for (int64_t j = 0; j < n; j++)
                if (v[j] != v[j]) { idx = j; break; }
        out[r] = idx;
    }
    return 0;
}
