/* Paged attention over a mixed batch on CPU: the fused path the engine takes where the
   torch reference (kernels/attention.py, the oracle in tests) would gather every context
   into fresh tensors and build masks. Reads K/V in place through the block table, one
   (query token, KV head) pair per work item, the query heads of a GQA group together so
   each key is loaded once. Plain C with GCC vector types; target_clones compiles it for
   AVX-512, AVX2 and baseline x86-64 and picks at load time. */
#include <stdint.h>
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

/* One query token x one KV head: the G query heads sharing that KV head, over keys lo..len-1
   of the sequence's blocks (lo > 0: a sliding window; the blocks wholly before lo are never
   read, nor their block-table entries, which may name a freed block). Online softmax a block at
   a time. kc/vc: fp32, bf16 or e4m3 (kind) ([num_blocks][bs][hkv][d]); ks/vs: fp16-bit scales
   [num_blocks][bs][hkv] for e4m3. softcap > 0: scores capped before the softmax. sink: the G
   heads' sink logits (gpt-oss) or NULL: each joins its head's denominator as one more key of
   value 0, after the last block. DC: D / 16, a constant where inlined for the common head sizes. */
static int f16c_ready;  /* set once per call of paged_attention, before the threads start */

static inline __attribute__((always_inline)) void attend(
        const float *q, int G, int DC, int hkv, int g, int bs, const int32_t *blocks, int lo, int len,
        const void *kc, const void *vc, const uint16_t *ks, const uint16_t *vs, int kind, float scale,
        float softcap, const float *sink, float *out) {
    const int D = DC * 16;
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
        const float *kr[BS_MAX], *vr[BS_MAX];
        if (kind == KV_FP8) {
            const uint8_t *k8 = kc, *v8 = vc;
            for (int j = j0; j < n; j++) {
                int64_t r = base + (int64_t)j * hkv;
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
                uint32_t *kw = (uint32_t *)kb[j], *vw = (uint32_t *)vb[j];
                for (int d = 0; d < D; d++) { kw[d] = (uint32_t)k16[r + d] << 16; vw[d] = (uint32_t)v16p[r + d] << 16; }
                kr[j] = kb[j]; vr[j] = vb[j];
            }
        } else {
            for (int j = j0; j < n; j++) {
                int64_t r = base + (int64_t)j * hkv;
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
        float corr = 1.0f;
        if (sink) {  /* the max moves to the sink where it is larger, as the softmax over both */
            float z = sink[h];
            if (z > m[h]) { corr = exp_neg(m[h] - z); l[h] = l[h] * corr + 1.0f; }
            else l[h] += exp_neg(z - m[h]);
        }
        float inv = l[h] > 0.0f ? corr / l[h] : 0.0f;
        for (int c = 0; c < DC; c++) *(v16u *)(out + h * D + c * 16) = acc[h][c] * inv;
    }
}

CLONES static void attend_one(const float *q, int G, int D, int hkv, int g, int bs, const int32_t *blocks,
                              int lo, int len, const void *kc, const void *vc, const uint16_t *ks,
                              const uint16_t *vs, int kind, float scale, float softcap, const float *sink,
                              float *out) {
    if (D == 64) attend(q, G, 4, hkv, g, bs, blocks, lo, len, kc, vc, ks, vs, kind, scale, softcap, sink, out);
    else if (D == 128) attend(q, G, 8, hkv, g, bs, blocks, lo, len, kc, vc, ks, vs, kind, scale, softcap, sink, out);
    else attend(q, G, D / 16, hkv, g, bs, blocks, lo, len, kc, vc, ks, vs, kind, scale, softcap, sink, out);
}

/* q, out: [T][H][D] fp32. Token t of sequence i (query_start_loc[i] <= t < [i+1]) sits at
   position p = seq_lens[i] - qlen + j and sees keys 0 .. p, or with window > 0 the keys
   p - window < key <= p (transformers' sliding window). softcap > 0: each scaled score s becomes
   softcap * tanh(s / softcap) (Gemma 2); 0: none. sinks: [H] fp32 logits, one per query head, in
   each head's softmax denominator (gpt-oss), or NULL. key_end: [T] one past the last key each
   query sees (its position + 1, or past it inside a bidirectional run: Gemma 3's image tokens),
   or NULL for causal; the window still starts at p - window + 1. Sequences whose query is
   longer than max_q are skipped (their rows of out untouched): a long prefill chunk runs
   faster through the reference's blocked SDPA. work: scratch of T * hkv int64.
   Returns 0, or -1 when a shape is past the kernel's fixed limits. */
int paged_attention(const float *q, int64_t T, int H, int hkv, int D, const void *kc, const void *vc,
                    const uint16_t *ks, const uint16_t *vs, int kind, const int32_t *block_table,
                    int64_t bt_stride, const int32_t *seq_lens, const int32_t *qsl, int64_t num_seqs,
                    int bs, float scale, int window, float softcap, const float *sinks, const int32_t *key_end,
                    int max_q, float *out, int64_t *work, int nthreads) {
    int G = H / hkv;
    if (hkv <= 0 || G > MAXG || D > MAXD || D % 16 || bs > BS_MAX || G * hkv != H) return -1;
    if (kind == KV_FP8) f16c_ready = f16c_rows_ok();
    int64_t nw = 0;
    for (int64_t i = 0; i < num_seqs; i++) {
        if (qsl[i + 1] - qsl[i] > max_q) continue;
        for (int64_t t = qsl[i]; t < qsl[i + 1]; t++)
            for (int g = 0; g < hkv; g++) work[nw++] = ((t * hkv + g) << 20) | i;  /* i < 2^20 */
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t w = 0; w < nw; w++) {
        int64_t i = work[w] & ((1 << 20) - 1), tg = work[w] >> 20, t = tg / hkv;
        int g = (int)(tg % hkv), qlen = qsl[i + 1] - qsl[i];
        int pos1 = seq_lens[i] - qlen + (int)(t - qsl[i]) + 1, lo = window > 0 && pos1 > window ? pos1 - window : 0;
        int len = key_end ? key_end[t] : pos1;
        attend_one(q + (t * H + (int64_t)g * G) * D, G, D, hkv, g, bs, block_table + i * bt_stride, lo, len,
                   kc, vc, ks, vs, kind, scale, softcap, sinks ? sinks + (int64_t)g * G : NULL,
                   out + (t * H + (int64_t)g * G) * D);
    }
    return 0;
}
