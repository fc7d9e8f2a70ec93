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
 * Few rows (M <= MAXR, a decode or a verify): one tile dequantizes each block of codes once, in
 * registers, and feeds it to every row. Many rows (a prefill): a pair of panels is dequantized
 * into a buffer that skinny_gemm.c's tiles then read for every row tile.
 */
#include <stdint.h>

#include "skinny_gemm.c"

#if !defined(__AVX512F__)
#error "skinny_dequant.c needs AVX-512"
#endif

#define GQ 32 /* inputs per scale group */

/* Q4_1 block: the 8 inputs k0..k0+7 of NR panels, dequantized one input at a time, each fed to MR rows */
#define Q4_STEP(MR, NR, KK)                                                                                  \
    {                                                                                                        \
        const int sh = 8 * ((KK) & 3) + 4 * ((KK) >> 2);                                                     \
        __m512 w[NR];                                                                                        \
        _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++) w[j] = _mm512_fmadd_ps(                         \
            _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(c[j], sh), nib)), d[j], lo[j]);            \
        _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) {                                              \
            const __m512 b = _mm512_set1_ps(x[i * K + k0 + (KK)]);                                           \
            _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++) acc[i * NR + j] =                           \
                _mm512_fmadd_ps(b, w[j], acc[i * NR + j]);                                                   \
        }                                                                                                    \
    }

#define Q4TILE(MR, NR)                                                                                       \
    static void q4tile_##MR##_##NR(const float *x, long K, const uint8_t *codes, const uint16_t *scales,      \
                                   float *y, long N)                                                         \
    {                                                                                                        \
        __m512 acc[MR * NR];                                                                                 \
        _Pragma("GCC unroll 32") for (int i = 0; i < MR * NR; i++) acc[i] = _mm512_setzero_ps();             \
        const long pc = K * 8, psc = (K / GQ) * 2 * PANEL; /* code bytes, scales per panel */                \
        const __m512i nib = _mm512_set1_epi32(15);                                                           \
        for (long g = 0; g < K / GQ; g++) {                                                                  \
            __m512 d[NR], lo[NR];                                                                            \
            _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++) {                                           \
                const uint16_t *s = scales + j * psc + g * 2 * PANEL;                                        \
                d[j] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)s));                              \
                lo[j] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + PANEL)));                   \
            }                                                                                                \
            for (int blk = 0; blk < GQ / 8; blk++) {                                                         \
                const long k0 = g * GQ + blk * 8;                                                            \
                __m512i c[NR];                                                                               \
                _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++)                                         \
                    c[j] = _mm512_loadu_si512((const void *)(codes + j * pc + k0 * 8));                      \
                Q4_STEP(MR, NR, 0) Q4_STEP(MR, NR, 1) Q4_STEP(MR, NR, 2) Q4_STEP(MR, NR, 3)                  \
                Q4_STEP(MR, NR, 4) Q4_STEP(MR, NR, 5) Q4_STEP(MR, NR, 6) Q4_STEP(MR, NR, 7)                  \
            }                                                                                                \
        }                                                                                                    \
        _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++)                                                \
            _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++)                                             \
                _mm512_storeu_ps(y + i * N + j * PANEL, acc[i * NR + j]);                                    \
    }

/* Q8_0 block: the 4 inputs k0..k0+3; w = fma(c + 128, d, -128 d) = d * c, exact */
#define Q8_STEP(MR, NR, KK)                                                                                  \
    {                                                                                                        \
        __m512 w[NR];                                                                                        \
        _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++) w[j] = _mm512_fmadd_ps(                         \
            _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(c[j], 8 * (KK)), byte)), d[j], nd[j]);     \
        _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) {                                              \
            const __m512 b = _mm512_set1_ps(x[i * K + k0 + (KK)]);                                           \
            _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++) acc[i * NR + j] =                           \
                _mm512_fmadd_ps(b, w[j], acc[i * NR + j]);                                                   \
        }                                                                                                    \
    }

#define Q8TILE(MR, NR)                                                                                       \
    static void q8tile_##MR##_##NR(const float *x, long K, const uint8_t *codes, const uint16_t *scales,      \
                                   float *y, long N)                                                         \
    {                                                                                                        \
        __m512 acc[MR * NR];                                                                                 \
        _Pragma("GCC unroll 32") for (int i = 0; i < MR * NR; i++) acc[i] = _mm512_setzero_ps();             \
        const long pc = K * PANEL, psc = (K / GQ) * PANEL;                                                   \
        const __m512i byte = _mm512_set1_epi32(255);                                                         \
        const __m512 m128 = _mm512_set1_ps(-128.0f);                                                         \
        for (long g = 0; g < K / GQ; g++) {                                                                  \
            __m512 d[NR], nd[NR];                                                                            \
            _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++) {                                           \
                d[j] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + j * psc + g * PANEL))); \
                nd[j] = _mm512_mul_ps(d[j], m128);                                                           \
            }                                                                                                \
            for (int blk = 0; blk < GQ / 4; blk++) {                                                         \
                const long k0 = g * GQ + blk * 4;                                                            \
                __m512i c[NR];                                                                               \
                _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++)                                         \
                    c[j] = _mm512_loadu_si512((const void *)(codes + j * pc + k0 * PANEL));                  \
                Q8_STEP(MR, NR, 0) Q8_STEP(MR, NR, 1) Q8_STEP(MR, NR, 2) Q8_STEP(MR, NR, 3)                  \
            }                                                                                                \
        }                                                                                                    \
        _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++)                                                \
            _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++)                                             \
                _mm512_storeu_ps(y + i * N + j * PANEL, acc[i * NR + j]);                                    \
    }

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
static void dequantize_panels(int q8, long K, const uint8_t *codes, const uint16_t *scales, int nr, float *wp)
{
    for (int j = 0; j < nr; j++) {
        float *out = wp + j * K * PANEL;
        if (q8) {
            const uint8_t *pcodes = codes + j * K * PANEL;
            const uint16_t *ps = scales + j * (K / GQ) * PANEL;
            for (long k0 = 0; k0 < K; k0 += 4) {
                const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ps + (k0 / GQ) * PANEL)));
                const __m512 nd = _mm512_mul_ps(d, _mm512_set1_ps(-128.0f));
                const __m512i c = _mm512_loadu_si512((const void *)(pcodes + k0 * PANEL));
                for (int t = 0; t < 4; t++)
                    _mm512_storeu_ps(out + (k0 + t) * PANEL, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(
                        _mm512_srli_epi32(c, 8 * t), _mm512_set1_epi32(255))), d, nd));
            }
        } else {
            const uint8_t *pcodes = codes + j * K * 8;
            const uint16_t *ps = scales + j * (K / GQ) * 2 * PANEL;
            for (long k0 = 0; k0 < K; k0 += 8) {
                const uint16_t *s = ps + (k0 / GQ) * 2 * PANEL;
                const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)s));
                const __m512 lo = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + PANEL)));
                const __m512i c = _mm512_loadu_si512((const void *)(pcodes + k0 * 8));
                for (int kk = 0; kk < 8; kk++)
                    _mm512_storeu_ps(out + (k0 + kk) * PANEL, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(
                        _mm512_srli_epi32(c, 8 * (kk & 3) + 4 * (kk >> 2)), _mm512_set1_epi32(15))), d, lo));
            }
        }
    }
}

/* scratch floats skinny_gemm_dequant needs for K inputs: a pair of dequantized panels */
long skinny_dequant_scratch_floats(long K) { return 2 * K * PANEL + 16; }

/* y[M, N] = x[M, K] @ W[K, N], W as Q4_1 (q8 = 0) or Q8_0 (q8 = 1) codes and float16 scales in the
 * layouts above; x, y float32 contiguous; K % 32 == 0, N % 16 == 0; scratch from
 * skinny_dequant_scratch_floats (used only when M > DQ_MAXR). */
void skinny_gemm_dequant(int q8, const float *x, long M, long K, const uint8_t *codes, const uint16_t *scales,
                         long N, float *y, float *scratch)
{
    const long np = N / PANEL;
    const long pc = q8 ? K * PANEL : K * 8, psc = q8 ? (K / GQ) * PANEL : (K / GQ) * 2 * PANEL;
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
        dequantize_panels(q8, K, codes + p * pc, scales + p * psc, nr, wp);
        for (long m0 = 0; m0 < M; m0 += MAXR) {
            const int mr = M - m0 < MAXR ? (int)(M - m0) : MAXR;
            run_tile(x + m0 * K, K, wp, y + m0 * N + p * PANEL, N, mr, nr);
        }
        if (nr == 1) p += 1 - NRBIG;
    }
}
