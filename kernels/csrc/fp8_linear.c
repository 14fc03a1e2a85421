/* y = x . (w * scale)^T with e4m3 weights read as they are stored: one byte a weight, half
   of what a bf16 copy streams, which is what a step of few rows is bound by on CPU.

   Weight layout (packed once at load, quant/linear.py): [N/16][K/2][16][2] bytes, 16
   output columns by pairs of k, the order AVX-512 BF16's dot-product instruction takes.
   An e4m3 byte becomes fp16 bits worth e4m3 / 256 by two shifts (exactly, subnormals
   included; fp16's exponent range holds e4m3's), so `scale` arrives times 256.

   Scales: [N/16][ceil(K/gk)][16], one per output column and group of gk along K (gk even;
   the last group of a row the remainder; gk = K is one scale per column, the layout then [N]),
   stored by block of 16 columns as the weights are, so that a block's scales are one stream
   beside its weights rather than a cache line a group N floats apart. Each group's sum is
   scaled as it closes and added to the column's: the rule of a GPU's grouped FP8 GEMM
   epilogue.

   Two variants, picked by the caller from what the CPU has:
   - AVX-512 BF16: weights widened to bf16 (exact: e4m3 has 3 mantissa bits), activations
     rounded to bf16, fp32 accumulation, as the bf16 paths and a GPU do; the same tiles run a
     bf16 weight laid out alike (bf16_linear: the CPU's bf16 format there, fp32 out);
   - AVX2 + F16C + FMA: weights and activations in fp32.

   The same layout holds int8 codes (i8 set: a table or head as ridge holds it on a CPU where
   the recipe keeps it out of e4m3, quant/embedding.py): a code widens to its own value and its
   scale arrives as it is (not times 256). int8 runs the AVX2 tiles on an AVX-512 machine too. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <unistd.h>
#include <sys/syscall.h>
#include "common.h"
#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>

#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,f16c,fma")))
#define T256 __attribute__((target("avx2,f16c,fma")))
#define INL inline __attribute__((always_inline))
/* Scales are fp32 (times 256) or bf16 (times 256, exact: a power of two), sbf says which. */
#define SAT(s, sbf, off) ((const void *)((const char *)(s) + (off) * ((sbf) ? 2 : 4)))

/* ---- AVX-512 BF16 ------------------------------------------------------------------- */

T512 static INL __m512bh e4m3_bf16x32(const uint8_t *p) {
    __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
    __m512i h = _mm512_or_si512(_mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x7f)), 7),
                                _mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x80)), 8));
    __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    __m512 hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

/* A block of 16 columns' sums: times their scales (s NULL: a bf16 weight, no scales) and
   added to the row's earlier groups, by an explicit multiply-add: a multiply then an add is
   fused by GCC in some tiles and not in others, and a row's bits would then depend on the
   tile its step's row count gave it. */
T512 static INL void close512(float *y, __m512 acc, const void *s, int sbf, int64_t off, int64_t g) {
    if (!s) {
        _mm512_storeu_ps(y, g ? _mm512_add_ps(acc, _mm512_loadu_ps(y)) : acc);
        return;
    }
    const __m512 sv = sbf ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                _mm256_loadu_si256((const __m256i *)((const uint16_t *)s + off))), 16))
                          : _mm512_loadu_ps((const float *)s + off);
    _mm512_storeu_ps(y, g ? _mm512_fmadd_ps(acc, sv, _mm512_loadu_ps(y)) : _mm512_mul_ps(acc, sv));
}

/* AVX-512 VBMI: the same bf16 words by two 128-entry byte-table lookups a 64 bytes (the byte's
   7 magnitude bits index each table; vpermt2b ignores bit 7), the sign or-ed into the high byte
   and the two halves interleaved back into byte order: 3.9 cycles a k pair's 32 bytes where the
   widening above took 8.3 (this Xeon, converting alone). The tables hold exactly what
   e4m3_bf16x32 gives, but for e4m3fn's NaN (0x7f, 0xff): a NaN here, as torch's upcast makes it,
   where the widening's fp16 trick reads 480. */
#define T512V __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,f16c,fma")))
static uint8_t vbmi_tab[4][64];  /* low bytes 0-63, 64-127; high bytes 0-63, 64-127; by magnitude */
static uint8_t vbmi_mix[2][64];  /* the interleave: word i of half h is (low, high) byte 32h + i */
/* The conversion the AVX-512 BF16 products use: 0 the widening above, 1 these tables, 2 shifts
   with these tables for the k pairs a weight's map marks (below); the CPU's best unless a test
   forced a narrower one. */
static int conv_on;

static int conv_cpu(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512bf16")
                   && __builtin_cpu_supports("avx512bw") ? 2 : 0;
}

__attribute__((constructor)) static void vbmi_init(void) {
    for (int v = 0; v < 128; v++) {
        const int e = v >> 3, m = v & 7;
        float f = e ? ldexpf(1.0f + m / 8.0f, e - 7 - 8) : ldexpf(m / 8.0f, -6 - 8);
        uint32_t u;
        memcpy(&u, &f, 4);
        const uint16_t bf = v == 0x7f ? 0x7fc0 : (uint16_t)(u >> 16);  /* 3 mantissa bits: exact */
        vbmi_tab[v >> 6][v & 63] = (uint8_t)bf;
        vbmi_tab[2 + (v >> 6)][v & 63] = (uint8_t)(bf >> 8);
    }
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 32; i++)
            vbmi_mix[h][2 * i] = (uint8_t)(32 * h + i), vbmi_mix[h][2 * i + 1] = (uint8_t)(64 + 32 * h + i);
    __atomic_store_n(&conv_on, conv_cpu(), __ATOMIC_RELAXED);
}

struct vtab { __m512i lo0, lo1, hi0, hi1, mix0, mix1, sign; };

T512V static INL struct vtab vtab_load(void) {
    return (struct vtab){_mm512_loadu_si512(vbmi_tab[0]), _mm512_loadu_si512(vbmi_tab[1]),
                         _mm512_loadu_si512(vbmi_tab[2]), _mm512_loadu_si512(vbmi_tab[3]),
                         _mm512_loadu_si512(vbmi_mix[0]), _mm512_loadu_si512(vbmi_mix[1]),
                         _mm512_set1_epi8((char)0x80)};
}

/* 64 bytes (two k pairs) -> their bf16 words, pair p in *a and p + 1 in *b. */
T512V static INL void vbmi_bf16x64(const struct vtab *t, const uint8_t *q, __m512bh *a, __m512bh *b) {
    const __m512i d = _mm512_loadu_si512(q);
    const __m512i lo = _mm512_permutex2var_epi8(t->lo0, d, t->lo1);
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t->hi0, d, t->hi1), d, t->sign, 0xf8);
    *a = (__m512bh)_mm512_permutex2var_epi8(lo, t->mix0, hi);
    *b = (__m512bh)_mm512_permutex2var_epi8(lo, t->mix1, hi);
}

/* 32 bytes (one k pair): the first half of the above. */
T512V static INL __m512bh vbmi_bf16x32(const struct vtab *t, const uint8_t *q) {
    const __m512i d = _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)q));
    const __m512i lo = _mm512_permutex2var_epi8(t->lo0, d, t->lo1);
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t->hi0, d, t->hi1), d, t->sign, 0xf8);
    return (__m512bh)_mm512_permutex2var_epi8(lo, t->mix0, hi);
}

/* By shifts, without the tables' four permutes a 64 bytes (the bound of a product of few rows:
   converting and multiplying one row from the cache ran 1.2-1.3x the bytes a second): a byte
   sign-extended to 16 bits and shifted left by 4 holds its sign at bit 15, its exponent at bits
   7-10 and its mantissa at 4-6, a bf16's places, and one and keeps those. The word is the
   tables' word times 2^-112 (bf16's exponent field holds e4m3's own: a bias of 7 for bf16's 127,
   less the scale's 8), so the activations come times 2^112 (scale_up) and every product is the
   tables' product, bit for bit. Zeros too; but a subnormal (exponent 0) would be a bf16
   denormal, which the dot product reads as zero, and the NaN code a number: a k pair holding
   either is marked in the weight's map (fp8_special_map, made once at load), and a step whose
   pairs are marked takes the tables and the activations as they are. A weight's map costs a
   bit a 32 bytes; a GGUF's integer codes convert to no subnormal at all. */
#define T512S T512V  /* the shifts need no VBMI themselves, but their marked pairs take its tables */
#define SX_TAKE 0x87f0       /* sign, exponent, mantissa: the bits kept from the shifted byte */
#define SX_SCALE (112 << 7)  /* 2^112 on a bf16's exponent field */

T512S static INL __m512bh sx_bf16x32(const uint8_t *q) {
    const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)q));
    return (__m512bh)_mm512_and_si512(_mm512_slli_epi16(w, 4), _mm512_set1_epi16((short)SX_TAKE));
}

/* The map's bits for k pairs p and p + 1 (one pair: sp1) of a block whose row of the map is m. */
static INL int sp2_sx(const uint8_t *m, int64_t p) {
    uint16_t v;
    memcpy(&v, m + (p >> 3), 2);
    return (v >> (p & 7)) & 3;
}
static INL int sp1_sx(const uint8_t *m, int64_t p) { return (m[p >> 3] >> (p & 7)) & 1; }
T512S static INL void w2_sx(const struct vtab *t, const void *w, int64_t p, __m512bh *a, __m512bh *b) {
    (void)t;
    *a = sx_bf16x32((const uint8_t *)w + p * 32), *b = sx_bf16x32((const uint8_t *)w + p * 32 + 32);
}
T512S static INL __m512bh w1_sx(const struct vtab *t, const void *w, int64_t p) {
    (void)t;
    return sx_bf16x32((const uint8_t *)w + p * 32);
}
/* The tables for a marked step (tab*_W; the other conversions mark nothing, so theirs is never
   taken). */
T512S static INL void tab2_sx(const struct vtab *t, const void *w, int64_t p, __m512bh *a, __m512bh *b) {
    (void)t;
    const struct vtab v = vtab_load();
    vbmi_bf16x64(&v, (const uint8_t *)w + p * 32, a, b);
}
T512S static INL __m512bh tab1_sx(const struct vtab *t, const void *w, int64_t p) {
    (void)t;
    const struct vtab v = vtab_load();
    return vbmi_bf16x32(&v, (const uint8_t *)w + p * 32);
}

/* A map's bytes for each block: a bit a k pair, and a byte to spare for sp2's two-byte read. */
static INL int64_t map_row(int64_t kp) { return kp / 8 + 2; }

/* The shifts' map of a packed e4m3 weight (nblocks blocks of kp k pairs): bit p of block nb's
   row (map_row bytes a block) set where pair p's 32 bytes hold a subnormal or the NaN code.
   Returns how many pairs are marked. */
CLONES int64_t fp8_special_map(const uint8_t *w, int64_t nblocks, int64_t kp, uint8_t *map, int nthreads) {
    const int64_t mb = map_row(kp);
    int64_t count = 0;
#pragma omp parallel for num_threads(nthreads) reduction(+ : count) schedule(static)
    for (int64_t nb = 0; nb < nblocks; nb++) {
        uint8_t *m = map + nb * mb;
        memset(m, 0, (size_t)mb);
        for (int64_t p = 0; p < kp; p++) {
            const uint8_t *q = w + (nb * kp + p) * 32;
            uint8_t bad = 0;
            for (int i = 0; i < 32; i++) {  /* magnitude 1-7 (v - 1 wraps 0 past 7) or 0x7f */
                const uint8_t v = q[i] & 0x7f;
                bad |= (uint8_t)((uint8_t)(v - 1) < 7) | (uint8_t)(v == 0x7f);
            }
            m[p >> 3] |= (uint8_t)(bad << (p & 7));
            count += bad;
        }
    }
    return count;
}

/* x's bf16 words times 2^112 into xs (the shifts' activations, above). A word of exponent 0 is
   a zero to the dot product, so it stays a zero of its sign. Returns 0 where a word cannot be
   scaled (|x| >= 2^16, or not finite): the call then takes the tables. */
static int scale_up(const uint16_t *xb, uint16_t *xs, int64_t n) {
    int ok = 1;
    for (int64_t i = 0; i < n; i++) {
        const int e = (xb[i] >> 7) & 0xff;
        ok &= e + 112 < 255;
        xs[i] = e ? (uint16_t)(xb[i] + SX_SCALE) : (uint16_t)(xb[i] & 0x8000);
    }
    return ok;
}

/* A weight's k pairs p (W1) and p, p + 1 (W2) as bf16 words, four ways: e4m3 bytes by shifts
   (sx, above), by VBMI (vbmi), widened (cvt), bf16 words read as they are (ld). Same
   signatures, so that the tiles below take one as a macro argument; t is read by vbmi only;
   sp*_W reads a step's marks in the map (sx's alone marks any), tab*_W its conversion then. */
T512V static INL void w2_vbmi(const struct vtab *t, const void *w, int64_t p, __m512bh *a, __m512bh *b) {
    vbmi_bf16x64(t, (const uint8_t *)w + p * 32, a, b);
}
T512V static INL __m512bh w1_vbmi(const struct vtab *t, const void *w, int64_t p) {
    return vbmi_bf16x32(t, (const uint8_t *)w + p * 32);
}
T512 static INL void w2_cvt(const struct vtab *t, const void *w, int64_t p, __m512bh *a, __m512bh *b) {
    (void)t;
    *a = e4m3_bf16x32((const uint8_t *)w + p * 32), *b = e4m3_bf16x32((const uint8_t *)w + p * 32 + 32);
}
T512 static INL __m512bh w1_cvt(const struct vtab *t, const void *w, int64_t p) {
    (void)t;
    return e4m3_bf16x32((const uint8_t *)w + p * 32);
}
T512 static INL void w2_ld(const struct vtab *t, const void *w, int64_t p, __m512bh *a, __m512bh *b) {
    (void)t;
    *a = (__m512bh)_mm512_loadu_si512((const uint16_t *)w + p * 32);
    *b = (__m512bh)_mm512_loadu_si512((const uint16_t *)w + p * 32 + 32);
}
T512 static INL __m512bh w1_ld(const struct vtab *t, const void *w, int64_t p) {
    (void)t;
    return (__m512bh)_mm512_loadu_si512((const uint16_t *)w + p * 32);
}
T512 static INL struct vtab vtab_none(void) { return (struct vtab){0}; }
#define NO_TEST(W)                                                                               \
    static INL int sp2_##W(const uint8_t *m, int64_t p) { (void)m, (void)p; return 0; }           \
    static INL int sp1_##W(const uint8_t *m, int64_t p) { (void)m, (void)p; return 0; }
NO_TEST(vbmi) NO_TEST(cvt) NO_TEST(ld)
#define tab2_vbmi w2_vbmi
#define tab1_vbmi w1_vbmi
#define tab2_cvt w2_cvt
#define tab1_cvt w1_cvt
#define tab2_ld w2_ld
#define tab1_ld w1_ld

/* Each weight stream asks for its bytes AHEAD ahead of the step that reads them: the hardware's
   prefetcher alone left one thread at 7.0 GB/s on one row from beyond L2, against 8.2 with this
   (5.6 against 6.1 at 4 rows). PAIR_*: a k pair's bytes in a 16-column block, by conversion
   (bf16 words: two cache lines a step). */
#define AHEAD 512
#define PAIR_vbmi 32
#define PAIR_sx 32
#define PAIR_cvt 32
#define PAIR_ld 64

static INL void ahead(const void *w, int64_t p, int pair) {
    _mm_prefetch((const char *)w + p * pair + AHEAD, _MM_HINT_T0);
    if (pair > 32) _mm_prefetch((const char *)w + p * pair + AHEAD + 64, _MM_HINT_T0);
}

/* MRC rows x NB blocks of 16 columns, two k pairs a step (a VBMI conversion's 64 bytes); each
   sum still takes its k pairs one after another, in order. W: the conversion (w2_* / w1_*),
   TGT its target, TAB its tables. xs: the activations as W's words take them, xr as the tables'
   words do (the same but for sx); m0, m1: the blocks' rows of the map (sx). */
#define TILE512(NAME, TGT, MRC, NB, W, TAB)                                                      \
TGT static void NAME(const uint32_t *xs, const uint32_t *xr, int64_t kp, int64_t gp, const void *w0,   \
                     const void *w1, const uint8_t *m0, const uint8_t *m1, const void *s, int sbf,      \
                     int64_t ldb, float *y, int64_t ldy) {                                        \
  const struct vtab t = TAB();                                                                   \
  for (int64_t p0 = 0, g = 0; p0 < kp; p0 += gp, g++) {                                          \
    const int64_t p1 = p0 + gp < kp ? p0 + gp : kp;                                              \
    __m512 acc[MRC][NB];                                                                         \
    for (int i = 0; i < MRC; i++)                                                                \
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();                            \
    int64_t p = p0;                                                                              \
    for (; p + 1 < p1; p += 2) {                                                                 \
        __m512bh wa[NB], wb[NB];                                                                 \
        const uint32_t *xp = xs;                                                                 \
        if (__builtin_expect(sp2_##W(m0, p) | (NB > 1 ? sp2_##W(m1, p) : 0), 0)) {                 \
            tab2_##W(&t, w0, p, &wa[0], &wb[0]);                                                 \
            if (NB > 1) tab2_##W(&t, w1, p, &wa[NB - 1], &wb[NB - 1]);                           \
            xp = xr;                                                                             \
        } else {                                                                                 \
            w2_##W(&t, w0, p, &wa[0], &wb[0]);                                                   \
            if (NB > 1) w2_##W(&t, w1, p, &wa[NB - 1], &wb[NB - 1]);                             \
        }                                                                                        \
        ahead(w0, p, PAIR_##W);                                                                  \
        if (NB > 1) ahead(w1, p, PAIR_##W);                                                      \
        for (int i = 0; i < MRC; i++) {                                                          \
            __m512bh xa = (__m512bh)_mm512_set1_epi32((int)xp[i * kp + p]);                      \
            __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xp[i * kp + p + 1]);                  \
            for (int j = 0; j < NB; j++)                                                         \
                acc[i][j] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[i][j], wa[j], xa), wb[j], xb); \
        }                                                                                        \
    }                                                                                            \
    if (p < p1) {                                                                                \
        __m512bh wv[NB];                                                                         \
        const uint32_t *xp = xs;                                                                 \
        if (__builtin_expect(sp1_##W(m0, p) | (NB > 1 ? sp1_##W(m1, p) : 0), 0)) {                 \
            wv[0] = tab1_##W(&t, w0, p);                                                         \
            if (NB > 1) wv[NB - 1] = tab1_##W(&t, w1, p);                                        \
            xp = xr;                                                                             \
        } else {                                                                                 \
            wv[0] = w1_##W(&t, w0, p);                                                           \
            if (NB > 1) wv[NB - 1] = w1_##W(&t, w1, p);                                          \
        }                                                                                        \
        for (int i = 0; i < MRC; i++) {                                                          \
            __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp[i * kp + p]);                      \
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[j], xv);     \
        }                                                                                        \
    }                                                                                            \
    for (int j = 0; j < NB; j++)                                                                 \
        for (int i = 0; i < MRC; i++) close512(y + i * ldy + j * 16, acc[i][j], s, sbf, g * 16 + j * ldb, g); \
  }                                                                                              \
}
#define TILES512(M) TILE512(c2_##M, T512, M, 2, cvt, vtab_none) TILE512(b2_##M, T512, M, 2, ld, vtab_none) \
    TILE512(c1_##M, T512, M, 1, cvt, vtab_none) TILE512(b1_##M, T512, M, 1, ld, vtab_none)                 \
    TILE512(v2_##M, T512V, M, 2, vbmi, vtab_load) TILE512(v1_##M, T512V, M, 1, vbmi, vtab_load)         \
    TILE512(s2_##M, T512S, M, 2, sx, vtab_none) TILE512(s1_##M, T512S, M, 1, sx, vtab_none)
TILES512(1) TILES512(2) TILES512(3) TILES512(4) TILES512(5) TILES512(6) TILES512(7) TILES512(8)
typedef void (*tile_fn)(const uint32_t *, const uint32_t *, int64_t, int64_t, const void *, const void *,
                        const uint8_t *, const uint8_t *, const void *, int, int64_t, float *, int64_t);
#define MR512 8
static const tile_fn C2[9] = {0, c2_1, c2_2, c2_3, c2_4, c2_5, c2_6, c2_7, c2_8};
static const tile_fn B2[9] = {0, b2_1, b2_2, b2_3, b2_4, b2_5, b2_6, b2_7, b2_8};
static const tile_fn C1[9] = {0, c1_1, c1_2, c1_3, c1_4, c1_5, c1_6, c1_7, c1_8};
static const tile_fn B1[9] = {0, b1_1, b1_2, b1_3, b1_4, b1_5, b1_6, b1_7, b1_8};
static const tile_fn V2[9] = {0, v2_1, v2_2, v2_3, v2_4, v2_5, v2_6, v2_7, v2_8};
static const tile_fn V1[9] = {0, v1_1, v1_2, v1_3, v1_4, v1_5, v1_6, v1_7, v1_8};
static const tile_fn S2[9] = {0, s2_1, s2_2, s2_3, s2_4, s2_5, s2_6, s2_7, s2_8};
static const tile_fn S1[9] = {0, s1_1, s1_2, s1_3, s1_4, s1_5, s1_6, s1_7, s1_8};

/* One row through NB blocks of 16 columns (blk bytes apart, their scales sb apart): the
   tiles' arithmetic (one sum a column, k in order, the same close), so a row's bits are the tiles'
   at any step size. Each block is its own chain of dot products, so NB of them keep that many
   in flight: one chain waits on the instruction's latency, not on the conversion or the memory. */
#define ROW512(NAME, TGT, NB, W, TAB)                                                             \
TGT static void NAME(const uint32_t *xs, const uint32_t *xr, int64_t kp, int64_t gp, const void *w, int64_t blk, \
                     const uint8_t *m, const void *s, int sbf, int64_t sb, float *y) {           \
  const struct vtab t = TAB();                                                                   \
  for (int64_t p0 = 0, g = 0; p0 < kp; p0 += gp, g++) {                                          \
    const int64_t p1 = p0 + gp < kp ? p0 + gp : kp;                                              \
    __m512 acc[NB];                                                                              \
    for (int j = 0; j < NB; j++) acc[j] = _mm512_setzero_ps();                                   \
    int64_t p = p0;                                                                              \
    for (; p + 1 < p1; p += 2) {                                                                 \
        int tab = 0;                                                                             \
        for (int j = 0; j < NB; j++) tab |= sp2_##W(m + j * map_row(kp), p);              \
        const uint32_t *xp = tab ? xr : xs;                                                      \
        const __m512bh xa = (__m512bh)_mm512_set1_epi32((int)xp[p]);                             \
        const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xp[p + 1]);                         \
        for (int j = 0; j < NB; j++) {                                                           \
            __m512bh a, b;                                                                       \
            if (__builtin_expect(tab, 0)) tab2_##W(&t, (const char *)w + j * blk, p, &a, &b);    \
            else w2_##W(&t, (const char *)w + j * blk, p, &a, &b);                               \
            ahead((const char *)w + j * blk, p, PAIR_##W);                                       \
            acc[j] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[j], a, xa), b, xb);                   \
        }                                                                                        \
    }                                                                                            \
    if (p < p1) {                                                                                \
        int tab = 0;                                                                             \
        for (int j = 0; j < NB; j++) tab |= sp1_##W(m + j * map_row(kp), p);              \
        const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)(tab ? xr : xs)[p]);                \
        for (int j = 0; j < NB; j++)                                                             \
            acc[j] = _mm512_dpbf16_ps(acc[j], tab ? tab1_##W(&t, (const char *)w + j * blk, p)   \
                                                  : w1_##W(&t, (const char *)w + j * blk, p), xv); \
    }                                                                                            \
    for (int j = 0; j < NB; j++)                                                                 \
        close512(y + j * 16, acc[j], s ? SAT(s, sbf, j * sb) : NULL, sbf, g * 16, g);            \
  }                                                                                              \
}
#define ROWS512(X, TGT, W, TAB) ROW512(row1_##X, TGT, 1, W, TAB) ROW512(row2_##X, TGT, 2, W, TAB) \
    ROW512(row4_##X, TGT, 4, W, TAB)
ROWS512(c, T512, cvt, vtab_none) ROWS512(b, T512, ld, vtab_none) ROWS512(v, T512V, vbmi, vtab_load)
ROWS512(s, T512S, sx, vtab_none)
typedef void (*row_fn)(const uint32_t *, const uint32_t *, int64_t, int64_t, const void *, int64_t, const uint8_t *,
                       const void *, int, int64_t, float *);
static const row_fn ROWC[3] = {row1_c, row2_c, row4_c}, ROWB[3] = {row1_b, row2_b, row4_b},
                    ROWV[3] = {row1_v, row2_v, row4_v}, ROWS[3] = {row1_s, row2_s, row4_s};

/* A 16-column block's kp k pairs of e4m3 bytes as bf16 words into buf (the wide steps' panel). */
T512 static void widen_c512(const uint8_t *w, int64_t kp, uint16_t *buf) {
    for (int64_t p = 0; p < kp; p++) _mm512_storeu_si512(buf + p * 32, (__m512i)e4m3_bf16x32(w + p * 32));
}
T512V static void widen_v512(const uint8_t *w, int64_t kp, uint16_t *buf) {
    const struct vtab t = vtab_load();
    int64_t p = 0;
    for (; p + 1 < kp; p += 2) {
        __m512bh a, b;
        vbmi_bf16x64(&t, w + p * 32, &a, &b);
        _mm512_storeu_si512(buf + p * 32, (__m512i)a);
        _mm512_storeu_si512(buf + p * 32 + 32, (__m512i)b);
    }
    if (p < kp) _mm512_storeu_si512(buf + p * 32, (__m512i)vbmi_bf16x32(&t, w + p * 32));
}

/* Tests run the narrower conversions on a machine that has the wider: c (0 widening, 1 tables,
   2 shifts) forces the narrower of c and the CPU's best, c < 0 restores the CPU's choice.
   Returns the conversion in use after the call. */
int fp8_linear_force_conversion(int c) {
    const int cpu = conv_cpu();
    __atomic_store_n(&conv_on, c < 0 || c > cpu ? cpu : c, __ATOMIC_RELAXED);
    return __atomic_load_n(&conv_on, __ATOMIC_RELAXED);
}

/* 1 where this CPU converts by shifts (and so reads a weight's fp8_special_map), whatever a test
   forced: elsewhere a map is not worth its pass over the weights at load. */
int fp8_linear_shifts(void) { return conv_cpu() == 2; }

T512 static void to_bf16(const float *x, uint16_t *xb, int64_t n) {
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        _mm512_storeu_si512(xb + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i)));
    for (; i < n; i++) {  /* round to nearest even, as the instruction does */
        uint32_t u;
        memcpy(&u, x + i, 4);
        xb[i] = (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
    }
}

/* Up to MR512 rows convert the weights as they stream; more rows convert each 32-column
   panel once into a per-thread bf16 buffer and run every row tile over it. bf16: w holds bf16
   words in the same layout (pack_bf16's), read as they are, and scale is NULL. One row runs
   ROW512, the tiles' arithmetic, so that its sums are added in the same order whatever the
   step's rows (the deterministic mode's batch invariance). */
T512 static void linear_512(const float *x, int64_t M, int64_t K, const void *w, int bf16, const void *scale,
                            int sbf, int64_t N, int64_t gk, float *y, const uint8_t *map, int nthreads) {
    const int64_t kp = K / 2, gp = gk / 2, blk = kp * 32, nblocks = N / 16, sb = (K + gk - 1) / gk * 16;
    const int64_t wsize = bf16 ? 2 : 1;
    uint16_t *xb = malloc((size_t)(M * K) * 2 * 2), *xsb = xb + M * K;
    to_bf16(x, xb, M * K);
    int conv = bf16 ? -1 : __atomic_load_n(&conv_on, __ATOMIC_RELAXED);
    /* the shifts need the weight's map; more than MR512 rows read a panel the tables widened,
       with the activations as they are */
    if (conv == 2 && (!map || M > MR512 || !scale_up(xb, xsb, M * K))) conv = 1;
    const int64_t mb = conv == 2 ? map_row(kp) : 0;
    const uint32_t *xr = (const uint32_t *)xb, *xs = conv == 2 ? (const uint32_t *)xsb : xr;
    if (M == 1) {  /* each thread a contiguous share of the blocks, 4 at a time, then 2, then 1 */
        const row_fn *row = bf16 ? ROWB : conv == 2 ? ROWS : conv == 1 ? ROWV : ROWC;
#pragma omp parallel num_threads(nthreads)
        {
            const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
            const int64_t b1 = nblocks * (id + 1) / nt;
            for (int64_t nb = nblocks * id / nt; nb < b1;) {
                const int r = b1 - nb >= 4 ? 2 : b1 - nb >= 2 ? 1 : 0;
                row[r](xs, xr, kp, gp, (const uint8_t *)w + nb * blk * wsize, blk * wsize, mb ? map + nb * mb : NULL,
                       scale ? SAT(scale, sbf, nb * sb) : NULL, sbf, sb, y + nb * 16);
                nb += 1 << r;
            }
        }
        free(xb);
        return;
    }
#pragma omp parallel num_threads(nthreads)
    {
        uint16_t *buf = M > MR512 && !bf16 ? malloc((size_t)blk * 2 * 2) : NULL;
#pragma omp for schedule(static)
        for (int64_t pn = 0; pn < (nblocks + 1) / 2; pn++) {
            int64_t nb = pn * 2;
            int two = nb + 1 < nblocks;
            const uint8_t *w0 = (const uint8_t *)w + nb * blk * wsize, *w1 = w0 + blk * wsize;
            const void *a = w0, *b = w1;
            if (buf) {
                (conv >= 1 ? widen_v512 : widen_c512)(w0, kp, buf);
                if (two) (conv >= 1 ? widen_v512 : widen_c512)(w1, kp, buf + blk);
                a = buf;
                b = buf + blk;
            }
            const tile_fn *t = buf || bf16 ? (two ? B2 : B1) : conv == 2 ? (two ? S2 : S1)
                                                           : conv == 1 ? (two ? V2 : V1) : (two ? C2 : C1);
            for (int64_t m0 = 0; m0 < M; m0 += MR512) {
                int mr = M - m0 < MR512 ? (int)(M - m0) : MR512;
                t[mr](xs + m0 * kp, xr + m0 * kp, kp, gp, a, b, mb ? map + nb * mb : NULL, mb ? map + (nb + 1) * mb : NULL,
                      scale ? SAT(scale, sbf, nb * sb) : NULL, sbf, sb, y + m0 * N + nb * 16, N);
            }
        }
        free(buf);
    }
    free(xb);
}

/* ---- AVX2 + F16C + FMA ---------------------------------------------------------------- */

/* 32 bytes (16 columns x a k pair) -> four fp32 vectors, each 4 columns x (k, k+1), in column
   order. Interleaving each byte above a zero byte makes b << 8 (s eeee mmm then zeros); an
   arithmetic shift by one and clearing bit 14 leave s 0eeee mmm0000000, the fp16 of e4m3 / 256.
   Ten ops where widening each byte and masking its two parts took sixteen. */
T256 static INL void e4m3_f32x32(const uint8_t *p, __m256 *v) {
    const __m256i b = _mm256_loadu_si256((const __m256i *)p), z = _mm256_setzero_si256();
    const __m256i keep = _mm256_set1_epi16((short)0xbfff);
    __m256i lo = _mm256_and_si256(_mm256_srai_epi16(_mm256_unpacklo_epi8(z, b), 1), keep);  /* bytes 0-7, 16-23 */
    __m256i hi = _mm256_and_si256(_mm256_srai_epi16(_mm256_unpackhi_epi8(z, b), 1), keep);  /* bytes 8-15, 24-31 */
    v[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(lo));
    v[1] = _mm256_cvtph_ps(_mm256_castsi256_si128(hi));
    v[2] = _mm256_cvtph_ps(_mm256_extracti128_si256(lo, 1));
    v[3] = _mm256_cvtph_ps(_mm256_extracti128_si256(hi, 1));
}

/* The same 32 bytes as int8 codes, in the same order: v[c] is bytes 8c .. 8c + 7. */
T256 static INL void i8_f32x32(const uint8_t *p, __m256 *v) {
    for (int c = 0; c < 4; c++)
        v[c] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * c))));
}

T256 static INL void w8_f32x32(const uint8_t *p, __m256 *v, int i8) {
    if (i8) i8_f32x32(p, v);
    else e4m3_f32x32(p, v);
}

/* A 16-column block's 16 scales as four vectors in the accumulators' (column, k parity)
   order: each scale twice. */
T256 static INL __m256 bf16x8(const uint16_t *s) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)s)), 16));
}

T256 static INL void scale_pairs(const void *s, int sbf, __m256 *sd) {
    const __m256i a = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), b = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
    const __m256 lo = sbf ? bf16x8(s) : _mm256_loadu_ps(s), hi = sbf ? bf16x8((const uint16_t *)s + 8)
                                                                       : _mm256_loadu_ps((const float *)s + 8);
    sd[0] = _mm256_permutevar8x32_ps(lo, a), sd[1] = _mm256_permutevar8x32_ps(lo, b);
    sd[2] = _mm256_permutevar8x32_ps(hi, a), sd[3] = _mm256_permutevar8x32_ps(hi, b);
}

/* tot holds (column, k parity) pairs for 4 + 4 columns: add each pair, in column order. */
T256 static INL void store8(float *y, __m256 a, __m256 b) {
    _mm256_storeu_ps(y, (__m256)_mm256_permute4x64_pd((__m256d)_mm256_hadd_ps(a, b), 0xd8));
}

/* MRC rows x 16 columns. CONV: bytes converted as they are read (1 e4m3, 2 int8); else fp32
   already converted, 4 vectors a k pair. A group's sums are scaled as it closes and added to the
   row's totals while still in (column, k parity) pairs, and the pairs are added once at the
   end: a group's close is a multiply-add a vector, not a reduction and a store. Every tile
   does the same operations in the same order for a row, whatever MRC, so a row's bits do not
   depend on how many rows share its step (the deterministic mode relies on it). The bytes are
   asked for AHEAD ahead, as on AVX-512 (one row, one thread, from beyond L2: 4.8 -> 5.9 GB/s). */
#define TILE256(NAME, MRC, CONV)                                                                 \
T256 static void NAME(const float *x, int64_t K, int64_t gp, const void *w, const void *s, int sbf,     \
                      int64_t lds, float *y, int64_t ldy) {                                      \
  __m256 tot[MRC][4];                                                                            \
  for (int64_t p0 = 0, g = 0; p0 < K / 2; p0 += gp, g++) {                                       \
    const int64_t p1 = p0 + gp < K / 2 ? p0 + gp : K / 2;                                        \
    __m256 acc[MRC][4];                                                                          \
    for (int i = 0; i < MRC; i++)                                                                \
        for (int c = 0; c < 4; c++) acc[i][c] = _mm256_setzero_ps();                             \
    for (int64_t p = p0; p < p1; p++) {                                                          \
        __m256 wv[4];                                                                            \
        if (CONV) {                                                                              \
            w8_f32x32((const uint8_t *)w + p * 32, wv, CONV == 2);                               \
            ahead(w, p, 32);                                                                     \
        } else {                                                                                 \
            for (int c = 0; c < 4; c++) wv[c] = _mm256_loadu_ps((const float *)w + p * 32 + c * 8); \
        }                                                                                        \
        for (int i = 0; i < MRC; i++) {                                                          \
            __m256 xv = (__m256)_mm256_broadcast_sd((const double *)(x + i * K + 2 * p));        \
            for (int c = 0; c < 4; c++) acc[i][c] = _mm256_fmadd_ps(wv[c], xv, acc[i][c]);       \
        }                                                                                        \
    }                                                                                            \
    __m256 sd[4];                                                                                \
    scale_pairs(SAT(s, sbf, g * lds), sbf, sd);                                                  \
    for (int i = 0; i < MRC; i++)                                                                \
        for (int c = 0; c < 4; c++)                                                              \
            tot[i][c] = g ? _mm256_fmadd_ps(acc[i][c], sd[c], tot[i][c]) : _mm256_mul_ps(acc[i][c], sd[c]); \
  }                                                                                              \
  for (int i = 0; i < MRC; i++) {                                                                \
      store8(y + i * ldy, tot[i][0], tot[i][1]);                                                 \
      store8(y + i * ldy + 8, tot[i][2], tot[i][3]);                                             \
  }                                                                                              \
}
TILE256(v1, 1, 1) TILE256(v2, 2, 1) TILE256(q1, 1, 2) TILE256(q2, 2, 2) TILE256(f1, 1, 0) TILE256(f2, 2, 0) TILE256(f3, 3, 0)
typedef void (*tile256_fn)(const float *, int64_t, int64_t, const void *, const void *, int, int64_t, float *,
                           int64_t);
static const tile256_fn F256[4] = {0, f1, f2, f3};

/* Up to 2 rows convert as they stream; more convert each 16-column block once into a
   per-thread fp32 buffer and run 3-row tiles over it. */
T256 static void linear_256(const float *x, int64_t M, int64_t K, const uint8_t *w, const void *scale, int sbf,
                            int64_t N, int64_t gk, float *y, int i8, int nthreads) {
    const int64_t blk = K * 16, nblocks = N / 16, gp = gk / 2, sb = (K + gk - 1) / gk * 16;
#pragma omp parallel num_threads(nthreads)
    {
        float *buf = M > 2 ? aligned_alloc(64, (size_t)blk * 4) : NULL;  /* stored whole vectors */
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < nblocks; nb++) {
            const uint8_t *wb = w + nb * blk;
            if (!buf) {
                (M == 1 ? (i8 ? q1 : v1) : (i8 ? q2 : v2))(x, K, gp, wb, SAT(scale, sbf, nb * sb), sbf, 16,
                                                            y + nb * 16, N);
                continue;
            }
            for (int64_t q = 0; q < blk; q += 32) w8_f32x32(wb + q, (__m256 *)(buf + q), i8);
            for (int64_t m0 = 0; m0 < M; m0 += 3) {
                int mr = M - m0 < 3 ? (int)(M - m0) : 3;
                F256[mr](x + m0 * K, K, gp, buf, SAT(scale, sbf, nb * sb), sbf, 16, y + m0 * N + nb * 16, N);
            }
        }
        free(buf);
    }
}

/* ---- the blocked product: tiles of e4m3 rows widened once, then the BLAS's fp32 GEMM ------- */

/* The Fortran BLAS's sgemm (column-major), as torch's own MKL exports it (kernels/native.py). */
typedef void (*sgemm_fn)(const char *, const char *, const int *, const int *, const int *, const float *,
                         const float *, const int *, const float *, const int *, const float *, float *, const int *);

/* Blocks [b0, b1) of a packed weight times their scales, k-major: out[k * ldo + (b - b0) * 16 + j]
   is column b * 16 + j's weight at k, e4m3 * scale rounded once to fp32 (as a torch upcast makes
   it: (e4m3 / 256) * (scale * 256) is the same product). A k pair's 32 bytes are shuffled so that
   the even k's 16 columns fill one half of the register and the odd k's the other; then the fp16
   trick of e4m3_f32x32. */
T256 static void widen_256(const uint8_t *w, int64_t K, const void *scale, int sbf, int64_t gk, int64_t b0,
                           int64_t b1, float *out, int64_t ldo, int i8) {
    const int64_t kp = K / 2, gp = gk / 2, sblk = (K + gk - 1) / gk * 16;
    const __m256i shuf = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                          0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m256i z = _mm256_setzero_si256(), keep = _mm256_set1_epi16((short)0xbfff);
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *wb = w + b * kp * 32;
        float *ob = out + (b - b0) * 16;
        for (int64_t p0 = 0, g = 0; p0 < kp; p0 += gp, g++) {
            const void *sg = SAT(scale, sbf, b * sblk + g * 16);
            const __m256 s0 = sbf ? bf16x8(sg) : _mm256_loadu_ps(sg);
            const __m256 s1 = sbf ? bf16x8((const uint16_t *)sg + 8) : _mm256_loadu_ps((const float *)sg + 8);
            const int64_t p1 = p0 + gp < kp ? p0 + gp : kp;
            for (int64_t p = p0; p < p1; p++) {
                __m256i r = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(wb + p * 32)), shuf);
                r = _mm256_permute4x64_epi64(r, 0xd8);  /* low half: even k, columns 0-15; high: odd k */
                float *o0 = ob + 2 * p * ldo, *o1 = o0 + ldo;
                if (i8) {  /* int8 codes: their own values, times the scale as it is */
                    const __m128i e = _mm256_castsi256_si128(r), o = _mm256_extracti128_si256(r, 1);
                    _mm256_storeu_ps(o0, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(e)), s0));
                    _mm256_storeu_ps(o0 + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                               _mm_srli_si128(e, 8))), s1));
                    _mm256_storeu_ps(o1, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(o)), s0));
                    _mm256_storeu_ps(o1 + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                               _mm_srli_si128(o, 8))), s1));
                    continue;
                }
                const __m256i lo = _mm256_and_si256(_mm256_srai_epi16(_mm256_unpacklo_epi8(z, r), 1), keep);
                const __m256i hi = _mm256_and_si256(_mm256_srai_epi16(_mm256_unpackhi_epi8(z, r), 1), keep);
                _mm256_storeu_ps(o0, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(lo)), s0));
                _mm256_storeu_ps(o0 + 8, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(hi)), s1));
                _mm256_storeu_ps(o1, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(lo, 1)), s0));
                _mm256_storeu_ps(o1 + 8, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(hi, 1)), s1));
            }
        }
    }
}

/* y [M][N] = x [M][K] . W^T, W's tiles of tb blocks (tb * 16 columns) each widened into the
   thread's own buffer (tb * 16 * K floats, sized by the caller to stay in its core's cache) and
   multiplied by one single-threaded GEMM call; the team shares the tiles. A tile's columns are
   the same at any M and thread count, and the GEMM sees M only as its n: the reduction order of
   a column is the GEMM's for that n. */
T256 static void tiles_256(const float *x, int64_t M, int64_t K, const uint8_t *w, const void *scale, int sbf,
                           int64_t N, int64_t gk, float *y, int64_t tb, sgemm_fn gemm, int i8, int nthreads) {
    const int64_t nblocks = N / 16, ntiles = (nblocks + tb - 1) / tb;
    const int mi = (int)M, ki = (int)K, ldc = (int)N;
    const float one = 1.0f, zero = 0.0f;
#pragma omp parallel num_threads(nthreads < ntiles ? nthreads : (int)ntiles)
    {
        float *buf = aligned_alloc(64, (size_t)(tb * 16 * K) * 4);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < ntiles; t++) {
            const int64_t b0 = t * tb, b1 = b0 + tb < nblocks ? b0 + tb : nblocks;
            const int nt = (int)((b1 - b0) * 16);
            widen_256(w, K, scale, sbf, gk, b0, b1, buf, nt, i8);
            gemm("N", "N", &nt, &mi, &ki, &one, buf, &nt, x, &ki, &zero, y + b0 * 16, &ldc);
        }
        free(buf);
    }
}

/* ---- the blocked product on AMX's tile unit ------------------------------------------------- */

/* On a CPU with AMX each weight times its scale, w = e4m3 * scale in fp32 (an int8 code * scale),
   is split into two bf16 halves, hi = w rounded to bf16 and lo = w - hi rounded to bf16: an e4m3
   code (4 significant bits) times a bf16 scale (8) has at most 12 significant bits, so hi + lo
   is w exactly (an int8 code, or an fp32 scale, leaves at most 2^-17 of it). x is rounded to
   bf16 once, as the AVX-512 streaming kernel rounds it. Each 16 x 16 output tile then sums
   x . hi + x . lo over the whole K in fp32 on the tile unit, 32 k a product, with no group to
   close: the scales are in the halves. (Rounding w to one bf16 instead cost 0.0003 of KL on
   SmolLM2; scaling each 16-k group's sum in fp32 kept w exact but stalled the tile unit on a
   store every group: 2x slower.) K is padded with zeros to whole 32 k in x's copy and the
   halves; x's rows to 16. */
#define TAMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,f16c,fma,amx-tile,amx-bf16")))
#define AMX_ROWS 16
#define T512F __attribute__((target("avx512f,avx512bw,f16c,fma")))
T512F static INL void e4m3_f32x32_512(const uint8_t *p, __m512 *lo, __m512 *hi);
#define AMX_NB 4  /* blocks a pass: four independent tile sums keep the tile unit busy */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* Linux hands out the tile state only to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM for
   XFEATURE_XTILEDATA); asked once. */
static int amx_permitted(void) {
    static int state;  /* 0 not asked, 1 granted, -1 refused */
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (!s) {
        s = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
        __atomic_store_n(&state, s, __ATOMIC_RELEASE);
    }
    return s == 1;
}

/* One 16-column block's weights times their scales as bf16 halves in the tile unit's pair layout
   (the packed layout: [kp][16][2]): hi into out, lo kpad / 2 pairs further on; pairs from K / 2
   to kpad / 2 zero. */
TAMX static void amx_halves(const uint8_t *wb, int64_t K, int64_t kpad, const void *s, int sbf, int64_t gk,
                            uint16_t *out, int i8) {
    const int64_t kp = K / 2, gp = gk / 2;
    uint16_t *lo_out = out + kpad * 16;
    /* lane 2j and 2j + 1 are column j's (k, k + 1): the 16 columns' scales, each twice */
    const __m512i dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i dup1 = _mm512_add_epi32(dup, _mm512_set1_epi32(8));
    for (int64_t p0 = 0, g = 0; p0 < kp; p0 += gp, g++) {
        const void *sg = SAT(s, sbf, g * 16);
        const __m512 sv = sbf ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)sg)), 16))
                              : _mm512_loadu_ps(sg);
        const __m512 s0 = _mm512_permutexvar_ps(dup, sv), s1 = _mm512_permutexvar_ps(dup1, sv);
        const int64_t p1 = p0 + gp < kp ? p0 + gp : kp;
        for (int64_t p = p0; p < p1; p++) {
            __m512 a, b;  /* columns 0-7 and 8-15, each (k, k + 1) */
            if (i8) {
                const __m256i r = _mm256_loadu_si256((const __m256i *)(wb + p * 32));
                a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(r)));
                b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(r, 1)));
            } else {
                e4m3_f32x32_512(wb + p * 32, &a, &b);
            }
            a = _mm512_mul_ps(a, s0), b = _mm512_mul_ps(b, s1);
            const __m512i hi = (__m512i)_mm512_cvtne2ps_pbh(b, a);
            const __m512 ah = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(hi)), 16));
            const __m512 bh = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                  _mm512_extracti64x4_epi64(hi, 1)), 16));
            _mm512_storeu_si512(out + p * 32, hi);
            _mm512_storeu_si512(lo_out + p * 32, (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(b, bh), _mm512_sub_ps(a, ah)));
        }
    }
    for (int64_t p = kp; p < kpad / 2; p++) {
        _mm512_storeu_si512(out + p * 32, _mm512_setzero_si512());
        _mm512_storeu_si512(lo_out + p * 32, _mm512_setzero_si512());
    }
}

/* C tile j += x chunk (tile 4) . block j's hi and lo halves at pair offset q. */
#define AMX_DP(J, BUF)                                    \
    do {                                                  \
        _tile_loadd(5, (BUF) + q * 32, 64);               \
        _tile_dpbf16ps(J, 4, 5);                          \
        _tile_loadd(6, (BUF) + half + q * 32, 64);        \
        _tile_dpbf16ps(J, 4, 6);                          \
    } while (0)

TAMX static void tiles_amx(const float *x, int64_t M, int64_t K, const uint8_t *w, const void *scale, int sbf,
                           int64_t N, int64_t gk, float *y, int i8, int nthreads) {
    const int64_t kpad = (K + 31) / 32 * 32, mp = (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS, nblocks = N / 16;
    const int64_t sblk = (K + gk - 1) / gk * 16, half = kpad * 16, bstride = 2 * half;  /* uint16 */
    uint16_t *xb = aligned_alloc(64, ((size_t)(mp * kpad) * 2 + 63) / 64 * 64);
    memset(xb, 0, (size_t)(mp * kpad) * 2);
    for (int64_t m = 0; m < M; m++) to_bf16(x + m * K, xb + m * kpad, K);
#pragma omp parallel num_threads(nthreads)
    {
        amx_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 7; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;  /* C 0-3: 16 x 16 fp32; x: 16 x 32 bf16;
                                                                            halves: 16 pairs x 16 x 2 bf16 */
        _tile_loadconfig(&cfg);
        uint16_t *buf = aligned_alloc(64, (size_t)(AMX_NB * bstride) * 2);
        float *tmp = aligned_alloc(64, AMX_ROWS * 16 * 4);
        const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t bend = nblocks * (id + 1) / nt;
        for (int64_t b0 = nblocks * id / nt; b0 < bend; b0 += AMX_NB) {
            const int nb = bend - b0 < AMX_NB ? (int)(bend - b0) : AMX_NB;
            for (int j = 0; j < nb; j++)
                amx_halves(w + (b0 + j) * (K / 2) * 32, K, kpad, SAT(scale, sbf, (b0 + j) * sblk), sbf, gk,
                           buf + j * bstride, i8);
            for (int64_t m0 = 0; m0 < M; m0 += AMX_ROWS) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t c = 0; c < kpad; c += 32) {
                    const int64_t q = c / 2;
                    _tile_loadd(4, xb + m0 * kpad + c, kpad * 2);
                    AMX_DP(0, buf);
                    if (nb > 1) AMX_DP(1, buf + bstride);
                    if (nb > 2) AMX_DP(2, buf + 2 * bstride);
                    if (nb > 3) AMX_DP(3, buf + 3 * bstride);
                }
                const int64_t rows = M - m0 < AMX_ROWS ? M - m0 : AMX_ROWS;
                for (int j = 0; j < nb; j++) {
                    float *yj = y + m0 * N + (b0 + j) * 16;
                    if (rows == AMX_ROWS) {
                        if (j == 0) _tile_stored(0, yj, N * 4);
                        if (j == 1) _tile_stored(1, yj, N * 4);
                        if (j == 2) _tile_stored(2, yj, N * 4);
                        if (j == 3) _tile_stored(3, yj, N * 4);
                        continue;
                    }
                    if (j == 0) _tile_stored(0, tmp, 64);
                    if (j == 1) _tile_stored(1, tmp, 64);
                    if (j == 2) _tile_stored(2, tmp, 64);
                    if (j == 3) _tile_stored(3, tmp, 64);
                    for (int64_t r = 0; r < rows; r++) memcpy(yj + r * N, tmp + r * 16, 64);
                }
            }
        }
        free(buf), free(tmp);
        _tile_release();
    }
    free(xb);
}

/* ---- a mixture-of-experts layer's experts in one call ---------------------------------- */

/* TILE256's e4m3 tiles on 16-lane registers, for the experts' 1-2 row blocks on an AVX-512
   machine: one lane per (column, k parity) as there, the same FMAs in the same order, the group's
   close and the parity pair added once at the end, so the bits are v1's and v2's with half the
   instructions (the AVX2 conversion's 14 ops for 32 bytes are 6 here). */
T512F static INL void e4m3_f32x32_512(const uint8_t *p, __m512 *lo, __m512 *hi) {
    __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
    w = _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(w, 8), 1), _mm512_set1_epi16((short)0xbfff));
    *lo = _mm512_cvtph_ps(_mm512_castsi512_si256(w));  /* columns 0-7, each k parity */
    *hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(w, 1));  /* columns 8-15 */
}

/* The same bytes as fp32 times 2^-112 more (the experts' one-row and converting tiles, where
   their activations come times 2^112: the same products inside each FMA, so the same bits, at
   1.3x the bytes a second without the fp16 conversions): a byte sign-extended to 32 bits and
   shifted left by 20 holds its sign at bit 31, its exponent at 23-26 and its mantissa at 20-22,
   and an and keeps those: the fp32 whose exponent field is e4m3's own, a subnormal an fp32
   denormal (exact), NaN's code 1.875 * 2^-112 as the fp16 trick reads it 480 / 256. */
#define F32S_TAKE ((int)0x87f00000)
T512F static INL void e4m3_f32s_512(const uint8_t *p, __m512 *lo, __m512 *hi) {
    const __m512i take = _mm512_set1_epi32(F32S_TAKE);
    *lo = _mm512_castsi512_ps(_mm512_and_si512(
        _mm512_slli_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)), 20), take));
    *hi = _mm512_castsi512_ps(_mm512_and_si512(
        _mm512_slli_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))), 20), take));
}
#define e4m3_f16_512 e4m3_f32x32_512

#define TILE512F(NAME, MRC, CONV)                                                                 \
T512F static void NAME(const float *x, int64_t K, int64_t gp, const void *w, const void *s, int sbf,    \
                       int64_t lds, float *y, int64_t ldy) {                                     \
  const __m512i i0 = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);           \
  const __m512i i1 = _mm512_add_epi32(i0, _mm512_set1_epi32(8));                                 \
  __m512 tot[MRC][2];                                                                            \
  for (int64_t p0 = 0, g = 0; p0 < K / 2; p0 += gp, g++) {                                       \
    const int64_t p1 = p0 + gp < K / 2 ? p0 + gp : K / 2;                                        \
    __m512 acc[MRC][2];                                                                          \
    for (int i = 0; i < MRC; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();                   \
    for (int64_t p = p0; p < p1; p++) {                                                          \
        __m512 w0, w1;                                                                           \
        e4m3_##CONV##_512((const uint8_t *)w + p * 32, &w0, &w1);                                \
        ahead(w, p, 32);                                                                         \
        for (int i = 0; i < MRC; i++) {                                                          \
            const __m512 xv = _mm512_castpd_ps(_mm512_broadcastsd_pd(                            \
                _mm_load_sd((const double *)(x + i * K + 2 * p))));                              \
            acc[i][0] = _mm512_fmadd_ps(w0, xv, acc[i][0]);                                      \
            acc[i][1] = _mm512_fmadd_ps(w1, xv, acc[i][1]);                                      \
        }                                                                                        \
    }                                                                                            \
    const void *sg = SAT(s, sbf, g * lds);                                                       \
    const __m512 sv = sbf ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(         \
                                _mm256_loadu_si256((const __m256i *)sg)), 16))                   \
                          : _mm512_loadu_ps((const float *)sg);                                  \
    const __m512 sd0 = _mm512_permutexvar_ps(i0, sv), sd1 = _mm512_permutexvar_ps(i1, sv);       \
    for (int i = 0; i < MRC; i++) {                                                              \
        tot[i][0] = g ? _mm512_fmadd_ps(acc[i][0], sd0, tot[i][0]) : _mm512_mul_ps(acc[i][0], sd0); \
        tot[i][1] = g ? _mm512_fmadd_ps(acc[i][1], sd1, tot[i][1]) : _mm512_mul_ps(acc[i][1], sd1); \
    }                                                                                            \
  }                                                                                              \
  for (int i = 0; i < MRC; i++) {                                                                \
      float t[32];                                                                               \
      _mm512_storeu_ps(t, tot[i][0]);                                                            \
      _mm512_storeu_ps(t + 16, tot[i][1]);                                                       \
      for (int j = 0; j < 16; j++) y[i * ldy + j] = t[2 * j] + t[2 * j + 1];                     \
  }                                                                                              \
}
#define TILES512F(M) TILE512F(v##M##_512, M, f16) TILE512F(s##M##_512, M, f32s)
TILES512F(1) TILES512F(2) TILES512F(3) TILES512F(4) TILES512F(5) TILES512F(6) TILES512F(7) TILES512F(8)
typedef void (*tile512f_fn)(const float *, int64_t, int64_t, const void *, const void *, int, int64_t, float *, int64_t);
static const tile512f_fn V512F[2][9] = {{0, v1_512, v2_512, v3_512, v4_512, v5_512, v6_512, v7_512, v8_512},
                                        {0, s1_512, s2_512, s3_512, s4_512, s5_512, s6_512, s7_512, s8_512}};

/* One row through two 16-column blocks (wa and wb, each with its channel scales, one group: an
   expert's gate and up blocks, or two down blocks) with v1_512's arithmetic for each: the same
   FMAs in the same order a column, so the same bits. Its two blocks are four independent sums,
   where v1_512's two wait on the FMA's latency: an expert's one-row product was bound by that,
   not by its bytes. */
#define V1X2_512(NAME, CONV)                                                                      \
T512F static void NAME(const float *x, int64_t K, const uint8_t *wa, const float *sa, float *ya,         \
                       const uint8_t *wb, const float *sb, float *yb) {                                  \
    const __m512i i0 = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);          \
    const __m512i i1 = _mm512_add_epi32(i0, _mm512_set1_epi32(8));                                \
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;                                   \
    for (int64_t p = 0; p < K / 2; p++) {                                                         \
        __m512 u0, u1, v0, v1;                                                                    \
        e4m3_##CONV##_512(wa + p * 32, &u0, &u1);                                                 \
        e4m3_##CONV##_512(wb + p * 32, &v0, &v1);                                                 \
        ahead(wa, p, 32);                                                                         \
        ahead(wb, p, 32);                                                                         \
        const __m512 xv = _mm512_castpd_ps(_mm512_broadcastsd_pd(_mm_load_sd((const double *)(x + 2 * p)))); \
        a0 = _mm512_fmadd_ps(u0, xv, a0), a1 = _mm512_fmadd_ps(u1, xv, a1);                       \
        b0 = _mm512_fmadd_ps(v0, xv, b0), b1 = _mm512_fmadd_ps(v1, xv, b1);                       \
    }                                                                                             \
    const __m512 s[2][2] = {{_mm512_permutexvar_ps(i0, _mm512_loadu_ps(sa)), _mm512_permutexvar_ps(i1, _mm512_loadu_ps(sa))}, \
                            {_mm512_permutexvar_ps(i0, _mm512_loadu_ps(sb)), _mm512_permutexvar_ps(i1, _mm512_loadu_ps(sb))}}; \
    const __m512 acc[2][2] = {{a0, a1}, {b0, b1}};                                                \
    float *ys[2] = {ya, yb};                                                                      \
    for (int h = 0; h < 2; h++) {                                                                 \
        float t[32];                                                                              \
        _mm512_storeu_ps(t, _mm512_mul_ps(acc[h][0], s[h][0]));                                   \
        _mm512_storeu_ps(t + 16, _mm512_mul_ps(acc[h][1], s[h][1]));                              \
        for (int j = 0; j < 16; j++) ys[h][j] = t[2 * j] + t[2 * j + 1];                          \
    }                                                                                             \
}
V1X2_512(v1x2_512, f16) V1X2_512(s1x2_512, f32s)
typedef void (*v1x2_fn)(const float *, int64_t, const uint8_t *, const float *, float *, const uint8_t *,
                        const float *, float *);
static const v1x2_fn V1X2[2] = {v1x2_512, s1x2_512};

/* Whether n activations scale by 2^112 exactly (e4m3_f32s_512's weights take them so: the
   caller scales them once): finite and below 2^16. */
static int moe_scalable(const float *x, int64_t n) {
    int ok = 1;
    for (int64_t i = 0; i < n; i++) ok &= fabsf(x[i]) < 65536.0f;
    return ok;
}

/* rows [n][K] through one 16-column block wb of a packed [N/16][K/2][16][2] weight -> y
   (ldy apart). Where wide (the CPU has AVX-512 and the caller's isa allows it) every row runs
   the 16-lane tiles, up to 8 rows a pass converting the bytes as they stream (an expert's rows
   of a prefill: one conversion for 8 rows, where the block's fp32 copy was read again every 3).
   Else up to 2 rows convert as they stream, more convert the block once into buf (K * 16
   floats) and run 3-row tiles over it. Each tile has the others' arithmetic a column: the same
   bits whatever the rows. */
T256 static void block256(const float *x, int64_t n, int64_t K, const uint8_t *wb, const float *s, float *y,
                          int64_t ldy, float *buf, int wide, int sh) {
    if (wide) {
        for (int64_t m0 = 0; m0 < n; m0 += 8)
            V512F[sh][n - m0 < 8 ? n - m0 : 8](x + m0 * K, K, K / 2, wb, s, 0, 0, y + m0 * ldy, ldy);
        return;
    }
    if (n <= 2) {
        (n == 1 ? v1 : v2)(x, K, K / 2, wb, s, 0, 0, y, ldy);
        return;
    }
    for (int64_t q = 0; q < K * 16; q += 32) e4m3_f32x32(wb + q, (__m256 *)(buf + q));
    for (int64_t m0 = 0; m0 < n; m0 += 3) {
        int mr = n - m0 < 3 ? (int)(n - m0) : 3;
        F256[mr](x + m0 * K, K, K / 2, buf, s, 0, 0, y + m0 * ldy, ldy);
    }
}

/* act(gate) * up, the contract's activations (kernels/moe.py): 0 SiLU, 1 gpt-oss's clamped
   SwiGLU, 2 GELU (erf), 3 GELU's tanh form; sigmoid(z) from e = exp(-|z|) <= 1, as
   silu_and_mul does. */
static INL float gated(float g, float u, int act, float alpha, float limit) {
    if (act == 2) return 0.5f * g * (1.0f + erff(g * 0.70710678118654752f)) * u;
    if (act == 3) return 0.5f * g * (1.0f + tanhf(0.79788456080286536f * (g + 0.044715f * g * g * g))) * u;
    if (act == 1) {
        g = g < limit ? g : limit;
        u = u < -limit ? -limit : u > limit ? limit : u;
        float z = g * alpha, e = exp_neg(z < 0.0f ? z : -z);
        return (u + 1.0f) * (g * ((z < 0.0f ? e : 1.0f) / (1.0f + e)));
    }
    float e = exp_neg(g < 0.0f ? g : -g);
    return (g < 0.0f ? g * e : g) / (1.0f + e) * u;
}

#define SMALL_MOE (1 << 17)  /* floats of gathered rows (512 KiB) below which one thread gathers and sums */

/* out[t] = the sum of token t's k rows of ys, in ascending expert order: a token's slots sit in
   ascending expert order by their sorted positions. */
static void sum_slots(const float *ys, const int64_t *pos, int64_t t, int64_t k, int64_t H, float *out) {
    int64_t q[64], m = k < 64 ? k : 64;
    for (int64_t j = 0; j < m; j++) {
        int64_t v = pos[t * k + j], i = j;
        for (; i > 0 && q[i - 1] > v; i--) q[i] = q[i - 1];
        q[i] = v;
    }
    float *o = out + t * H;
    memcpy(o, ys + q[0] * H, (size_t)H * 4);
    for (int64_t j = 1; j < m; j++) {
        const float *yj = ys + q[j] * H;
        for (int64_t h = 0; h < H; h++) o[h] += yj[h];
    }
}

/* out [T][H] = sum over each token's k slots, in ascending expert order, of
   weight * (down_e(act(gate_up_e(x) + b_gu[e])) + b_dn[e]) (the contract of kernels/moe.py).
   ids [T][k] int64 (distinct per token, each in [0, E)), weights [T][k] fp32; w_gu
   [E][2I/16][H/2][16][2] and w_dn [E][H/16][I/2][16][2] e4m3 bytes (pack_fp8 per expert), s_gu
   [E][2I] and s_dn [E][H] the channel scales times 256; b_gu [E][2I], b_dn [E][H] fp32 or NULL.
   I % 16 == 0, H % 16 == 0 (the caller checks).
   The slots are sorted by expert once (a counting sort, stable); then the team splits the work
   by (active expert, 16-column block) twice: gate and up blocks c and I/16 + c with the
   activation on the 16 columns they make, then down with its bias and the routing weight, so
   a step whose experts have 1-2 rows each still has (experts x blocks) items to share. */
/* A token's row into the experts' gathered rows, times up (1, or 2^112 for e4m3_f32s_512's). */
static void gather_row(float *dst, const float *src, int64_t H, float up) {
    if (up == 1.0f) {
        memcpy(dst, src, (size_t)H * 4);
        return;
    }
    for (int64_t h = 0; h < H; h++) dst[h] = src[h] * up;
}

T256 static void moe_256(const float *x, int64_t T, int64_t H, int64_t I, int64_t E, int64_t k, const int64_t *ids,
                         const float *weights, const uint8_t *w_gu, const float *s_gu, const float *b_gu,
                         const uint8_t *w_dn, const float *s_dn, const float *b_dn, int act, float alpha,
                         float limit, float *out, int wide, int nthreads) {
    const int64_t S = T * k, ib = I / 16, hb = H / 16;
    int64_t *off = calloc((size_t)E + 1, sizeof(int64_t)), *pos = malloc((size_t)S * sizeof(int64_t));
    int64_t *tok = malloc((size_t)S * sizeof(int64_t)), *active = malloc((size_t)E * sizeof(int64_t));
    float *ws = malloc((size_t)S * 4), *xs = malloc((size_t)(S * H) * 4), *a = malloc((size_t)(S * I) * 4);
    float *ys = malloc((size_t)(S * H) * 4), *a2 = malloc((size_t)(S * I) * 4), *x1 = NULL;
    for (int64_t s = 0; s < S; s++) off[ids[s] + 1]++;
    int64_t na = 0;
    for (int64_t e = 0; e < E; e++) {
        if (off[e + 1]) active[na++] = e;
        off[e + 1] += off[e];
    }
    int64_t *fill = malloc((size_t)E * sizeof(int64_t));
    memcpy(fill, off, (size_t)E * sizeof(int64_t));
    for (int64_t s = 0; s < S; s++) {
        int64_t p = fill[ids[s]]++;
        pos[s] = p, tok[p] = s / k, ws[p] = weights[s];
    }
    free(fill);
    /* A decode step's gather and sum are a few KiB: done here by one thread, they spare the team
       two of its four barriers, which cost most when another process holds a core. */
    const int small = S * H <= SMALL_MOE;
    /* the experts' 16-lane products take the activations times 2^112 where they all scale
       (e4m3_f32s_512); the down products' inputs are checked as the gate makes them */
    const int sh_gu = wide && moe_scalable(x, T * H);
    int big_a = 0;
    const float up = sh_gu ? 0x1p112f : 1.0f;  /* the gathered rows' factor */
    if (sh_gu && T == 1) {
        x1 = malloc((size_t)H * 4);
        for (int64_t h = 0; h < H; h++) x1[h] = x[h] * 0x1p112f;
    }
    if (small && T > 1)
        for (int64_t p = 0; p < S; p++) gather_row(xs + p * H, x + tok[p] * H, H, up);
#pragma omp parallel num_threads(nthreads)
    {
        float *buf = aligned_alloc(64, (size_t)((H > I ? H : I) * 16 * 2) * 4);
        float *tmp = malloc((size_t)(T * 32) * 4);  /* an expert has at most T rows */
        if (!small) {
#pragma omp for schedule(static)
            for (int64_t p = 0; p < S; p++) gather_row(xs + p * H, x + tok[p] * H, H, up);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < na * ib; item++) {
            const int64_t e = active[item / ib], c = item % ib, r0 = off[e], n = off[e + 1] - r0;
            const uint8_t *w = w_gu + e * 2 * I * H;
            const float *s = s_gu + e * 2 * I, *xe = T == 1 ? (x1 ? x1 : x) : xs + r0 * H;
            if (n == 1 && wide) {
                V1X2[sh_gu](xe, H, w + c * 16 * H, s + c * 16, tmp, w + (ib + c) * 16 * H, s + I + c * 16, tmp + 16);
            } else {
                block256(xe, n, H, w + c * 16 * H, s + c * 16, tmp, 32, buf, wide, sh_gu);
                block256(xe, n, H, w + (ib + c) * 16 * H, s + I + c * 16, tmp + 16, 32, buf + H * 16, wide, sh_gu);
            }
            if (b_gu) {
                const float *bg = b_gu + e * 2 * I + c * 16, *bu = bg + I;
                for (int64_t r = 0; r < n; r++)
                    for (int j = 0; j < 16; j++) tmp[r * 32 + j] += bg[j], tmp[r * 32 + 16 + j] += bu[j];
            }
            for (int64_t r = 0; r < n; r++) {
                float *ar = a + (r0 + r) * I + c * 16;
                const float *tr = tmp + r * 32;
                if (act == 0) {  /* the common case, on its own so that it vectorizes */
#pragma omp simd
                    for (int j = 0; j < 16; j++) ar[j] = gated(tr[j], tr[16 + j], 0, alpha, limit);
                } else {
                    for (int j = 0; j < 16; j++) ar[j] = gated(tr[j], tr[16 + j], act, alpha, limit);
                }
                if (!moe_scalable(ar, 16)) __atomic_store_n(&big_a, 1, __ATOMIC_RELAXED);
                float *a2r = a2 + (r0 + r) * I + c * 16;
                for (int j = 0; j < 16; j++) a2r[j] = ar[j] * 0x1p112f;
            }
        }
        /* down: two blocks an item where H has an even count of them (v1x2_512 for one row); the
           loop above ended at a barrier, so every thread reads the same big_a */
        const int64_t per = hb % 2 ? 1 : 2, hi = hb / per;
        const int sh_dn = wide && !__atomic_load_n(&big_a, __ATOMIC_RELAXED);
        const float *ad = sh_dn ? a2 : a;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < na * hi; item++) {
            const int64_t e = active[item / hi], c0 = item % hi * per, r0 = off[e], n = off[e + 1] - r0;
            const uint8_t *we = w_dn + e * H * I;
            const float *se = s_dn + e * H;
            if (n == 1 && wide && per == 2)
                V1X2[sh_dn](ad + r0 * I, I, we + c0 * 16 * I, se + c0 * 16, ys + r0 * H + c0 * 16,
                            we + (c0 + 1) * 16 * I, se + (c0 + 1) * 16, ys + r0 * H + (c0 + 1) * 16);
            else
                for (int64_t c = c0; c < c0 + per; c++)
                    block256(ad + r0 * I, n, I, we + c * 16 * I, se + c * 16, ys + r0 * H + c * 16, H, buf, wide, sh_dn);
            for (int64_t c = c0; c < c0 + per; c++) {
                float *y = ys + r0 * H + c * 16;
                const float *bd = b_dn ? b_dn + e * H + c * 16 : NULL;
                for (int64_t r = 0; r < n; r++)
                    for (int j = 0; j < 16; j++) y[r * H + j] = (bd ? y[r * H + j] + bd[j] : y[r * H + j]) * ws[r0 + r];
            }
        }
        if (!small) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) sum_slots(ys, pos, t, k, H, out);
        }
        free(tmp);
        free(buf);
    }
    if (small)
        for (int64_t t = 0; t < T; t++) sum_slots(ys, pos, t, k, H, out);
    free(off), free(pos), free(tok), free(active), free(ws), free(xs), free(a), free(ys), free(a2), free(x1);
}

/* 2: AVX-512 BF16, 1: AVX2 + F16C + FMA, 0: neither (the caller keeps torch's formats). */
int fp8_linear_isa(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw")) return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;  /* F16C comes with both */
    return 0;
}

/* x [M][K] fp32 contiguous, y [M][N] fp32; N % 16 == 0, K % 2 == 0, gk even and > 0 (the
   caller checks). isa: what fp8_linear_isa allowed, or less. map: the weight's
   fp8_special_map, or NULL (the AVX-512 product then converts by the tables). Returns 0, or -1
   for an isa not built here or a group size the layout cannot take. */
int fp8_linear_grouped(const float *x, int64_t M, int64_t K, const uint8_t *w, const void *scale, int sbf,
                       int64_t N, int64_t gk, float *y, int isa, int i8, const uint8_t *map, int nthreads) {
    if (gk <= 0 || gk % 2) return -1;
    if (gk > K) gk = K;
    if (isa == 2 && !i8) linear_512(x, M, K, w, 0, scale, sbf, N, gk, y, map, nthreads);
    else if (isa >= 1) linear_256(x, M, K, w, scale, sbf, N, gk, y, i8, nthreads);
    else return -1;
    return 0;
}
/* The blocked product: x [M][K] fp32 contiguous, y [M][N]; N % 16 == 0, K % 2 == 0, gk even
   (the caller checks). amx 0: fp32 tiles of tb blocks and gemm the Fortran sgemm (tiles_256);
   1: the tile unit (tiles_amx; tb and gemm unused). Returns 0, or -1 where the ISA (or, for
   AMX, the OS's permission) is not here or an argument is out of range. */
int fp8_linear_tiles(const float *x, int64_t M, int64_t K, const uint8_t *w, const void *scale, int sbf, int64_t N,
                     int64_t gk, float *y, int64_t tb, void *gemm, int amx, int i8, int nthreads) {
    __builtin_cpu_init();
    if (gk <= 0 || gk % 2)
        return -1;
    if (amx) {
        if (fp8_linear_isa() < 2 || !fp8_linear_amx() || !amx_permitted())
            return -1;
        tiles_amx(x, M, K, w, scale, sbf, N, gk > K ? K : gk, y, i8, nthreads);
        return 0;
    }
    if (!gemm || tb <= 0 || !__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma"))
        return -1;
    tiles_256(x, M, K, w, scale, sbf, N, gk > K ? K : gk, y, tb, (sgemm_fn)gemm, i8, nthreads);
    return 0;
}

/* 1 where the CPU has AMX's bf16 tiles and the OS has enabled their state (XCR0 bits 17-18). */
int fp8_linear_amx(void) {
    unsigned a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    if (!((d >> 22) & 1) || !((d >> 24) & 1)) return 0;  /* AMX-BF16, AMX-TILE */
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
    if (!((c >> 27) & 1)) return 0;  /* OSXSAVE: xgetbv is allowed */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((lo >> 17) & 3) == 3;
}

/* widen_256 on its own (tests hold it to the torch upcast): blocks [b0, b1) into out, ldo apart. */
int fp8_widen(const uint8_t *w, int64_t K, const void *scale, int sbf, int64_t gk, int64_t b0, int64_t b1,
              float *out, int64_t ldo, int i8) {
    __builtin_cpu_init();
    if (gk <= 0 || gk % 2 || !__builtin_cpu_supports("avx2")) return -1;
    widen_256(w, K, scale, sbf, gk > K ? K : gk, b0, b1, out, ldo, i8);
    return 0;
}
/* y [M][N] fp32 = x [M][K] (rounded to bf16) . w^T for a bf16 weight in the e4m3 weights'
   layout ([N/16][K/2][16][2] words), on AVX-512 BF16 only: fp32 sums and an fp32 result, where
   oneDNN's bf16 product rounds its result to bf16 (a head's logits then tie). N % 16 == 0,
   K % 2 == 0 (the caller checks). Returns 0, or -1 where it is not built. */
int bf16_linear(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t N, float *y, int nthreads) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512bf16") || !__builtin_cpu_supports("avx512bw")) return -1;
    linear_512(x, M, K, w, 1, NULL, 0, N, K, y, NULL, nthreads);
    return 0;
}
/* One MoE layer's experts (moe_256's contract); k <= 64. The AVX2 tiles run on an AVX-512
   machine too (isa 2): the layer takes fp32 products there as well. Returns 0, or -1 where
   neither is built. */
int fp8_moe(const float *x, int64_t T, int64_t H, int64_t I, int64_t E, int64_t k, const int64_t *ids,
            const float *weights, const uint8_t *w_gu, const float *s_gu, const float *b_gu, const uint8_t *w_dn,
            const float *s_dn, const float *b_dn, int act, float alpha, float limit, float *out, int isa,
            int nthreads) {
    if (isa < 1 || k > 64 || I % 16 || H % 16) return -1;
    moe_256(x, T, H, I, E, k, ids, weights, w_gu, s_gu, b_gu, w_dn, s_dn, b_dn, act, alpha, limit, out, isa >= 2,
            nthreads);
    return 0;
}
#else
int fp8_linear_isa(void) { return 0; }
int fp8_linear_amx(void) { return 0; }
int fp8_linear_force_conversion(int c) { (void)c; return 0; }
int fp8_linear_shifts(void) { return 0; }
CLONES int64_t fp8_special_map(const uint8_t *w, int64_t nblocks, int64_t kp, uint8_t *map, int nthreads) {
    (void)w; (void)nblocks; (void)kp; (void)map; (void)nthreads;
    return -1;
}
int fp8_linear_grouped(const float *x, int64_t M, int64_t K, const uint8_t *w, const void *scale, int sbf,
                       int64_t N, int64_t gk, float *y, int isa, int i8, const uint8_t *map, int nthreads) {
    (void)x; (void)M; (void)K; (void)w; (void)scale; (void)sbf; (void)N; (void)gk; (void)y; (void)isa; (void)i8;
    (void)map;
    (void)nthreads;
    return -1;
}
int fp8_linear_tiles(const float *x, int64_t M, int64_t K, const uint8_t *w, const void *scale, int sbf, int64_t N,
                     int64_t gk, float *y, int64_t tb, void *gemm, int amx, int i8, int nthreads) {
    (void)amx; (void)i8; (void)x; (void)M; (void)K; (void)w; (void)scale; (void)sbf; (void)N; (void)gk; (void)y; (void)tb; (void)gemm;
    (void)nthreads;
    return -1;
}
int fp8_widen(const uint8_t *w, int64_t K, const void *scale, int sbf, int64_t gk, int64_t b0, int64_t b1,
              float *out, int64_t ldo, int i8) {
    (void)i8; (void)w; (void)K; (void)scale; (void)sbf; (void)gk; (void)b0; (void)b1; (void)out; (void)ldo;
    return -1;
}
int bf16_linear(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t N, float *y, int nthreads) {
    (void)x; (void)M; (void)K; (void)w; (void)N; (void)y; (void)nthreads;
    return -1;
}
int fp8_moe(const float *x, int64_t T, int64_t H, int64_t I, int64_t E, int64_t k, const int64_t *ids,
            const float *weights, const uint8_t *w_gu, const float *s_gu, const float *b_gu, const uint8_t *w_dn,
            const float *s_dn, const float *b_dn, int act, float alpha, float limit, float *out, int isa,
            int nthreads) {
    (void)x; (void)T; (void)H; (void)I; (void)E; (void)k; (void)ids; (void)weights; (void)w_gu; (void)s_gu;
    (void)b_gu; (void)w_dn; (void)s_dn; (void)b_dn; (void)act; (void)alpha; (void)limit; (void)out; (void)isa;
    (void)nthreads;
    return -1;
}
#endif

/* ---- rows of a packed e4m3 weight (an embedding lookup) ---------------------------------- */

/* out [T][K] fp32: row ids[i] (each in [0, N), else -1 and nothing written) of a packed [N/16][K/2][16][2] weight times its scales (fp32 or
   bf16, times 256, in the kernels' block layout; groups of gk along K), e4m3 * scale rounded
   once as a torch upcast does; int8 codes (i8) times their scales as they are. Only the
   gathered rows are read. Plain C: a lookup is a few rows. */
int fp8_rows(const uint8_t *w, int64_t N, int64_t K, const void *scale, int sbf, int64_t gk, const int64_t *ids,
             int64_t T, float *out, int i8, int nthreads) {
    for (int64_t i = 0; i < T; i++)  /* here, not in the caller: reading the ids there is a host sync on a GPU */
        if (ids[i] < 0 || ids[i] >= N) return -1;
    float lut[256];  /* e4m3 / 256, as the fp16 trick gives it; an int8 code's own value */
    for (int v = 0; v < 256; v++) {
        int e = (v >> 3) & 15, m = v & 7;
        float mag = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf(m / 8.0f, -6);
        lut[v] = i8 ? (float)(int8_t)v : (v & 0x80 ? -mag : mag) / 256.0f;
    }
    if (gk > K) gk = K;
    const int64_t kp = K / 2, sblk = (K + gk - 1) / gk * 16;
#pragma omp parallel for schedule(static) num_threads(T * K >= (1 << 16) ? nthreads : 1)
    for (int64_t i = 0; i < T; i++) {
        const int64_t n = ids[i], j = n % 16;
        const uint8_t *wb = w + (n / 16) * kp * 32 + j * 2;
        const int64_t s0 = (n / 16) * sblk + j;
        float *o = out + i * K;
        for (int64_t k = 0; k < K; k++) {
            const int64_t si = s0 + (k / gk) * 16;
            float s;
            if (sbf) {
                uint32_t u = (uint32_t)((const uint16_t *)scale)[si] << 16;
                memcpy(&s, &u, 4);
            } else {
                s = ((const float *)scale)[si];
            }
            o[k] = lut[wb[(k / 2) * 32 + (k & 1)]] * s;
        }
    }
    return 0;
}
