/* The FP8 converter's scale search (quant/fp8.py search_scale, "mse": its torch form is the
   oracle), one tile at a time. In torch every try of a scale is a dozen passes over the whole
   weight, each through torch's fp32 -> e4m3 cast (slow on CPU): a 1.24B model's first start
   spent most of its time here. A tile (1 x G, or B x B flattened) of G values stays in
   registers while all of its tries run.

   Per tile: amax / 448 times each clipping in clips[]; then, from each of the `refine` best
   clippings, `iters` least-squares refinements (with the codes q fixed, the scale of least
   error is sum(w t q) / sum(w q^2)), each scale rounded to the stored dtype (bf16 or fp32)
   before it is tried. The error of a try is sum(w (q s - t)^2), summed in fp32 lanes here (torch
   sums in its own order), so a near tie between two scales may be broken the other way, and
   a per-channel fp32 scale, which no bf16 rounding snaps, may differ in its last bits: tests
   hold the error of the choices to the reference's. */
#include <stdint.h>
#include <math.h>

#include "common.h"

#define FP8_MAX 448.0f

static inline float bits_f(uint32_t u) { float f; __builtin_memcpy(&f, &u, 4); return f; }
static inline uint32_t f_bits(float f) { uint32_t u; __builtin_memcpy(&u, &f, 4); return u; }

/* fp32 -> bf16 -> fp32, round to nearest even (finite inputs: scales are positive). */
static inline float round_bf16(float x) {
    uint32_t u = f_bits(x);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return bits_f(u & 0xFFFF0000u);
}

/* v within +-448 -> the nearest e4m3 value, ties to even: 3 mantissa bits, so the step is
   2^(e-3) in the binade [2^e, 2^(e+1)), and 2^-9 (the subnormals' step) below 2^-6. The
   binade's exponent is read off the bits; v times 2^(3-e) is exact, and so is the product
   back, so rintf (ties to even) is the only rounding. */
static inline float round_e4m3(float v) {
    uint32_t be = (f_bits(v) >> 23) & 0xFFu;  /* biased exponent */
    be = be < 121u ? 121u : be;               /* 2^-6 */
    float inv = bits_f((257u - be) << 23), step = bits_f((be - 3u) << 23);
    return rintf(v * inv) * step;
}

/* One try: the codes of t at scale s (into q) and the error, summed in fp32 lanes. */
static inline float try_scale(const float *restrict t, const float *restrict w, int64_t g, float s,
                              float *restrict q) {
    float err = 0.0f;
    if (w) {
#pragma omp simd reduction(+ : err)
        for (int64_t i = 0; i < g; i++) {
            float x = fminf(fmaxf(t[i] / s, -FP8_MAX), FP8_MAX), c = round_e4m3(x), d = c * s - t[i];
            q[i] = c;
            err += d * d * w[i];
        }
    } else {
#pragma omp simd reduction(+ : err)
        for (int64_t i = 0; i < g; i++) {
            float x = fminf(fmaxf(t[i] / s, -FP8_MAX), FP8_MAX), c = round_e4m3(x), d = c * s - t[i];
            q[i] = c;
            err += d * d;
        }
    }
    return err;
}

static inline float stored(float s, int bf16) {
    s = bf16 ? round_bf16(s) : s;
    return s < 1e-12f ? 1e-12f : s;
}

/* tiles [n][g] (w: the same shape, or NULL) -> out[n], each tile's scale as stored (fp32 values,
   bf16-exact when bf16). clips: nclips clippings of amax/448; q scratch is per tile (g <= 16384). */
CLONES int fp8_search_scale(const float *tiles, const float *weights, int64_t n, int64_t g, const float *clips,
                            int nclips, int refine, int iters, int bf16, float *out, int nthreads) {
    if (g > 16384 || nclips > 16 || refine > nclips) return -1;
#pragma omp parallel num_threads(nthreads)
    {
        float q[16384];
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r++) {
            const float *t = tiles + r * g, *w = weights ? weights + r * g : 0;
            float amax = 0.0f;
            for (int64_t i = 0; i < g; i++) amax = fmaxf(amax, fabsf(t[i]));
            amax = (amax < 1e-12f ? 1e-12f : amax) / FP8_MAX;
            float errs[16], scales[16];
            float best = 0.0f, best_err = INFINITY;
            for (int c = 0; c < nclips; c++) {
                scales[c] = stored(amax * clips[c], bf16);
                errs[c] = try_scale(t, w, g, scales[c], q);
                if (errs[c] < best_err) { best_err = errs[c]; best = scales[c]; }
            }
            int used[16] = {0};
            for (int rank = 0; rank < refine; rank++) {
                int pick = -1;  /* the rank-th smallest error, the earlier clipping first on a tie */
                for (int c = 0; c < nclips; c++)
                    if (!used[c] && (pick < 0 || errs[c] < errs[pick])) pick = c;
                used[pick] = 1;
                float s = scales[pick];
                try_scale(t, w, g, s, q);
                for (int it = 0; it < iters; it++) {
                    float num = 0.0f, den = 0.0f;
#pragma omp simd reduction(+ : num, den)
                    for (int64_t i = 0; i < g; i++) {
                        float qw = w ? q[i] * w[i] : q[i];
                        den += qw * q[i];
                        num += qw * t[i];
                    }
                    if (den > 0) s = stored(num / (den < 1e-30f ? 1e-30f : den), bf16);
                    float err = try_scale(t, w, g, s, q);
                    if (err < best_err) { best_err = err; best = s; }
                }
            }
            out[r] = best;
        }
    }
    return 0;
}

/* ---- int8 codes in 1 x gk groups, straight into the e4m3 products' layout --------------------

   A table or head that ridge holds in 8 bits outside e4m3 (quant/embedding.py: llama.cpp's
   Q8_0 grid, whose 8 bits of precision keep the head inside the accuracy budget where e4m3's 3
   mantissa bits do not). Made at every CPU start from the stored wide table, so it is one pass:
   each group's scale is amax / 127 rounded up to bf16 (so no code passes 127), each code
   rint(x / scale) (ties to even), written in the packed [ceil(N/16)][K/2][16][2] layout with the
   scales in their [ceil(N/16)][ceil(K/gk)][16] one. Rows past N (to a whole block) are zero codes
   and zero scales. w: [N][K] fp32 (wbf16 0) or bf16 (wbf16 1), rows ld elements apart. The torch
   form (quant/embedding.py quantize_q8) is the oracle: the same operations, the same bits. */
#define Q8_MAX_GROUP 256

/* gk <= Q8_MAX_GROUP (the caller checks). A group is widened into a buffer, its amax and codes
   computed in vector loops (rintf is one instruction where the clone has SSE4.1), and its codes
   stored a k pair (two bytes) at a time. */
CLONES void q8_pack(const void *w, int wbf16, int64_t N, int64_t K, int64_t ld, int64_t gk, uint8_t *packed,
                    uint16_t *scales, int nthreads) {
    const int64_t nb = (N + 15) / 16, kp = K / 2, groups = (K + gk - 1) / gk;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < nb; b++) {
        float x[Q8_MAX_GROUP];
        int8_t q[Q8_MAX_GROUP];
        uint8_t *pb = packed + b * kp * 32;
        uint16_t *sb = scales + b * groups * 16;
        for (int j = 0; j < 16; j++) {
            const int64_t n = b * 16 + j;
            for (int64_t g = 0; g < groups; g++) {
                const int64_t k0 = g * gk, len = k0 + gk < K ? gk : K - k0;
                float amax = 0.0f;
                if (n < N) {
                    if (wbf16) {
                        const uint16_t *src = (const uint16_t *)w + n * ld + k0;
                        for (int64_t i = 0; i < len; i++) x[i] = bits_f((uint32_t)src[i] << 16);
                    } else {
                        const float *src = (const float *)w + n * ld + k0;
                        for (int64_t i = 0; i < len; i++) x[i] = src[i];
                    }
#pragma omp simd reduction(max : amax)
                    for (int64_t i = 0; i < len; i++) amax = fmaxf(amax, fabsf(x[i]));
                }
                uint32_t u = f_bits(amax / 127.0f);
                u = (u + 0xFFFFu) & 0xFFFF0000u;  /* up to the next bf16: |x| / scale <= 127 */
                const float s = bits_f(u);
                sb[g * 16 + j] = (uint16_t)(u >> 16);
                if (s > 0.0f) {
#pragma omp simd
                    for (int64_t i = 0; i < len; i++) q[i] = (int8_t)fminf(fmaxf(rintf(x[i] / s), -127.0f), 127.0f);
                } else {
                    for (int64_t i = 0; i < len; i++) q[i] = 0;
                }
                for (int64_t i = 0; i < len; i += 2) {  /* k0 is even: a pair is one 16-bit store */
                    uint16_t pair;
                    __builtin_memcpy(&pair, q + i, 2);
                    __builtin_memcpy(pb + ((k0 + i) / 2) * 32 + j * 2, &pair, 2);
                }
            }
        }
    }
}
