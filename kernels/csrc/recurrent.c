/* The recurrent layers' per-token updates on CPU: the gated delta rule (Qwen3.5, Qwen3-Next), the
   causal depthwise convolution (those and LFM2, Mamba2) and the Mamba2 state update. Batch decode
   runs these once per layer per step over a varlen batch (request n owns tokens cu[n]..cu[n+1]
   and its state at slots[n] of a pool); in torch each is a dozen ops over [N, H, Dk, Dv] with
   temporaries as large as the states, here one pass that reads and writes each state in place.
   Contracts and torch references: kernels/gated_delta.py, causal_conv.py, ssd_scan.py. fp32. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

#define MAX_DIM 1024  /* kernels/gated_delta.py MAX_NATIVE_DIM, ssd_scan.py's: per-token buffers */
#define CONV_BLOCK 256  /* channels a conv task takes: decode at batch 1 still spreads over threads */
#define MAX_TAPS 16

/* silu(a) = a / (1 + e^-a), from e = exp(-|a|) <= 1 (common.h's exp_neg: it vectorizes, expf does
   not, and at decode the activation was most of the convolution's time). */
static inline float silu(float v) {
    float e = exp_neg(v < 0.0f ? v : -v);
    return (v < 0.0f ? v * e : v) / (1.0f + e);
}

/* torch's softplus (threshold 20: above it, x itself). */
static inline float softplus(float v) { return v > 20.0f ? v : log1pf(expf(v)); }

/* For each request and value head h (q/k head h / (Hv / Hk)), token by token:
     S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T (scale q)
   S [Dk][Dv] at pool[slot][h]; zeros first where has_init[n] is 0. q, k rows of Hk * Dk floats at
   stride sq / sk, v rows of Hv * Dv at sv; g, beta [T][Hv]; o [T][Hv][Dv]. tok (or NULL): where
   the state after each token is also copied (-1: nowhere). */
CLONES int gdn_recurrent(const float *q, const float *k, const float *v, int64_t sq, int64_t sk, int64_t sv,
                         const float *g, const float *beta, float *o, float *pool, const int64_t *cu,
                         const int64_t *slots, const uint8_t *has_init, const int64_t *tok, int64_t N, int64_t Hk,
                         int64_t Hv, int64_t Dk, int64_t Dv, float scale, int l2norm, int nthreads) {
    if (Dk > MAX_DIM || Dv > MAX_DIM || Hv % Hk) return -1;
    const int64_t group = Hv / Hk, state = Dk * Dv;
#pragma omp parallel for collapse(2) num_threads(nthreads) if (N * Hv > 1)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t h = 0; h < Hv; h++) {
            float kk[MAX_DIM], qq[MAX_DIM], acc[MAX_DIM];
            float *S = pool + (slots[n] * Hv + h) * state;
            if (!has_init[n]) memset(S, 0, (size_t)state * sizeof(float));
            for (int64_t t = cu[n]; t < cu[n + 1]; t++) {
                const float *kt = k + t * sk + (h / group) * Dk, *qt = q + t * sq + (h / group) * Dk;
                float kn = 0.0f, qn = 0.0f;
                for (int64_t i = 0; i < Dk; i++) { kn += kt[i] * kt[i]; qn += qt[i] * qt[i]; }
                kn = l2norm ? 1.0f / sqrtf(kn + 1e-6f) : 1.0f;
                qn = (l2norm ? 1.0f / sqrtf(qn + 1e-6f) : 1.0f) * scale;
                for (int64_t i = 0; i < Dk; i++) { kk[i] = kt[i] * kn; qq[i] = qt[i] * qn; }
                const float decay = expf(g[t * Hv + h]), b = beta[t * Hv + h];
                const float *vt = v + t * sv + h * Dv;
                /* pass 1: decay the state and read it at k */
                memset(acc, 0, (size_t)Dv * sizeof(float));
                for (int64_t i = 0; i < Dk; i++) {
                    float *row = S + i * Dv;
                    const float ki = kk[i];
#pragma omp simd
                    for (int64_t j = 0; j < Dv; j++) { row[j] *= decay; acc[j] += row[j] * ki; }
                }
#pragma omp simd
                for (int64_t j = 0; j < Dv; j++) acc[j] = (vt[j] - acc[j]) * b;  /* the delta */
                /* pass 2: write the delta at k and read the new state at q */
                float *ot = o + (t * Hv + h) * Dv;
                memset(ot, 0, (size_t)Dv * sizeof(float));
                for (int64_t i = 0; i < Dk; i++) {
                    float *row = S + i * Dv;
                    const float ki = kk[i], qi = qq[i];
#pragma omp simd
                    for (int64_t j = 0; j < Dv; j++) { row[j] += ki * acc[j]; ot[j] += row[j] * qi; }
                }
                if (tok && tok[t] >= 0) memcpy(pool + (tok[t] * Hv + h) * state, S, (size_t)state * sizeof(float));
            }
        }
    }
    return 0;
}

/* acc[c] += sum_j w[c][j] src[j][c] over nc channels. The models' widths (4; LFM2's 3) are
   written out: all K taps of a weight row in one statement is an interleaved group GCC vectorizes
   with permutes, where a loop over taps stayed scalar (stride K), and a transposed copy of the
   weight per call cost more than the convolution at decode. */
static inline __attribute__((always_inline)) void conv_taps(float *restrict acc, const float *restrict w, const float *const *src, int64_t nc, int64_t K) {
    if (K == 4) {
        const float *restrict s0 = src[0], *restrict s1 = src[1], *restrict s2 = src[2], *restrict s3 = src[3];
        for (int64_t c = 0; c < nc; c++)
            acc[c] += w[4 * c] * s0[c] + w[4 * c + 1] * s1[c] + w[4 * c + 2] * s2[c] + w[4 * c + 3] * s3[c];
    } else if (K == 3) {
        const float *restrict s0 = src[0], *restrict s1 = src[1], *restrict s2 = src[2];
        for (int64_t c = 0; c < nc; c++) acc[c] += w[3 * c] * s0[c] + w[3 * c + 1] * s1[c] + w[3 * c + 2] * s2[c];
    } else {
        for (int64_t j = 0; j < K; j++)
            for (int64_t c = 0; c < nc; c++) acc[c] += w[c * K + j] * src[j][c];
    }
}

/* Causal depthwise convolution over a varlen batch with a window of the last K - 1 inputs per
   request: out[t][c] = act(bias[c] + sum_j w[c][j] * x'[t - (K - 1) + j][c]), x' the request's
   inputs after its window (state[slot] [K - 1][C], oldest first; zeros where has_init[n] is 0).
   The window then becomes the last K - 1 rows of x'. x rows at stride sx; cu NULL: one token a
   request (decode). tok (or NULL): where the window after each token is also written (-1: nowhere). */
CLONES int conv1d_varlen(const float *x, int64_t sx, const float *w, const float *bias, float *out, float *state,
                         const int64_t *cu, const int64_t *slots, const uint8_t *has_init, const int64_t *tok,
                         int64_t N, int64_t C, int64_t K, int act_silu, int nthreads) {
    if (K < 2 || K > MAX_TAPS) return -1;
    const int64_t W = K - 1, blocks = (C + CONV_BLOCK - 1) / CONV_BLOCK;
#pragma omp parallel for collapse(2) num_threads(nthreads) if (N * C >= 4096)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t cb = 0; cb < blocks; cb++) {
            const int64_t c0 = cb * CONV_BLOCK, c1 = c0 + CONV_BLOCK < C ? c0 + CONV_BLOCK : C;
            const int64_t start = cu ? cu[n] : n, len = (cu ? cu[n + 1] : n + 1) - start;
            const int64_t nc = c1 - c0;
            float *win = state + slots[n] * W * C;
            float next[MAX_TAPS][CONV_BLOCK], acc[CONV_BLOCK];
            const float *src[MAX_TAPS];
            if (!has_init[n])
                for (int64_t r = 0; r < W; r++) memset(win + r * C + c0, 0, (size_t)nc * sizeof(float));
            for (int64_t t = 0; t < len; t++) {
                for (int64_t c = 0; c < nc; c++) acc[c] = bias ? bias[c0 + c] : 0.0f;
                for (int64_t j = 0; j < K; j++) {
                    const int64_t p = t - W + j;  /* < 0: from the window */
                    src[j] = (p >= 0 ? x + (start + p) * sx : win + (W + p) * C) + c0;
                }
                conv_taps(acc, w + c0 * K, src, nc, K);
                float *ot = out + (start + t) * C + c0;
                if (act_silu) {
#pragma omp simd
                    for (int64_t c = 0; c < nc; c++) ot[c] = silu(acc[c]);
                } else {
                    memcpy(ot, acc, (size_t)nc * sizeof(float));
                }
                if (tok && tok[start + t] >= 0)  /* the window after token t; the old one is still whole */
                    for (int64_t r = 0; r < W; r++) {
                        const int64_t p = t + 1 - W + r;
                        const float *s = (p >= 0 ? x + (start + p) * sx : win + (W + p) * C) + c0;
                        memcpy(state + (tok[start + t] * W + r) * C + c0, s, (size_t)nc * sizeof(float));
                    }
            }
            for (int64_t r = 0; r < W; r++) {  /* the new window, read before any of it is written */
                const int64_t p = len - W + r;
                const float *src = p >= 0 ? x + (start + p) * sx : win + (W + p) * C;
                memcpy(next[r], src + c0, (size_t)(c1 - c0) * sizeof(float));
            }
            for (int64_t r = 0; r < W; r++) memcpy(win + r * C + c0, next[r], (size_t)(c1 - c0) * sizeof(float));
        }
    }
    return 0;
}

/* Mamba2's state update, token by token: for head h (group h / (H / G)),
     dt' = clamp(softplus?(dt + dt_bias), lo, hi);  S <- exp(dt' A[h]) S + dt' x B^T;  y = S C + D[h] x
   S [P][N] at pool[slot][h] (zeros first where has_init[n] is 0); x rows of H * P at stride sx;
   dt rows of H at sdt; B, C rows of G * N at sb, sc; y [T][H][P]. dt_bias, D may be NULL. tok (or
   NULL): where the state after each token is also copied (-1: nowhere). */
CLONES int ssd_update(const float *x, int64_t sx, const float *dt, int64_t sdt, const float *A, const float *B,
                      int64_t sb, const float *Cm, int64_t sc, const float *D, const float *dt_bias, int softplus_dt,
                      float dt_lo, float dt_hi, float *y, float *pool, const int64_t *cu, const int64_t *slots,
                      const uint8_t *has_init, const int64_t *tok, int64_t N, int64_t H, int64_t G, int64_t P,
                      int64_t Ns, int nthreads) {
    if (H % G) return -1;
    const int64_t heads_per_group = H / G, state = P * Ns;
#pragma omp parallel for collapse(2) num_threads(nthreads) if (N * H > 1)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t h = 0; h < H; h++) {
            float *S = pool + (slots[n] * H + h) * state;
            if (!has_init[n]) memset(S, 0, (size_t)state * sizeof(float));
            for (int64_t t = cu[n]; t < cu[n + 1]; t++) {
                float d = dt[t * sdt + h] + (dt_bias ? dt_bias[h] : 0.0f);
                d = softplus_dt ? softplus(d) : d;
                d = d < dt_lo ? dt_lo : (d > dt_hi ? dt_hi : d);
                const float decay = expf(d * A[h]), skip = D ? D[h] : 0.0f;
                const float *xt = x + t * sx + h * P;
                const float *bt = B + t * sb + (h / heads_per_group) * Ns, *ct = Cm + t * sc + (h / heads_per_group) * Ns;
                float *yt = y + (t * H + h) * P;
                for (int64_t p = 0; p < P; p++) {
                    float *row = S + p * Ns, acc = 0.0f;
                    const float dx = d * xt[p];
#pragma omp simd reduction(+ : acc)
                    for (int64_t i = 0; i < Ns; i++) { row[i] = row[i] * decay + dx * bt[i]; acc += row[i] * ct[i]; }
                    yt[p] = acc + skip * xt[p];
                }
                if (tok && tok[t] >= 0) memcpy(pool + (tok[t] * H + h) * state, S, (size_t)state * sizeof(float));
            }
        }
    }
    return 0;
}
