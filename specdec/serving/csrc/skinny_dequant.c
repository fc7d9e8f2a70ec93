/* skinny_gemm.c's float32 matmul, reading its weights as GGUF codes: Q4_1 (the decoder layers)
 * and Q8_0 (the output head), dequantized in registers to the very float32 values a model
 * dequantized from that GGUF holds (AVX-512).
 *
 * Built by specdec/serving/cpu_gemm.py (-O3 -march=native), called through ctypes,
 * single-threaded.
 *
 * Why: a float32 target made from a Q4_1 GGUF (the default, SmolLM2's shipped file) reads 4 bytes
 * a weight where the file holds 5 bits; its one-token step is bound by those bytes, and its
 * verify slows the draft beside it through the shared memory bandwidth (BENCHMARKS.md §6r).
 * Here the same matmul reads a sixth of the layers' bytes and a quarter of the head's.
 *
 * Exactness: the dequantized weight is exact. Q4_1: w = d * q + lo with d float16 (11 significant
 * bits) and q in 0..15 (4 bits): d * q is exact in float32, so fma(q, d, lo) rounds once, as
 * float32's d * q + lo does. Q8_0: w = d * c with c in -127..127: exact. The weights then go
 * through skinny_gemm.c's chains unchanged: every output is one chain of fused multiply-adds
 * over k = 0..K-1 in one lane. So each output equals skinny_gemm_f32's on the dequantized
 * matrix bit for bit, whatever M (tests/test_cpu_gemm.py), and a verify's rows equal one-token
 * decodes.
 *
 * Layouts (int4_gemm.c's, cpu_gemm.py's PackedInt4Weight and PackedQ8Weight), panels of 16 outputs:
 *   Q4_1 codes: per panel, per block of 8 inputs, 64 bytes: byte 4n + t holds q[k0 + t][n] in its
 *     low nibble and q[k0 + 4 + t][n] in its high nibble; scales: per panel, per group of 32
 *     inputs, 32 float16: d[0..15] then lo[0..15].
 *   Q8_0 codes: per panel, per block of 4 inputs, 64 bytes: byte 4n + t = c[k0 + t][n] + 128;
 *     scales: per panel, per group of 32 inputs, 16 float16.
 *
 * Few rows (M <= DQ_MAXR, a decode or a verify): one tile dequantizes each block of codes once, in
 * registers, and feeds it to every row. Many rows (a prefill): a pair of panels is dequantized
 * into a buffer that skinny_gemm.c's tiles then read for every row tile.
 */
#include <stdint.h>

#include "skinny_gemm.c"

#if !defined(__AVX512F__)
#error "skinny_dequant.c needs AVX-512"
#endif

#define GQ 32 /* inputs per scale group */

/* The weights of 16 outputs at one input, from a 64-byte block of codes (exact, see above).
 * Q4_1: input k0 + kk of a block of 8, w = q * d + lo. */
static inline __m512 q4_weights(__m512i codes, int kk, __m512 d, __m512 lo)
{
    const __m512i q = _mm512_and_si512(_mm512_srli_epi32(codes, 8 * (kk & 3) + 4 * (kk >> 2)), _mm512_set1_epi32(15));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), d, lo);
}

/* Q8_0: input k0 + t of a block of 4, w = (c + 128) * d + nd with nd = -128 d: d * c */
static inline __m512 q8_weights(__m512i codes, int t, __m512 d, __m512 nd)
{
    const __m512i c = _mm512_and_si512(_mm512_srli_epi32(codes, 8 * t), _mm512_set1_epi32(255));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), d, nd);
}

/* A group's scales for 16 outputs: Q4_1 d and lo; Q8_0 d and nd = -128 d */
static inline void q4_scales(const uint16_t *s, __m512 *d, __m512 *lo)
{
    *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)s));
    *lo = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + PANEL)));
}

static inline void q8_scales(const uint16_t *s, __m512 *d, __m512 *nd)
{
    *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)s));
    *nd = _mm512_mul_ps(*d, _mm512_set1_ps(-128.0f));
}

/* per format: inputs per block of 64 code bytes, code bytes per input, scales (float16) per group */
#define Q4_BLOCK 8
#define Q4_CODE_BYTES 8
#define Q4_GROUP_SCALES (2 * PANEL)
#define Q8_BLOCK 4
#define Q8_CODE_BYTES PANEL
#define Q8_GROUP_SCALES PANEL

/* One input of a block: the NR panels' weights at input k0 + KK, fed to MR rows' chains */
#define DQ_STEP(FMT, MR, NR, KK)                                                                             \
    {                                                                                                        \
        __m512 w[NR];                                                                                        \
        _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++) w[j] = FMT##_weights(c[j], KK, d[j], e[j]);     \
        _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) {                                              \
            const __m512 b = _mm512_set1_ps(x[i * K + k0 + (KK)]);                                           \
            _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++) acc[i * NR + j] =                           \
                _mm512_fmadd_ps(b, w[j], acc[i * NR + j]);                                                   \
        }                                                                                                    \
    }
#define Q4_STEPS(MR, NR) DQ_STEP(q4, MR, NR, 0) DQ_STEP(q4, MR, NR, 1) DQ_STEP(q4, MR, NR, 2)                 \
    DQ_STEP(q4, MR, NR, 3) DQ_STEP(q4, MR, NR, 4) DQ_STEP(q4, MR, NR, 5) DQ_STEP(q4, MR, NR, 6)              \
    DQ_STEP(q4, MR, NR, 7)
#define Q8_STEPS(MR, NR) DQ_STEP(q8, MR, NR, 0) DQ_STEP(q8, MR, NR, 1) DQ_STEP(q8, MR, NR, 2)                 \
    DQ_STEP(q8, MR, NR, 3)

/* One tile: MR rows against NR panels of codes, each block dequantized once in registers. FMT is
 * q4 or q8, FMT_UP Q4 or Q8 (its constants). */
#define DQ_TILE(FMT, FMT_UP, MR, NR)                                                                         \
    static void FMT##tile_##MR##_##NR(const float *x, long K, const uint8_t *codes, const uint16_t *scales,  \
                                      float *y, long N)                                                      \
    {                                                                                                        \
        __m512 acc[MR * NR];                                                                                 \
        _Pragma("GCC unroll 32") for (int i = 0; i < MR * NR; i++) acc[i] = _mm512_setzero_ps();             \
        const long pc = K * FMT_UP##_CODE_BYTES, psc = (K / GQ) * FMT_UP##_GROUP_SCALES; /* per panel */     \
        for (long g = 0; g < K / GQ; g++) {                                                                  \
            __m512 d[NR], e[NR];                                                                             \
            _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++)                                             \
                FMT##_scales(scales + j * psc + g * FMT_UP##_GROUP_SCALES, &d[j], &e[j]);                    \
            for (int blk = 0; blk < GQ / FMT_UP##_BLOCK; blk++) {                                            \
                const long k0 = g * GQ + blk * FMT_UP##_BLOCK;                                               \
                __m512i c[NR];                                                                               \
                _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++)                                         \
                    c[j] = _mm512_loadu_si512((const void *)(codes + j * pc + k0 * FMT_UP##_CODE_BYTES));    \
                FMT_UP##_STEPS(MR, NR)                                                                       \
            }                                                                                                \
        }                                                                                                    \
        _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++)                                                \
            _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++)                                             \
                _mm512_storeu_ps(y + i * N + j * PANEL, acc[i * NR + j]);                                    \
    }
#define Q4TILE(MR, NR) DQ_TILE(q4, Q4, MR, NR)
#define Q8TILE(MR, NR) DQ_TILE(q8, Q8, MR, NR)

/* the in-register tiles (rows, panels): registers hold MR * NR accumulators, 2 NR scales, NR code
 * vectors, NR weights and a broadcast */
#define DQ_MAXR 12
#define DQ_TILES(X) X(1, 4) X(2, 4) X(3, 3) X(4, 3) X(5, 2) X(6, 2) X(7, 2) X(8, 2) X(9, 2) X(10, 1)         \
    X(11, 1) X(12, 1) X(1, 1) X(2, 1) X(3, 1) X(4, 1) X(5, 1) X(6, 1) X(7, 1) X(8, 1) X(9, 1)
static const int DQ_NR_FOR[DQ_MAXR + 1] = {0, 4, 4, 3, 3, 2, 2, 2, 2, 2, 1, 1, 1};
DQ_TILES(Q4TILE)
DQ_TILES(Q8TILE)

typedef void (*dq_tile)(const float *, long, const uint8_t *, const uint16_t *, float *, long);
#define DQ_CASE(MR, NR) case (MR) * 16 + (NR): return q8 ? q8tile_##MR##_##NR : q4tile_##MR##_##NR;
static dq_tile dq_pick(int q8, int mr, int nr)
{
    switch (mr * 16 + nr) {
        DQ_TILES(DQ_CASE)
    }
    return 0;
}

/* nr panels' weights as skinny_gemm.c packs them: wp[j][k][0..15] (K * 16 floats a panel) */
#define DEQUANTIZE_PANELS(FMT, FMT_UP)                                                                       \
    static void FMT##_dequantize_panels(long K, const uint8_t *codes, const uint16_t *scales, int nr, float *wp) \
    {                                                                                                        \
        for (int j = 0; j < nr; j++)                                                                         \
            for (long g = 0; g < K / GQ; g++) {                                                              \
                __m512 d, e;                                                                                 \
                FMT##_scales(scales + (j * (K / GQ) + g) * FMT_UP##_GROUP_SCALES, &d, &e);                   \
                for (long k0 = g * GQ; k0 < (g + 1) * GQ; k0 += FMT_UP##_BLOCK) {                            \
                    const __m512i c = _mm512_loadu_si512((const void *)(codes + j * K * FMT_UP##_CODE_BYTES   \
                                                                        + k0 * FMT_UP##_CODE_BYTES));        \
                    for (int kk = 0; kk < FMT_UP##_BLOCK; kk++)                                              \
                        _mm512_storeu_ps(wp + (j * K + k0 + kk) * PANEL, FMT##_weights(c, kk, d, e));        \
                }                                                                                            \
            }                                                                                                \
    }
DEQUANTIZE_PANELS(q4, Q4)
DEQUANTIZE_PANELS(q8, Q8)

/* scratch floats skinny_gemm_dequant needs for M rows of K inputs: none for the in-register
 * tiles, else a pair of dequantized panels */
long skinny_dequant_scratch_floats(long M, long K) { return M <= DQ_MAXR ? 0 : 2 * K * PANEL + 16; }

/* y[M, N] = x[M, K] @ W[K, N], W as Q4_1 (q8 = 0) or Q8_0 (q8 = 1) codes and float16 scales in the
 * layouts above; x, y float32 contiguous; K % 32 == 0, N % 16 == 0; scratch from
 * skinny_dequant_scratch_floats. */
void skinny_gemm_dequant(int q8, const float *x, long M, long K, const uint8_t *codes, const uint16_t *scales,
                         long N, float *y, float *scratch)
{
    const long np = N / PANEL;
    const long pc = K * (q8 ? Q8_CODE_BYTES : Q4_CODE_BYTES), psc = (K / GQ) * (q8 ? Q8_GROUP_SCALES : Q4_GROUP_SCALES);
    if (M <= DQ_MAXR) {
        const int mr = (int)M, nr = DQ_NR_FOR[mr];
        const dq_tile wide = dq_pick(q8, mr, nr), one = dq_pick(q8, mr, 1);
        long p = 0;
        for (; p + nr <= np; p += nr) wide(x, K, codes + p * pc, scales + p * psc, y + p * PANEL, N);
        for (; p < np; p++) one(x, K, codes + p * pc, scales + p * psc, y + p * PANEL, N);
        return;
    }
    float *wp = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    for (long p = 0; p < np; p += NRBIG) {
        const int nr = p + NRBIG <= np ? NRBIG : 1;
        (q8 ? q8_dequantize_panels : q4_dequantize_panels)(K, codes + p * pc, scales + p * psc, nr, wp);
        for (long m0 = 0; m0 < M; m0 += MAXR) {
            const int mr = M - m0 < MAXR ? (int)(M - m0) : MAXR;
            run_tile(x + m0 * K, K, wp, y + m0 * N + p * PANEL, N, mr, nr);
        }
        if (nr == 1) p += 1 - NRBIG;
    }
}
