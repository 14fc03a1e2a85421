/* A decoder's layers in one call, for a CPU step of few rows (kernels/decoder_native.py).

   A one-row step of a 30-layer model is about 300 small calls (four products, two norms, RoPE,
   the KV write, attention, the activation, per layer); made from Python each pays 5-30 us of
   dispatch, several milliseconds a step against ~10 ms of weight reads. Here the same kernels
   run back to back with no Python between them: each is the exported function the per-op path
   calls (fp8_linear_grouped, rms_norm, rope, write_kv, paged_attention, silu_and_mul; a
   mixture of experts' moe_route and fp8_moe) with the same arguments, so a step's bits are
   the per-op path's (tests/test_decoder_native.py holds them equal). The caller checks what
   each layer holds (decoder_native.fits). */
#include <stdint.h>
#include <string.h>

int fp8_linear_grouped(const float *x, int64_t M, int64_t K, const uint8_t *w, const void *scale, int sbf,
                       int64_t N, int64_t gk, float *y, int isa, int i8, const uint8_t *map, int nthreads);
int rms_norm(float *x, const float *residual, const float *w, float eps, float *out, int64_t rows, int64_t n,
             int nthreads);
int rope(float *x, int64_t T, int64_t H, int64_t stride_t, int64_t stride_h, int64_t D, const int64_t *positions,
         const float *cos_sin, int nthreads);
int write_kv(const float *k, const float *v, int64_t T, int64_t stride_k, int64_t stride_v, int64_t heads, int64_t D,
             const int64_t *slots, int64_t num_slots, void *k_cache, void *v_cache, uint16_t *k_scale,
             uint16_t *v_scale, int kind);
int silu_and_mul(const float *x, int64_t rows, int64_t n, float *out, int nthreads);
int paged_attention(const float *q, int64_t T, int H, int hkv, int D, const void *kc, const void *vc,
                    const uint16_t *ks, const uint16_t *vs, int kind, const int32_t *block_table, int64_t bt_stride,
                    const int32_t *seq_lens, const int32_t *qsl, int64_t num_seqs, int bs, float scale, int window,
                    float softcap, const float *sinks, const int32_t *key_end, int max_q, float *out, int64_t *work,
                    int nthreads);

int moe_route(const float *h, int64_t T, int64_t H, const float *W, const float *bias, int64_t E, int64_t k, int kind,
              int norm, int64_t *ids, float *weights, int nthreads);
int fp8_moe(const float *x, int64_t T, int64_t H, int64_t I, int64_t E, int64_t k, const int64_t *ids,
            const float *weights, const uint8_t *w_gu, const float *s_gu, const float *b_gu, const uint8_t *w_dn,
            const float *s_dn, const float *b_dn, int act, float alpha, float limit, float *out, int isa,
            int nthreads);
int fp8_linear_tiles(const float *x, int64_t M, int64_t K, const uint8_t *w, const void *scale, int sbf, int64_t N,
                     int64_t gk, float *y, int64_t tb, void *gemm, int bf16, int i8, int nthreads);

/* One product's weight as its kernel takes it: the streaming kernel (tb 0) or the blocked
   product (tb blocks a tile and gemm the BLAS's sgemm, or AMX's tiles where bf16), as the
   layer's CpuLinear chose for the step's rows; n its outputs (a multiple of 16, so that no
   padding column is written), bias NULL or n fp32, map the weight's fp8_special_map or NULL. */
typedef struct {
    const uint8_t *w;
    const void *s;
    const float *bias;
    int64_t sbf, gk, n, k, i8, isa, tb, bf16;
    void *gemm;
    const uint8_t *map;
} rl_linear;

/* A mixture of experts run here: its router (moe_route: fp32 [E][H] weights, bias or NULL, kind,
   norm) and its experts as fp8_moe takes them (the packed e4m3 bytes and their scales, biases
   or NULL, the activation's code, isa). */
typedef struct {
    const float *router_w, *router_b;
    const uint8_t *gu, *dn;
    const float *s_gu, *s_dn, *b_gu, *b_dn;
    int64_t experts, topk, kind, norm, inter, act, isa;
    float alpha, limit;
} rl_moe;

/* A layer: mlp 1 runs its SiLU-gated MLP here, 2 its mixture of experts (moe); 0 stops after the
   post-attention norm, the MLP's input then in the step's normed (a MLP of the layer's own: the
   caller runs it), and must be the call's last layer. q_norm and k_norm: per-head RMSNorm
   weights (qwen3), or NULL. */
typedef struct {
    rl_linear qkv, o, gate_up, down;
    rl_moe moe;
    const float *norm1, *norm2, *cos_sin, *q_norm, *k_norm;
    void *k_cache, *v_cache;
    uint16_t *k_scale, *v_scale;
    float eps, scale;
    int64_t heads, kv_heads, head_dim, rot, window, kind, num_slots, block_size, mlp;
} rl_layer;

/* The step: its rows, metadata and scratch. h [T][hidden] holds the embeddings in and the last
   layer's output out; res the residual stream (written here; its input ignored where first). */
typedef struct {
    int64_t T, table_stride, num_seqs, max_q, nthreads, first;
    const int64_t *positions, *slots;
    const int32_t *table, *seq_lens, *loc, *key_end;
    int64_t *work, *ids;  /* ids, weights: [T][k] of the widest router */
    float *h, *res, *normed, *qkv, *q, *k, *attn, *gu, *act, *weights;
} rl_step;

static int product(const rl_linear *l, const float *x, int64_t T, float *y, int nt) {
    if (l->tb ? fp8_linear_tiles(x, T, l->k, l->w, l->s, (int)l->sbf, l->n, l->gk, y, l->tb, l->gemm, (int)l->bf16,
                                  (int)l->i8, nt)
              : fp8_linear_grouped(x, T, l->k, l->w, l->s, (int)l->sbf, l->n, l->gk, y, (int)l->isa, (int)l->i8, l->map,
                                   nt))
        return -1;
    if (l->bias)  /* as the per-op path adds it: y + bias, once per element */
        for (int64_t t = 0; t < T; t++)
            for (int64_t j = 0; j < l->n; j++) y[t * l->n + j] += l->bias[j];
    return 0;
}

/* Returns 0; the 1-based index of the layer where a kernel refused its arguments, negated; or
   that of a layer whose router met a tie across its top-k cut (moe_route), which the per-op
   path breaks as torch does. */
int decoder_layers(const rl_layer *layers, int64_t count, const rl_step *st) {
    const int64_t T = st->T;
    const int nt = (int)st->nthreads;
    for (int64_t i = 0; i < count; i++) {
        const rl_layer *L = layers + i;
        const int64_t hidden = L->qkv.k, D = L->head_dim, qsize = L->heads * D, kvsize = L->kv_heads * D;
        const int64_t ld = L->qkv.n, inter = L->down.k;
        int rc = 0;
        /* the input norm: the per-op path's x + residual in x, here residual + x in res (the
           same sum), or the embeddings themselves before the first layer */
        if (i == 0 && st->first) {
            memcpy(st->res, st->h, (size_t)(T * hidden) * 4);
            rms_norm(st->res, NULL, L->norm1, L->eps, st->normed, T, hidden, nt);
        } else {
            rms_norm(st->res, st->h, L->norm1, L->eps, st->normed, T, hidden, nt);
        }
        rc |= product(&L->qkv, st->normed, T, st->qkv, nt);
        if (L->q_norm) {
            /* per-head norms on contiguous copies (the per-op path's q.contiguous()), in place;
               then q and k rotate apart, as there */
            for (int64_t t = 0; t < T; t++) {
                memcpy(st->q + t * qsize, st->qkv + t * ld, (size_t)qsize * 4);
                memcpy(st->k + t * kvsize, st->qkv + t * ld + qsize, (size_t)kvsize * 4);
            }
            rms_norm(st->q, NULL, L->q_norm, L->eps, st->q, T * L->heads, D, nt);
            rms_norm(st->k, NULL, L->k_norm, L->eps, st->k, T * L->kv_heads, D, nt);
            if (L->rot) {
                rope(st->q, T, L->heads, qsize, D, L->rot, st->positions, L->cos_sin, nt);
                rope(st->k, T, L->kv_heads, kvsize, D, L->rot, st->positions, L->cos_sin, nt);
            }
            rc |= write_kv(st->k, st->qkv + qsize + kvsize, T, kvsize, ld, L->kv_heads, D, st->slots,
                           L->num_slots, L->k_cache, L->v_cache, L->k_scale, L->v_scale, (int)L->kind);
        } else {
            /* q's and k's heads sit side by side in each qkv row: one rotation for both */
            if (L->rot) rope(st->qkv, T, L->heads + L->kv_heads, ld, D, L->rot, st->positions, L->cos_sin, nt);
            for (int64_t t = 0; t < T; t++) memcpy(st->q + t * qsize, st->qkv + t * ld, (size_t)qsize * 4);
            rc |= write_kv(st->qkv + qsize, st->qkv + qsize + kvsize, T, ld, ld, L->kv_heads, D, st->slots,
                           L->num_slots, L->k_cache, L->v_cache, L->k_scale, L->v_scale, (int)L->kind);
        }
        rc |= paged_attention(st->q, T, (int)L->heads, (int)L->kv_heads, (int)D, L->k_cache, L->v_cache,
                              L->k_scale, L->v_scale, (int)L->kind, st->table, st->table_stride, st->seq_lens,
                              st->loc, st->num_seqs, (int)L->block_size, L->scale, (int)L->window, 0.0f, NULL,
                              st->key_end, (int)st->max_q, st->attn, st->work, nt);
        rc |= product(&L->o, st->attn, T, st->h, nt);
        rms_norm(st->res, st->h, L->norm2, L->eps, st->normed, T, hidden, nt);
        if (!L->mlp) {
            if (rc || i + 1 != count) return (int)-(i + 1);
            break;
        }
        if (L->mlp == 2) {  /* as the per-op path: the router's op, then the experts' */
            const rl_moe *M = &L->moe;
            int ties = moe_route(st->normed, T, hidden, M->router_w, M->router_b, M->experts, M->topk, (int)M->kind,
                                 (int)M->norm, st->ids, st->weights, nt);
            if (ties > 0) return (int)(i + 1);  /* torch breaks the tie: the caller runs the step per op */
            rc |= ties;
            rc |= fp8_moe(st->normed, T, hidden, M->inter, M->experts, M->topk, st->ids, st->weights, M->gu, M->s_gu,
                          M->b_gu, M->dn, M->s_dn, M->b_dn, (int)M->act, M->alpha, M->limit, st->h, (int)M->isa, nt);
            if (rc) return (int)-(i + 1);
            continue;
        }
        rc |= product(&L->gate_up, st->normed, T, st->gu, nt);
        silu_and_mul(st->gu, T, inter, st->act, nt);
        rc |= product(&L->down, st->act, T, st->h, nt);
        if (rc) return (int)-(i + 1);
    }
    return 0;
}
