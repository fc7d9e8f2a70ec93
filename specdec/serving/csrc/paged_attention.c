/* Causal attention over a paged KV pool, one query row at a time, for CPU steps (AVX-512).
 *
 * Compiled as part of fused_int4.c (which includes it) by specdec/serving/cpu_gemm.py
 * (-O3 -march=native), single-threaded: the fused draft layers' attention, and through
 * cpu_gemm.paged_attention every other CPU step's (paged_llama.attends_in_c), in place of
 * gather + SDPA.
 *
 * For each query token t (of sequence b = seq[t], at position p = pos[t]) and each KV head h,
 * the G query heads h*G .. h*G+G-1 attend to keys j = lo .. p of that sequence
 * (lo = p - window + 1 with a sliding window, else 0), key j in pool slot
 * block_tables[b][j / bs] * bs + j % bs:
 *   s_j = scale * <q, k_j>;  out = sum_j exp(s_j - max s) v_j / sum_j exp(s_j - max s).
 * Everything in float32 (bf16 inputs widened, the output rounded to nearest even).
 *
 * Exactness: a row's result is computed by the same operations in the same order whatever
 * other rows share the call (its keys in order, its own scratch), so a verify's rows equal
 * one-token decodes bit for bit here too; with skinny_gemm.c, a float32 target's verify logits
 * equal its decodes' exactly.
 *
 * Why: one decode row attends to a few hundred keys; SDPA's call, the gathered copy of the
 * blocks and the additive masks cost more than the arithmetic (BENCHMARKS.md §6o).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#if !defined(__AVX512F__)
#error "paged_attention.c needs AVX-512"
#endif

#define VW 16      /* floats per vector */
#define MAXD 256   /* head_dim at most */
#define MAXG 16    /* query heads per KV head at most */

static inline __m512 load16(const void *p, int bf16)
{
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    return _mm512_loadu_ps((const float *)p);
}

static inline void store16(void *p, __m512 v, int bf16)
{
    if (bf16) { /* round to nearest even, as torch's float -> bfloat16 (no NaNs here) */
        __m512i u = _mm512_castps_si512(v);
        __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
        _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
    } else {
        _mm512_storeu_ps((float *)p, v);
    }
}

/* e^x for x <= 0 (x - max), 16 lanes: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], degree 6
 * (relative error ~2e-7); below -87 it is 0 */
static inline __m512 exp16(__m512 x)
{
    const __m512 lo = _mm512_set1_ps(-87.0f);
    __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lo);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(~tiny, p, n);
}

/* Keys are read a block at a time: a block's slots are contiguous ([bs, Hkv, D]) and every KV
 * head's keys of a block are used while the block is in L1. Prefetches: the keys PREFETCH_KEYS
 * ahead (all heads) during the scores, each block's values into L2 meanwhile, and the next
 * block's values during the weighted sum. (The weights' stream evicts the pool between layers:
 * walking it head by head with a division per key waited on memory; BENCHMARKS.md §6p.) */
static inline void prefetch_block(const char *p, long bytes)
{
    for (long o = 0; o < bytes; o += 64)
        _mm_prefetch(p + o, _MM_HINT_T0);
}

static inline void prefetch_block_l2(const char *p, long bytes)
{
    for (long o = 0; o < bytes; o += 64)
        _mm_prefetch(p + o, _MM_HINT_T1);
}

#ifndef PREFETCH_KEYS
#define PREFETCH_KEYS 32
#endif

long paged_attention_scratch_floats(long max_keys, long heads) { return heads * (max_keys + VW) + heads * MAXD; }

/* one query row: scores, softmax and the weighted sum of values, nv = D / 16 and g = Hq / Hkv
 * (constants where the caller's dispatch makes them so) */
static inline __attribute__((always_inline)) void attend_row(
    const char *qrow, int q_bf16, const char *k_cache, const char *v_cache, int cache_bf16, const int64_t *table,
    long block_size, long lo, long p, long hkv, const long g, const long nv, float scale, char *orow, int out_bf16,
    float *scratch)
{
    const long d = nv * VW, hq = hkv * g, n = p - lo + 1, es = cache_bf16 ? 2 : 4, qs = q_bf16 ? 2 : 4;
    const long key_bytes = hkv * d * es, block_bytes = block_size * key_bytes;
    const long first = lo / block_size, last = p / block_size;
    float *acc = scratch + hq * (n + VW); /* [Hq, D] */
    /* scores: scratch[hh * (n + VW) + (j - lo)], each head's keys in order */
    long pb = first, pj = lo - first * block_size; /* the prefetch cursor: block, key in it */
    for (long i = 0; i < PREFETCH_KEYS && pb <= last; i++) {
        prefetch_block(k_cache + table[pb] * block_bytes + pj * key_bytes, key_bytes);
        if (++pj == block_size) pj = 0, pb++;
    }
    for (long b = first; b <= last; b++) {
        const long j0 = b == first ? lo : b * block_size, j1 = b == last ? p : b * block_size + block_size - 1;
        const char *base = k_cache + table[b] * block_bytes;
        prefetch_block_l2(v_cache + table[b] * block_bytes, block_bytes); /* for the second pass */
        for (long h = 0; h < hkv; h++) {
            __m512 qv[MAXG][MAXD / VW];
            for (long i = 0; i < g; i++)
                for (long c = 0; c < nv; c++)
                    qv[i][c] = load16(qrow + ((h * g + i) * d + c * VW) * qs, q_bf16);
            for (long j = j0; j <= j1; j++) {
                if (h == 0) { /* the key PREFETCH_KEYS ahead, every head of it */
                    if (++pj == block_size) pj = 0, pb++;
                    if (pb <= last)
                        prefetch_block(k_cache + table[pb] * block_bytes + pj * key_bytes, key_bytes);
                }
                const char *kp = base + (j - b * block_size) * key_bytes + h * d * es;
                __m512 kv[MAXD / VW];
                for (long c = 0; c < nv; c++)
                    kv[c] = load16(kp + c * VW * es, cache_bf16);
                for (long i = 0; i < g; i++) {
                    __m512 a = _mm512_mul_ps(qv[i][0], kv[0]);
                    for (long c = 1; c < nv; c++)
                        a = _mm512_fmadd_ps(qv[i][c], kv[c], a);
                    scratch[(h * g + i) * (n + VW) + (j - lo)] = _mm512_reduce_add_ps(a) * scale;
                }
            }
        }
    }
    for (long hh = 0; hh < hq; hh++) {
        float *s = scratch + hh * (n + VW);
        __m512 m = _mm512_set1_ps(-INFINITY);
        long j = 0;
        for (; j + VW <= n; j += VW)
            m = _mm512_max_ps(m, _mm512_loadu_ps(s + j));
        const __mmask16 tail = (__mmask16)((1u << (n - j)) - 1);
        m = _mm512_max_ps(m, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail, s + j));
        const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
        __m512 sum = _mm512_setzero_ps();
        for (j = 0; j + VW <= n; j += VW) {
            __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), mx));
            _mm512_storeu_ps(s + j, e);
            sum = _mm512_add_ps(sum, e);
        }
        __m512 e = _mm512_maskz_mov_ps(tail, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + j), mx)));
        _mm512_mask_storeu_ps(s + j, tail, e);
        sum = _mm512_add_ps(sum, e);
        s[n] = 1.0f / _mm512_reduce_add_ps(sum); /* kept beside the weights */
        for (long c = 0; c < nv; c++)
            _mm512_storeu_ps(acc + hh * d + c * VW, _mm512_setzero_ps());
    }
    /* out = sum_j w_j v_j: each head's accumulators over the keys in order */
    for (long b = first; b <= last; b++) {
        const long j0 = b == first ? lo : b * block_size, j1 = b == last ? p : b * block_size + block_size - 1;
        const char *base = v_cache + table[b] * block_bytes;
        if (b + 1 <= last)
            prefetch_block(v_cache + table[b + 1] * block_bytes, block_bytes);
        for (long h = 0; h < hkv; h++) {
            __m512 av[MAXG][MAXD / VW];
            for (long i = 0; i < g; i++)
                for (long c = 0; c < nv; c++)
                    av[i][c] = _mm512_loadu_ps(acc + (h * g + i) * d + c * VW);
            for (long j = j0; j <= j1; j++) {
                const char *vp = base + (j - b * block_size) * key_bytes + h * d * es;
                __m512 vv[MAXD / VW];
                for (long c = 0; c < nv; c++)
                    vv[c] = load16(vp + c * VW * es, cache_bf16);
                for (long i = 0; i < g; i++) {
                    const __m512 w = _mm512_set1_ps(scratch[(h * g + i) * (n + VW) + (j - lo)]);
                    for (long c = 0; c < nv; c++)
                        av[i][c] = _mm512_fmadd_ps(w, vv[c], av[i][c]);
                }
            }
            for (long i = 0; i < g; i++)
                for (long c = 0; c < nv; c++)
                    _mm512_storeu_ps(acc + (h * g + i) * d + c * VW, av[i][c]);
        }
    }
    for (long hh = 0; hh < hq; hh++) {
        const __m512 inv = _mm512_set1_ps(scratch[hh * (n + VW) + n]);
        for (long c = 0; c < nv; c++)
            store16(orow + (hh * d + c * VW) * (out_bf16 ? 2 : 4), _mm512_mul_ps(_mm512_loadu_ps(acc + hh * d + c * VW), inv),
                    out_bf16);
    }
}

/* q [T, Hq, D] with row stride q_stride (elements); k_cache, v_cache [S, Hkv, D];
 * block_tables [B, MB] int64; seq [T], pos [T] int64; out [T, Hq * D]; scratch of
 * paged_attention_scratch_floats(max pos + 1, Hq) floats. q_bf16, cache_bf16, out_bf16: which
 * of q, the caches and out are bfloat16 (else float32). Returns 0, or -1 for shapes it does not take. */
int paged_attention(const void *q, long q_stride, int q_bf16, const void *k_cache, const void *v_cache, int cache_bf16,
                    const int64_t *block_tables, long mb, long block_size, const int64_t *seq, const int64_t *pos,
                    long T, long hq, long hkv, long d, long window, float scale, void *out, int out_bf16,
                    float *scratch)
{
    const long g = hq / hkv, nv = d / VW, qs = q_bf16 ? 2 : 4, os = out_bf16 ? 2 : 4;
    if (d % VW || d > MAXD || g > MAXG || hq % hkv)
        return -1;
    for (long t = 0; t < T; t++) {
        const long p = pos[t], lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
        const int64_t *table = block_tables + seq[t] * mb;
        const char *qrow = (const char *)q + t * q_stride * qs;
        char *orow = (char *)out + t * hq * d * os;
#define ROW(G_, NV_) attend_row(qrow, q_bf16, k_cache, v_cache, cache_bf16, table, block_size, lo, p, hkv, G_, NV_, \
                                scale, orow, out_bf16, scratch)
        if (nv == 4 && g == 3) /* SmolLM2 */
            ROW(3, 4);
        else if (nv == 4)
            ROW(g, 4);
        else if (nv == 8)
            ROW(g, 8);
        else
            ROW(g, nv);
#undef ROW
    }
    return 0;
}
