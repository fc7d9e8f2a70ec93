/* Skinny fp32 matmul for CPU steps of few rows: y[M, N] = x[M, K] @ W[K, N].
 *
 * Built by specdec/serving/cpu_gemm.py for the machine it runs on (-O3 -march=native) and
 * called through ctypes. Single-threaded: each service runs its model on its own core.
 *
 * Why: a verify of k + 1 rows is a matmul with few rows. torch's fp32 matmul (MKL) costs
 * 2.7x a one-row step for 9 rows on the AMD EPYC VM measured (the default target's matrices:
 * 46.8 against 17.4 ms), where this kernel costs 1.7x (20.6 against 12.4), and it reads the
 * weights faster for one row too (BENCHMARKS.md §6o).
 *
 * Layout: W is packed once into panels of PANEL = 16 columns, panel p holding W[:, 16p:16p+16]
 * row after row: wp[p][k][0..15] (K * 16 floats per panel, contiguous). N % 16 == 0.
 *
 * Exactness: every output y[m, n] is ONE chain of fused multiply-adds over k = 0, 1, ..., K-1,
 * starting from 0, in one vector lane: no horizontal sum, no split of k. So its value does not
 * depend on M, on which rows share its tile, on the tile shape or on the vector width (the
 * AVX-512 and AVX2 builds give the same bits): a verify's rows equal one-row decodes, bit for bit.
 */
#include <immintrin.h>

#define PANEL 16

#if defined(__AVX512F__)
typedef __m512 vf;
#define VPP 1 /* vectors per panel */
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VSET1(s) _mm512_set1_ps(s)
#define VZERO() _mm512_setzero_ps()
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define MAXR 12 /* rows per tile: accumulators + panel loads + a broadcast fit 32 registers */
#define NRBIG 2 /* panels per tile when M > MAXR */
static const int NR_FOR[MAXR + 1] = {0, 8, 6, 4, 4, 4, 4, 3, 3, 2, 2, 2, 2};
#define ISA 512
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vf;
#define VPP 2
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VSET1(s) _mm256_set1_ps(s)
#define VZERO() _mm256_setzero_ps()
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define MAXR 6 /* 16 registers */
#define NRBIG 1
static const int NR_FOR[MAXR + 1] = {0, 4, 2, 2, 1, 1, 1};
#define ISA 256
#else
#error "skinny_gemm.c needs AVX2 with FMA, or AVX-512"
#endif
#define VW (PANEL / VPP) /* floats per vector */

/* One tile: rows x[0..MR) against panels wp[0..NR) -> y. A macro, so that MR and NR are literal
 * constants in each copy and the accumulators live in registers (an always_inline function with
 * constant arguments still declared its arrays as variable-length ones: 2.5x slower). */
#define TILE(MR, NR)                                                                                         \
    static void tile_##MR##_##NR(const float *x, long K, const float *wp, float *y, long N)                 \
    {                                                                                                        \
        vf acc[MR * NR * VPP];                                                                               \
        _Pragma("GCC unroll 32") for (int i = 0; i < MR * NR * VPP; i++) acc[i] = VZERO();                   \
        const long ps = K * PANEL;                                                                           \
        for (long k = 0; k < K; k++) {                                                                       \
            vf w[NR * VPP];                                                                                  \
            _Pragma("GCC unroll 32") for (int j = 0; j < NR * VPP; j++)                                      \
                w[j] = VLOAD(wp + (j / VPP) * ps + k * PANEL + (j % VPP) * VW);                              \
            _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) {                                          \
                const vf b = VSET1(x[i * K + k]);                                                            \
                _Pragma("GCC unroll 32") for (int j = 0; j < NR * VPP; j++)                                  \
                    acc[i * NR * VPP + j] = VFMA(b, w[j], acc[i * NR * VPP + j]);                            \
            }                                                                                                \
        }                                                                                                    \
        _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++)                                                \
            _Pragma("GCC unroll 32") for (int j = 0; j < NR * VPP; j++)                                      \
                VSTORE(y + i * N + (j / VPP) * PANEL + (j % VPP) * VW, acc[i * NR * VPP + j]);               \
    }

/* the tiles built (rows, panels): an X-macro, expanded once into functions and once into cases */
#if ISA == 512
#define TILES(X) X(1, 8) X(2, 6) X(3, 4) X(4, 4) X(5, 4) X(6, 4) X(7, 3) X(8, 3)                          \
    X(9, 2) X(10, 2) X(11, 2) X(12, 2)                                                                       \
    X(1, 2) X(2, 2) X(3, 2) X(4, 2) X(5, 2) X(6, 2) X(7, 2) X(8, 2)                                          \
    X(1, 1) X(2, 1) X(3, 1) X(4, 1) X(5, 1) X(6, 1) X(7, 1) X(8, 1) X(9, 1) X(10, 1) X(11, 1) X(12, 1)
#else
#define TILES(X) X(1, 4) X(2, 2) X(3, 2) X(1, 1) X(2, 1) X(3, 1) X(4, 1) X(5, 1) X(6, 1)
#endif
TILES(TILE)

#define CASE(MR, NR) case (MR) * 16 + (NR): tile_##MR##_##NR(x, K, wp, y, N); return;
static void run_tile(const float *x, long K, const float *wp, float *y, long N, int mr, int nr)
{
    switch (mr * 16 + nr) {
        TILES(CASE)
    }
}

int skinny_isa(void) { return ISA; }

/* x [M, K], wp the packed W (K x N), y [M, N]; all contiguous fp32, N % 16 == 0 */
void skinny_gemm_f32(const float *x, long M, long K, const float *wp, long N, float *y)
{
    const long np = N / PANEL, ps = K * PANEL;
    if (M <= MAXR) { /* one row tile: as many panels per tile as the registers allow */
        const int mr = (int)M, nr = NR_FOR[mr];
        long p = 0;
        for (; p + nr <= np; p += nr) run_tile(x, K, wp + p * ps, y + p * PANEL, N, mr, nr);
        for (; p < np; p++) run_tile(x, K, wp + p * ps, y + p * PANEL, N, mr, 1);
        return;
    }
    /* many rows: a column group's panels stay in cache while every row tile passes over them */
    long p = 0;
    for (; p < np; p += NRBIG) {
        const int nr = p + NRBIG <= np ? NRBIG : 1;
        for (long m0 = 0; m0 < M; m0 += MAXR) {
            const int mr = M - m0 < MAXR ? (int)(M - m0) : MAXR;
            run_tile(x + m0 * K, K, wp + p * ps, y + m0 * N + p * PANEL, N, mr, nr);
        }
        if (nr == 1) p += 1 - NRBIG;
    }
}
