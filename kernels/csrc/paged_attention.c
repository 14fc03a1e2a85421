/* Paged attention over a mixed batch on CPU: the fused path the engine takes where the
   torch reference (kernels/attention.py, the oracle in tests) would gather every context
   into fresh tensors and build masks. Reads K/V in place through the block table, one
   (query token, KV head) pair per work item, the query heads of a GQA group together so
   each key is loaded once. Plain C with GCC vector types; target_clones compiles it for
   AVX-512, AVX2 and baseline x86-64 and picks at load time. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "common.h"

#define MAXG 16
#define MAXD 256
#define BS_MAX 64
enum { KV_FP32 = 0, KV_FP8 = 1, KV_BF16 = 2 };  /* the cache's element type */

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
#define LD(p) (*(const v16u *)(p))
#define LD8(p) (*(const v8u *)(p))
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef _Float16 h16x16 __attribute__((vector_size(32)));

/* 16 e4m3 bytes -> 16 floats worth value / 256: two shifts make exact fp16 bits (fp16's range
   holds e4m3's, subnormals included), which the CPU widens (F16C where the clone has it). */
static inline __attribute__((always_inline)) v16 e4m3x16(const uint8_t *p) {
    u8x16 b;
    memcpy(&b, p, 16);
    u16x16 w = __builtin_convertvector(b, u16x16);
    u16x16 bits = ((w & 0x7f) << 7) | ((w & 0x80) << 8);
    h16x16 h;
    memcpy(&h, &bits, sizeof h);
    return __builtin_convertvector(h, v16);
}

static inline __attribute__((always_inline)) float hsum8(v8 b) {
    return ((b[0] + b[4]) + (b[1] + b[5])) + ((b[2] + b[6]) + (b[3] + b[7]));
}

/* The same decode of one row with F16C on 256-bit vectors, where the CPU has it: GCC lowers
   the generic version above to 128-bit conversions. Called, not inlined, from every clone. */
#if defined(__x86_64__) && !defined(RIDGE_BASELINE)
#include <immintrin.h>
__attribute__((target("avx2,f16c"), noinline)) static void e4m3_row_f16c(const uint8_t *p, int D, float s,
                                                                         float *out) {
    const __m256 sv = _mm256_set1_ps(s);
    for (int c = 0; c < D; c += 16) {
        __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(p + c)));
        __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7f)), 7),
                                    _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8));
        _mm256_storeu_ps(out + c, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), sv));
        _mm256_storeu_ps(out + c + 8, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), sv));
    }
}
static int f16c_rows_ok(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}
#else
static void e4m3_row_f16c(const uint8_t *p, int D, float s, float *out) { (void)p; (void)D; (void)s; (void)out; }
static int f16c_rows_ok(void) { return 0; }
#endif

/* Gemma 2's soft-cap of n scaled scores: s = cap * tanh(s / cap), tanh from exp_neg (vectorized;
   absolute error about 1e-7 against tanh, times cap). */
static inline __attribute__((always_inline)) void softcap_scores(float *s, int n, float cap) {
    const float inv = 1.0f / cap;
#pragma omp simd
    for (int j = 0; j < n; j++) {
        float x = s[j] * inv, e = exp_neg(-2.0f * (x < 0 ? -x : x)), t = (1.0f - e) / (1.0f + e);
        s[j] = cap * (x < 0 ? -t : t);
    }
}

/* A head's output scale once its keys are summed (m their max, l the softmax's denominator):
   1 / l, with the sink's logit (gpt-oss) joined to the denominator, the max moved to the sink
   where it is larger, as the softmax over both. */
static inline __attribute__((always_inline)) float out_scale(float m, float l, const float *sink) {
    float corr = 1.0f;
    if (sink) {
        float z = *sink;
        if (z > m) { corr = exp_neg(m - z); l = l * corr + 1.0f; }
        else l += exp_neg(z - m);
    }
    return l > 0.0f ? corr / l : 0.0f;
}

/* One query token x one KV head: the G query heads sharing that KV head, over keys lo..len-1
   of the sequence's blocks (lo > 0: a sliding window; the blocks wholly before lo are never
   read, nor their block-table entries, which may name a freed block). Online softmax a block at
   a time. kc/vc: fp32, bf16 or e4m3 (kind) ([num_blocks][bs][hkv][d]); ks/vs: fp16-bit scales
   [num_blocks][bs][hkv] for e4m3. softcap > 0: scores capped before the softmax. sink: the G
   heads' sink logits (gpt-oss) or NULL: each joins its head's denominator as one more key of
   value 0, after the last block. DC: D / 16, a constant where inlined for the common head sizes. */
static int f16c_ready;  /* set once per call of paged_attention, before the threads start */

/* Key j's K and V rows of the block whose (slot, head) row of key 0 is nb, fetched ahead: the
   block table scatters blocks where no hardware prefetcher follows. */
static inline __attribute__((always_inline)) void fetch_rows(const void *kc, const void *vc, int64_t nb, int j,
                                                             int hkv, int D, int esize) {
    const int64_t off = (nb + (int64_t)j * hkv) * D * esize;
    for (int o = 0; o < D * esize; o += 64) {
        __builtin_prefetch((const char *)kc + off + o, 0, 3);
        __builtin_prefetch((const char *)vc + off + o, 0, 3);
    }
}

static inline __attribute__((always_inline)) void attend(
        const float *q, int G, int DC, int hkv, int g, int bs, const int32_t *blocks, int lo, int len,
        const void *kc, const void *vc, const uint16_t *ks, const uint16_t *vs, int kind, float scale,
        float softcap, const float *sink, float *out, float *ml) {
    const int D = DC * 16, esize = kind == KV_FP8 ? 1 : kind == KV_BF16 ? 2 : 4;
    const int f16c_rows = kind == KV_FP8 && f16c_ready;
    v16 acc[MAXG][MAXD / 16], qv[MAXG][MAXD / 16];
    float m[MAXG], l[MAXG], s[MAXG][BS_MAX];
    float kb[kind ? BS_MAX : 1][kind ? MAXD : 1] __attribute__((aligned(64)));
    float vb[kind ? BS_MAX : 1][kind ? MAXD : 1] __attribute__((aligned(64)));
    for (int h = 0; h < G; h++) {
        m[h] = -INFINITY; l[h] = 0.0f;
        for (int c = 0; c < DC; c++) { acc[h][c] = (v16){0}; qv[h][c] = LD(q + h * D + c * 16) * scale; }
    }
    for (int start = lo / bs * bs; start < len; start += bs) {
        int n = len - start < bs ? len - start : bs, j0 = start < lo ? lo - start : 0;  /* keys j0..n-1 */
        int64_t base = ((int64_t)blocks[start / bs] * bs) * hkv + g;  /* (slot, head) row of key 0 */
        const int nn = start + bs < len ? (len - start - bs < bs ? len - start - bs : bs) : 0;
        const int64_t nb = nn ? ((int64_t)blocks[start / bs + 1] * bs) * hkv + g : 0;
        for (int j = 0; j < j0 && j < nn; j++) fetch_rows(kc, vc, nb, j, hkv, D, esize);
        const float *kr[BS_MAX], *vr[BS_MAX];
        if (kind == KV_FP8) {
            const uint8_t *k8 = kc, *v8 = vc;
            for (int j = j0; j < n; j++) {
                int64_t r = base + (int64_t)j * hkv;
                if (j < nn) fetch_rows(kc, vc, nb, j, hkv, D, esize);
                _Float16 a, b; memcpy(&a, ks + r, 2); memcpy(&b, vs + r, 2);
                float sk = (float)a * 256.0f, sv = (float)b * 256.0f;  /* e4m3x16 gives value / 256 */
                if (f16c_rows) {
                    e4m3_row_f16c(k8 + r * D, D, sk, kb[j]);
                    e4m3_row_f16c(v8 + r * D, D, sv, vb[j]);
                } else {
                    for (int c = 0; c < DC; c++) {
                        *(v16u *)(kb[j] + c * 16) = e4m3x16(k8 + r * D + c * 16) * sk;
                        *(v16u *)(vb[j] + c * 16) = e4m3x16(v8 + r * D + c * 16) * sv;
                    }
                }
                kr[j] = kb[j]; vr[j] = vb[j];
            }
        } else if (kind == KV_BF16) {  /* bf16 is fp32's top half: widen by a shift */
            const uint16_t *k16 = kc, *v16p = vc;
            for (int j = j0; j < n; j++) {
                int64_t r = (base + (int64_t)j * hkv) * D;
                if (j < nn) fetch_rows(kc, vc, nb, j, hkv, D, esize);
                uint32_t *kw = (uint32_t *)kb[j], *vw = (uint32_t *)vb[j];
                for (int d = 0; d < D; d++) { kw[d] = (uint32_t)k16[r + d] << 16; vw[d] = (uint32_t)v16p[r + d] << 16; }
                kr[j] = kb[j]; vr[j] = vb[j];
            }
        } else {
            for (int j = j0; j < n; j++) {
                int64_t r = base + (int64_t)j * hkv;
                if (j < nn) fetch_rows(kc, vc, nb, j, hkv, D, esize);
                kr[j] = (const float *)kc + r * D; vr[j] = (const float *)vc + r * D;
            }
        }
        /* The loops below run on 8-wide vectors: GCC keeps a generic 16-wide one that lives
           across a loop in memory on AVX2 (no 512-bit registers), and passed it through the
           stack and general registers every key (60 % of the kernel's time, perf). */
        for (int h = 0; h < G; h++) {
            float mx = m[h];
            const v8 *qh = (const v8 *)qv[h];
            int j = j0;
            for (; j + 4 <= n; j += 4) {  /* four keys at a time: four independent chains */
                v8 a0 = qh[0] * LD8(kr[j]), a1 = qh[0] * LD8(kr[j + 1]);
                v8 a2 = qh[0] * LD8(kr[j + 2]), a3 = qh[0] * LD8(kr[j + 3]);
                for (int c = 1; c < 2 * DC; c++) {
                    a0 += qh[c] * LD8(kr[j] + c * 8), a1 += qh[c] * LD8(kr[j + 1] + c * 8);
                    a2 += qh[c] * LD8(kr[j + 2] + c * 8), a3 += qh[c] * LD8(kr[j + 3] + c * 8);
                }
                s[h][j] = hsum8(a0), s[h][j + 1] = hsum8(a1), s[h][j + 2] = hsum8(a2), s[h][j + 3] = hsum8(a3);
            }
            for (; j < n; j++) {
                v8 a = qh[0] * LD8(kr[j]);
                for (int c = 1; c < 2 * DC; c++) a += qh[c] * LD8(kr[j] + c * 8);
                s[h][j] = hsum8(a);
            }
            if (softcap > 0.0f) softcap_scores(s[h] + j0, n - j0, softcap);
            for (int j = j0; j < n; j++) mx = s[h][j] > mx ? s[h][j] : mx;
            float corr = exp_neg(m[h] - mx);  /* m = -inf at first: exp_neg clamps to 2^-126 ~ 0 */
            m[h] = mx;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int j = j0; j < n; j++) { s[h][j] = exp_neg(s[h][j] - mx); sum += s[h][j]; }
            l[h] = l[h] * corr + sum;
            v8 *ah = (v8 *)acc[h];
            for (int c0 = 0; c0 < 2 * DC; c0 += 8) {  /* 64 columns at a time: 8 chains in registers */
                const int cn = 2 * DC - c0 < 8 ? 2 * DC - c0 : 8;
                v8 a[8];
                for (int c = 0; c < cn; c++) a[c] = ah[c0 + c] * corr;
                for (int j = j0; j < n; j++) {
                    const float sj = s[h][j], *vj = vr[j] + c0 * 8;
                    for (int c = 0; c < cn; c++) a[c] += sj * LD8(vj + c * 8);
                }
                for (int c = 0; c < cn; c++) ah[c0 + c] = a[c];
            }
        }
    }
    for (int h = 0; h < G; h++) {
        float inv = ml ? 1.0f : out_scale(m[h], l[h], sink ? sink + h : NULL);
        if (ml) ml[2 * h] = m[h], ml[2 * h + 1] = l[h];  /* a part: its sums as they are (merge_parts) */
        for (int c = 0; c < DC; c++) *(v16u *)(out + h * D + c * 16) = acc[h][c] * inv;
    }
}

/* A form's body called with D / 16 a constant for the common head sizes (its loops unroll), at
   run time for any other multiple of 16. */
#define BY_HEAD_SIZE(FN)                                                                              \
    if (D == 64) FN(q, G, 4, hkv, g, bs, blocks, lo, len, kc, vc, ks, vs, kind, scale, softcap, sink, out, ml); \
    else if (D == 128) FN(q, G, 8, hkv, g, bs, blocks, lo, len, kc, vc, ks, vs, kind, scale, softcap, sink, out, ml); \
    else FN(q, G, D / 16, hkv, g, bs, blocks, lo, len, kc, vc, ks, vs, kind, scale, softcap, sink, out, ml)

CLONES static void attend_one(const float *q, int G, int D, int hkv, int g, int bs, const int32_t *blocks,
                              int lo, int len, const void *kc, const void *vc, const uint16_t *ks,
                              const uint16_t *vs, int kind, float scale, float softcap, const float *sink,
                              float *out, float *ml) {
    BY_HEAD_SIZE(attend);
}

/* The same contract on AVX-512, keys in the lanes. A key's row is read once for the G heads:
   each head's product with it is a 16-lane partial (D / 16 FMAs, no horizontal sum), and the
   partials of 16 keys fold into one vector of their 16 scores (reduce16: 45 shuffles and adds,
   where a sum per key and head cost about 15). The scores' softmax then runs 16 keys a vector,
   and the values a head at a time with its D columns in registers. Rows are widened as they
   are read (bf16 by a shift, e4m3 by F16C), values once a block into vb. The generic attend
   above stays the AVX2 and baseline clones' (paged_attention_isa). */
#if defined(__x86_64__) && !defined(RIDGE_BASELINE) && !defined(RIDGE_MAX_AVX2)
#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")))
#define HAVE_ATTEND512 1

/* 16 elements of a K or V row (element offset off) as fp32; e4m3 times its scale sc. */
static inline T512 __attribute__((always_inline)) __m512 row16(const void *c, int kind, int64_t off, float sc) {
    if (kind == KV_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)c + off))), 16));
    if (kind == KV_FP8) {  /* e4m3 -> fp16 bits (value / 256, as e4m3x16), times scale * 256 */
        __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)((const uint8_t *)c + off)));
        __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7f)), 7),
                                    _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8));
        return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(sc));
    }
    return _mm512_loadu_ps((const float *)c + off);
}

/* exp_neg on 16 lanes: the same steps as common.h's, each one rounding as the scalar's does. */
static inline T512 __attribute__((always_inline)) __m512 exp_neg16(__m512 x) {
    __m512 t = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)), _mm512_set1_ps(-126.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_add_ps(t, _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n), p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/* p[0..15]: one 16-lane partial per key -> lane j the sum of p[j]'s lanes. Halves fold into
   halves (256-bit, 128-bit, then pairs and single lanes within 128 bits), which leaves key
   k + 4m in lane 4k + m; one permute puts key j in lane j. */
static inline T512 __attribute__((always_inline)) __m512 reduce16(const __m512 *p) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    __m512 r = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

/* Lanes j16 + i in j0..n-1. */
static inline T512 __attribute__((always_inline)) __mmask16 keys16(int j16, int j0, int n) {
    uint32_t lo = j0 > j16 ? j0 - j16 : 0, hi = n - j16 < 16 ? n - j16 : 16;
    return (__mmask16)(((1u << hi) - 1) & ~((1u << lo) - 1));
}

static inline T512 __attribute__((always_inline)) void attend512(
        const float *q, int G, int DC, int hkv, int g, int bs, const int32_t *blocks, int lo, int len,
        const void *kc, const void *vc, const uint16_t *ks, const uint16_t *vs, int kind, float scale,
        float softcap, const float *sink, float *out, float *ml) {
    const int D = DC * 16, esize = kind == KV_FP8 ? 1 : kind == KV_BF16 ? 2 : 4;
    __m512 qv[MAXG][MAXD / 16], acc[MAXG][MAXD / 16], part[MAXG][16];
    float m[MAXG], l[MAXG], s[MAXG][BS_MAX] __attribute__((aligned(64)));
    float vb[kind ? BS_MAX : 1][kind ? MAXD : 1] __attribute__((aligned(64)));
    for (int h = 0; h < G; h++) {
        m[h] = -INFINITY; l[h] = 0.0f;
        for (int c = 0; c < DC; c++) {
            acc[h][c] = _mm512_setzero_ps();
            qv[h][c] = _mm512_mul_ps(_mm512_loadu_ps(q + h * D + c * 16), _mm512_set1_ps(scale));
        }
    }
    for (int start = lo / bs * bs; start < len; start += bs) {
        int n = len - start < bs ? len - start : bs, j0 = start < lo ? lo - start : 0;  /* keys j0..n-1 */
        int64_t base = ((int64_t)blocks[start / bs] * bs) * hkv + g;  /* (slot, head) row of key 0 */
        /* The next block's rows are scattered: each key's turn below fetches the same key's K and
           V rows of the next block, so that they arrive while this one runs (all at once, the
           fetches wait on each other). */
        const int nn = start + bs < len ? (len - start - bs < bs ? len - start - bs : bs) : 0;
        const int64_t nb = nn ? ((int64_t)blocks[start / bs + 1] * bs) * hkv + g : 0;
        float sk[BS_MAX], sv[BS_MAX];
        for (int j = j0; j < n; j++) {
            sk[j] = sv[j] = 1.0f;
            if (kind == KV_FP8) {
                _Float16 a, b; memcpy(&a, ks + base + (int64_t)j * hkv, 2); memcpy(&b, vs + base + (int64_t)j * hkv, 2);
                sk[j] = (float)a * 256.0f, sv[j] = (float)b * 256.0f;
            }
        }
        for (int j16 = j0 / 16 * 16; j16 < n; j16 += 16) {  /* 16 keys' scores a vector per head */
            for (int j = j16; j < j16 + 16; j++) {
                if (j < nn) fetch_rows(kc, vc, nb, j, hkv, D, esize);
                if (j < j0 || j >= n) {
                    for (int h = 0; h < G; h++) part[h][j - j16] = _mm512_setzero_ps();
                    continue;
                }
                int64_t r = (base + (int64_t)j * hkv) * D;
                __m512 kr[MAXD / 16];
                for (int c = 0; c < DC; c++) kr[c] = row16(kc, kind, r + c * 16, sk[j]);
                for (int h = 0; h < G; h++) {
                    __m512 a0 = _mm512_mul_ps(qv[h][0], kr[0]), a1 = _mm512_setzero_ps();
                    for (int c = 1; c < DC; c++)
                        if (c & 1) a1 = _mm512_fmadd_ps(qv[h][c], kr[c], a1);
                        else a0 = _mm512_fmadd_ps(qv[h][c], kr[c], a0);
                    part[h][j - j16] = _mm512_add_ps(a0, a1);
                }
            }
            for (int h = 0; h < G; h++) _mm512_store_ps(s[h] + j16, reduce16(part[h]));
        }
        if (kind) {  /* the block's values, widened once for the G heads */
            for (int j = j0; j < n; j++) {
                int64_t r = (base + (int64_t)j * hkv) * D;
                for (int c = 0; c < DC; c++) _mm512_store_ps(vb[j] + c * 16, row16(vc, kind, r + c * 16, sv[j]));
            }
        }
        for (int h = 0; h < G; h++) {
            if (softcap > 0.0f) softcap_scores(s[h] + j0, n - j0, softcap);
            __m512 vmx = _mm512_set1_ps(m[h]);
            for (int j16 = j0 / 16 * 16; j16 < n; j16 += 16)
                vmx = _mm512_mask_max_ps(vmx, keys16(j16, j0, n), vmx, _mm512_load_ps(s[h] + j16));
            const float mx = _mm512_reduce_max_ps(vmx);
            float corr = exp_neg(m[h] - mx);  /* m = -inf at first: exp_neg clamps to 2^-126 ~ 0 */
            m[h] = mx;
            __m512 vsum = _mm512_setzero_ps();
            for (int j16 = j0 / 16 * 16; j16 < n; j16 += 16) {  /* the keys outside j0..n-1 stay unread */
                const __mmask16 k = keys16(j16, j0, n);
                const __m512 x = _mm512_sub_ps(_mm512_load_ps(s[h] + j16), _mm512_set1_ps(mx));
                const __m512 e = _mm512_maskz_mov_ps(k, exp_neg16(x));
                _mm512_store_ps(s[h] + j16, e);
                vsum = _mm512_add_ps(vsum, e);
            }
            l[h] = l[h] * corr + _mm512_reduce_add_ps(vsum);
            for (int c0 = 0; c0 < DC; c0 += 8) {  /* 128 columns at a time: 8 chains in registers */
                const int cn = DC - c0 < 8 ? DC - c0 : 8;
                __m512 a[8];
                for (int c = 0; c < cn; c++) a[c] = _mm512_mul_ps(acc[h][c0 + c], _mm512_set1_ps(corr));
                for (int j = j0; j < n; j++) {
                    const __m512 sj = _mm512_set1_ps(s[h][j]);
                    const float *vj = kind ? vb[j] : (const float *)vc + (base + (int64_t)j * hkv) * D;
                    for (int c = 0; c < cn; c++) a[c] = _mm512_fmadd_ps(sj, _mm512_loadu_ps(vj + (c0 + c) * 16), a[c]);
                }
                for (int c = 0; c < cn; c++) acc[h][c0 + c] = a[c];
            }
        }
    }
    for (int h = 0; h < G; h++) {
        float inv = ml ? 1.0f : out_scale(m[h], l[h], sink ? sink + h : NULL);
        if (ml) ml[2 * h] = m[h], ml[2 * h + 1] = l[h];  /* a part: its sums as they are (merge_parts) */
        for (int c = 0; c < DC; c++)
            _mm512_storeu_ps(out + h * D + c * 16, _mm512_mul_ps(acc[h][c], _mm512_set1_ps(inv)));
    }
}

T512 static void attend_one512(const float *q, int G, int D, int hkv, int g, int bs, const int32_t *blocks,
                               int lo, int len, const void *kc, const void *vc, const uint16_t *ks,
                               const uint16_t *vs, int kind, float scale, float softcap, const float *sink,
                               float *out, float *ml) {
    BY_HEAD_SIZE(attend512);
}

static int avx512_ok(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
           && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
#else
#define HAVE_ATTEND512 0
static void attend_one512(const float *q, int G, int D, int hkv, int g, int bs, const int32_t *blocks, int lo,
                          int len, const void *kc, const void *vc, const uint16_t *ks, const uint16_t *vs, int kind,
                          float scale, float softcap, const float *sink, float *out, float *ml) {
    (void)ml; (void)q; (void)G; (void)D; (void)hkv; (void)g; (void)bs; (void)blocks; (void)lo; (void)len;
    (void)kc; (void)vc;
    (void)ks; (void)vs; (void)kind; (void)scale; (void)softcap; (void)sink; (void)out;
}
static int avx512_ok(void) { return 0; }
#endif

/* The widest form this build and CPU run, capped at `cap` (1: the generic clones only; tests
   compare the two): -> the previous cap. Read once per call of paged_attention. */
static int att_cap = 2;
int paged_attention_isa(int cap) {
    int was = att_cap;
    att_cap = cap;
    return was;
}

int paged_attention_wide(void) { return HAVE_ATTEND512 && avx512_ok(); }

/* A query's keys lo..len-1 (t: its row, i: its sequence): its position's, within the window. */
static inline void keys_of(int64_t t, int64_t i, const int32_t *qsl, const int32_t *seq_lens, const int32_t *key_end,
                           int window, int *lo, int *len) {
    const int qlen = qsl[i + 1] - qsl[i], pos1 = seq_lens[i] - qlen + (int)(t - qsl[i]) + 1;
    *lo = window > 0 && pos1 > window ? pos1 - window : 0;
    *len = key_end ? key_end[t] : pos1;
}

/* Keys a work item takes at most: a longer query runs as parts whose ends are multiples of
   SPLIT (a multiple of every block size), so how a query splits depends on its keys alone and
   a row's bits not on its batch (deterministic mode). */
#define SPLIT 512
static inline int num_parts(int lo, int len) {
    return len - lo <= SPLIT ? 1 : (len - 1) / SPLIT - lo / SPLIT + 1;
}

/* n parts of one query x G heads (acc [n][G][D] unnormalized, ml [n][G][2] their max and sum)
   -> out [G][D], as one pass over all the keys would leave it: each part's sums moved to the
   common max, added in order, the sink joined as out_scale joins it. */
static void merge_parts(const float *acc, const float *ml, int n, int G, int D, const float *sink, float *out) {
    for (int h = 0; h < G; h++) {
        float m = -INFINITY, l = 0.0f;
        for (int c = 0; c < n; c++) m = ml[(c * G + h) * 2] > m ? ml[(c * G + h) * 2] : m;
        float *o = out + h * D;
        for (int d = 0; d < D; d++) o[d] = 0.0f;
        for (int c = 0; c < n; c++) {
            const float f = exp_neg(ml[(c * G + h) * 2] - m);
            l += ml[(c * G + h) * 2 + 1] * f;
            const float *a = acc + (c * G + h) * D;
            for (int d = 0; d < D; d++) o[d] += a[d] * f;
        }
        const float inv = out_scale(m, l, sink ? sink + h : NULL);
        for (int d = 0; d < D; d++) o[d] *= inv;
    }
}

/* q, out: [T][H][D] fp32. Token t of sequence i (query_start_loc[i] <= t < [i+1]) sits at
   position p = seq_lens[i] - qlen + j and sees keys 0 .. p, or with window > 0 the keys
   p - window < key <= p (transformers' sliding window). softcap > 0: each scaled score s becomes
   softcap * tanh(s / softcap) (Gemma 2); 0: none. sinks: [H] fp32 logits, one per query head, in
   each head's softmax denominator (gpt-oss), or NULL. key_end: [T] one past the last key each
   query sees (its position + 1, or past it inside a bidirectional run: Gemma 3's image tokens),
   or NULL for causal; the window still starts at p - window + 1. Sequences whose query is
   longer than max_q are skipped (their rows of out untouched): a long prefill chunk runs
   faster through the reference's blocked SDPA. work: scratch of T * hkv int64. A query past
   SPLIT keys runs as parts (num_parts) that the team shares, merged after (merge_parts).
   Returns 0, -1 when a shape is past the kernel's fixed limits, -2 when its scratch could not
   be allocated. */
int paged_attention(const float *q, int64_t T, int H, int hkv, int D, const void *kc, const void *vc,
                    const uint16_t *ks, const uint16_t *vs, int kind, const int32_t *block_table,
                    int64_t bt_stride, const int32_t *seq_lens, const int32_t *qsl, int64_t num_seqs,
                    int bs, float scale, int window, float softcap, const float *sinks, const int32_t *key_end,
                    int max_q, float *out, int64_t *work, int nthreads) {
    int G = H / hkv;
    if (hkv <= 0 || G > MAXG || D > MAXD || D % 16 || bs > BS_MAX || G * hkv != H) return -1;
    if (kind == KV_FP8) f16c_ready = f16c_rows_ok();
    const int wide = att_cap >= 2 && paged_attention_wide();
    int64_t nw = 0, nparts = 0;
    for (int64_t i = 0; i < num_seqs; i++) {
        if (qsl[i + 1] - qsl[i] > max_q) continue;
        for (int64_t t = qsl[i]; t < qsl[i + 1]; t++) {
            int lo, len;
            keys_of(t, i, qsl, seq_lens, key_end, window, &lo, &len);
            const int parts = num_parts(lo, len);
            for (int g = 0; g < hkv; g++) work[nw++] = ((t * hkv + g) << 20) | i;  /* i < 2^20 */
            nparts += parts > 1 ? (int64_t)parts * hkv : 0;
        }
    }
    /* Queries past SPLIT keys run as parts of SPLIT keys each (items: query x head x part), so
       that a few long sequences still share the team; each part's sums (ml, acc) merge after. */
    int64_t *items = NULL, ni = nw;
    float *pacc = NULL, *pml = NULL;
    if (nparts) {
        items = malloc(sizeof(int64_t) * 2 * (size_t)(nw + nparts));
        pacc = malloc(sizeof(float) * (size_t)nparts * G * D);
        pml = malloc(sizeof(float) * (size_t)nparts * G * 2);
        if (!items || !pacc || !pml) { free(items); free(pacc); free(pml); return -2; }
        ni = 0;
        for (int64_t w = 0, p = 0; w < nw; w++) {
            int64_t i = work[w] & ((1 << 20) - 1), t = (work[w] >> 20) / hkv;
            int lo, len;
            keys_of(t, i, qsl, seq_lens, key_end, window, &lo, &len);
            const int parts = num_parts(lo, len);
            for (int c = 0; c < parts; c++) {  /* (work entry, part index p or -1: the whole query) */
                items[2 * ni] = w | ((int64_t)c << 44);
                items[2 * ni + 1] = parts > 1 ? p++ : -1;
                ni++;
            }
        }
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t k = 0; k < ni; k++) {
        const int64_t w = items ? items[2 * k] & ((1LL << 44) - 1) : k, part = items ? items[2 * k + 1] : -1;
        const int c = items ? (int)(items[2 * k] >> 44) : 0;
        int64_t i = work[w] & ((1 << 20) - 1), tg = work[w] >> 20, t = tg / hkv;
        int g = (int)(tg % hkv), lo, len;
        keys_of(t, i, qsl, seq_lens, key_end, window, &lo, &len);
        if (part >= 0) {  /* keys of part c: from the window's start or a multiple of SPLIT, to the next */
            const int a = lo / SPLIT * SPLIT + c * SPLIT;
            lo = a > lo ? a : lo;
            len = a + SPLIT < len ? a + SPLIT : len;
        }
        (wide ? attend_one512 : attend_one)(q + (t * H + (int64_t)g * G) * D, G, D, hkv, g, bs,
                                            block_table + i * bt_stride, lo, len, kc, vc, ks, vs, kind, scale,
                                            softcap, sinks ? sinks + (int64_t)g * G : NULL,
                                            part >= 0 ? pacc + part * G * D : out + (t * H + (int64_t)g * G) * D,
                                            part >= 0 ? pml + part * G * 2 : NULL);
    }
    if (nparts) {  /* each split query's parts, merged in order */
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
        for (int64_t k = 0; k < ni; k++) {
            const int64_t w = items[2 * k] & ((1LL << 44) - 1), part = items[2 * k + 1];
            if (part < 0 || (items[2 * k] >> 44) != 0) continue;  /* the first part of each split query */
            int64_t i = work[w] & ((1 << 20) - 1), tg = work[w] >> 20, t = tg / hkv;
            int g = (int)(tg % hkv), lo, len;
            keys_of(t, i, qsl, seq_lens, key_end, window, &lo, &len);
            merge_parts(pacc + part * G * D, pml + part * G * 2, num_parts(lo, len), G, D,
                        sinks ? sinks + (int64_t)g * G : NULL, out + (t * H + (int64_t)g * G) * D);
        }
        free(items), free(pacc), free(pml);
    }
    return 0;
}
