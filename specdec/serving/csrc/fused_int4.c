/* The int4 draft's decoder layers in one call, for small steps (AVX-512 VNNI).
 *
 * Built by specdec/serving/cpu_gemm.py (-O3 -march=native), called through ctypes,
 * single-threaded. A draft step of one token spends as long in torch's per-op overhead (norms,
 * RoPE, the KV writes, SiLU, the adds: some 15 small ops a layer) as in its matmuls; here the
 * whole stack of layers runs in C, in float32, over the same weights (int4_gemm.c's layouts),
 * the same pool (bfloat16) and the same attention (paged_attention.c).
 *
 * A Llama layer without biases or q/k norms (paged_llama checks that before choosing it):
 *   h = rms_norm(x) * w_in;  q, k, v = h @ Wqkv;  q, k = rope(q, k, pos);  pool[slot] = k, v
 *   x += attention(q, pool) @ Wo;  h = rms_norm(x) * w_post;  g, u = h @ Wgu;  x += (silu(g) * u) @ Wdown
 */
#include "int4_gemm.c"
#include "paged_attention.c"

typedef struct {
    const uint8_t *qkv_codes; const void *qkv_scales; /* scales: float16 (int4_gemm.c) */
    const uint8_t *o_codes; const void *o_scales;
    const uint8_t *gate_up_codes; const void *gate_up_scales;
    const uint8_t *down_codes; const void *down_scales;
    const float *input_norm, *post_norm; /* [hidden] float32 */
    void *k_cache, *v_cache;             /* [S, Hkv, D], bfloat16 when cache_bf16 */
    long window;                         /* 0 = full attention */
} fused_layer;

typedef struct {
    long num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    float eps, scale;
    const float *cos, *sin; /* [max_context, D] float32 */
    long block_size;
    int cache_bf16;
    int xbits; /* the 4-bit matmuls' activations: 8 or 16 bits (int4_gemm.c) */
} fused_model;

static long align64(long n) { return (n + 63) & ~63L; }

static long lowbit_max_scratch(const fused_model *m, long T)
{
    long a = lowbit_scratch_bytes(T, m->hidden), b = lowbit_scratch_bytes(T, m->num_heads * m->head_dim),
         c = lowbit_scratch_bytes(T, m->intermediate);
    return a > b ? (a > c ? a : c) : (b > c ? b : c);
}

/* bytes of scratch fused_layers needs for T tokens attending to at most max_keys keys */
long fused_scratch_bytes(const fused_model *m, long T, long max_keys)
{
    const long nqkv = (m->num_heads + 2 * m->num_kv_heads) * m->head_dim, f = sizeof(float);
    return align64(T * m->hidden * f) * 2 + align64(T * nqkv * f) + align64(T * m->num_heads * m->head_dim * f) +
           align64(T * 2 * m->intermediate * f) + align64(T * m->intermediate * f) + align64(lowbit_max_scratch(m, T)) +
           align64(paged_attention_scratch_floats(max_keys, m->num_heads) * f) + 64;
}

static void rms_norm_rows(const float *x, const float *w, long T, long n, float eps, float *out)
{
    for (long t = 0; t < T; t++) {
        const float *r = x + t * n;
        __m512 acc = _mm512_setzero_ps();
        for (long i = 0; i < n; i += 16) {
            __m512 v = _mm512_loadu_ps(r + i);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        const __m512 s = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)n + eps));
        for (long i = 0; i < n; i += 16)
            _mm512_storeu_ps(out + t * n + i, _mm512_mul_ps(_mm512_loadu_ps(w + i),
                                                            _mm512_mul_ps(_mm512_loadu_ps(r + i), s)));
    }
}

static void add_rows(float *x, const float *y, long n)
{
    for (long i = 0; i < n; i += 16)
        _mm512_storeu_ps(x + i, _mm512_add_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
}

/* rotate_half RoPE (transformers' Llama) on one head of D, in place */
static void rope_head(float *x, const float *cos, const float *sin, long d)
{
    const long half = d / 2;
    for (long i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

static void store_head(void *cache, int bf16, long slot, long hkv, long h, long d, const float *src)
{
    const long off = (slot * hkv + h) * d;
    for (long c = 0; c < d; c += 16)
        store16((char *)cache + (off + c) * (bf16 ? 2 : 4), _mm512_loadu_ps(src + c), bf16);
}

/* x [T, hidden] float32, in place through every layer. pos, slots, seq [T]; block_tables
 * [B, mb]; scratch of fused_scratch_bytes(m, T, the most keys a row attends to). Returns 0, or
 * -1 for shapes it does not take. */
int fused_layers(const fused_model *m, const fused_layer *layers, float *x, long T, const int64_t *pos,
                 const int64_t *slots, const int64_t *seq, const int64_t *block_tables, long mb, void *scratch)
{
    const long H = m->hidden, hq = m->num_heads, hkv = m->num_kv_heads, d = m->head_dim, I = m->intermediate;
    const long nqkv = (hq + 2 * hkv) * d, f = sizeof(float);
    if (H % 32 || (hq * d) % 32 || I % 32 || d % 16 || d > MAXD || hq % hkv || hq / hkv > MAXG ||
        !pick(W_Q4_1, m->xbits, 1))
        return -1;
    char *p = (char *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    float *h = (float *)p; p += align64(T * H * f);
    float *tmp = (float *)p; p += align64(T * H * f);
    float *qkv = (float *)p; p += align64(T * nqkv * f);
    float *attn = (float *)p; p += align64(T * hq * d * f);
    float *gu = (float *)p; p += align64(T * 2 * I * f);
    float *act = (float *)p; p += align64(T * I * f);
    void *lb = p; p += align64(lowbit_max_scratch(m, T));
    float *as = (float *)p;
    for (long l = 0; l < m->num_layers; l++) {
        const fused_layer *L = layers + l;
        rms_norm_rows(x, L->input_norm, T, H, m->eps, h);
        lowbit_gemm(W_Q4_1, m->xbits, h, 0, T, H, L->qkv_codes, L->qkv_scales, nqkv, qkv, 0, lb);
        for (long t = 0; t < T; t++) {
            float *row = qkv + t * nqkv;
            const float *c = m->cos + pos[t] * d, *s = m->sin + pos[t] * d;
            for (long hh = 0; hh < hq + hkv; hh++)
                rope_head(row + hh * d, c, s, d);
            for (long hh = 0; hh < hkv; hh++) {
                store_head(L->k_cache, m->cache_bf16, slots[t], hkv, hh, d, row + (hq + hh) * d);
                store_head(L->v_cache, m->cache_bf16, slots[t], hkv, hh, d, row + (hq + hkv + hh) * d);
            }
        }
        if (paged_attention(qkv, nqkv, 0, L->k_cache, L->v_cache, m->cache_bf16, block_tables, mb, m->block_size,
                            seq, pos, T, hq, hkv, d, L->window, m->scale, attn, 0, as))
            return -1;
        lowbit_gemm(W_Q4_1, m->xbits, attn, 0, T, hq * d, L->o_codes, L->o_scales, H, tmp, 0, lb);
        add_rows(x, tmp, T * H);
        rms_norm_rows(x, L->post_norm, T, H, m->eps, h);
        lowbit_gemm(W_Q4_1, m->xbits, h, 0, T, H, L->gate_up_codes, L->gate_up_scales, 2 * I, gu, 0, lb);
        for (long t = 0; t < T; t++)
            for (long i = 0; i < I; i += 16) {
                const __m512 g = _mm512_loadu_ps(gu + t * 2 * I + i), u = _mm512_loadu_ps(gu + t * 2 * I + I + i);
                const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)); /* e^-g */
                _mm512_storeu_ps(act + t * I + i,
                                 _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u));
            }
        lowbit_gemm(W_Q4_1, m->xbits, act, 0, T, I, L->down_codes, L->down_scales, H, tmp, 0, lb);
        add_rows(x, tmp, T * H);
    }
    return 0;
}
