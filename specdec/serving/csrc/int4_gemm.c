/* 4-bit and 8-bit weights against 8- or 16-bit activations, for drafts on CPUs with AVX-512 VNNI:
 * y[M, N] = x[M, K] @ W[K, N], with W stored in few bits and x quantized here per row and group.
 *
 * Compiled as part of fused_int4.c (which includes it) by specdec/serving/cpu_gemm.py
 * (-O3 -march=native), called through ctypes, single-threaded. A draft needs no exactness (the target checks every token), only agreement
 * with the target and speed; this is llama.cpp's Q4_1 x Q8_1 arithmetic, on vpdpbusd.
 *
 * Activations: each row is cut into groups of G = 32 inputs; a group's scale is its largest
 * |x| / 127, and x is rounded to int8 codes xq with it (xq_sum = the group's sum of codes).
 * With 16-bit activations (xbits = 16) the scale is |x|max / 32767 and each code is kept as a
 * signed high byte xh and an unsigned low byte xl (code = 256 xh + xl): every dot product is
 * two vpdpbusd, the weights' unsigned codes against xh and xl against the weights' codes taken
 * as signed (4-bit codes are 0..15; an 8-bit code c + 128 is flipped back to c). An int8
 * activation's rounding is what parts an int4 copy of a model from its float32 self (BENCHMARKS
 * §6q); at 16 bits it is below float32's other roundings.
 *
 * Int4 weights (the Q4_1 grid): per group of 32 inputs and per output n, w = d * q + lo with
 * q in 0..15, d and lo in float16 (as a Q4_1 GGUF stores them). Then sum_k w x = sum_groups sx * (d * sum_k q xq + lo * xq_sum).
 * Int8 weights (an output head, one scale per output): w = s * c with c in -127..127, stored
 * as c + 128 (unsigned); sum_k w x = s * sum_groups sx * (sum_k (c + 128) xq - 128 * xq_sum).
 * Q8_0 weights (an output head as a GGUF stores it): the int8 layout, with a float16 scale per
 * group of 32 inputs and output, w = d * c: sum_k w x = sum_groups d * sx * sum_k c xq.
 *
 * Layouts, panels of 16 outputs (one 512-bit vector of int32 lanes):
 *   int4 codes: per panel, per block of 8 inputs, 64 bytes: byte 4n + t holds q[k0 + t][n] in its
 *     low nibble and q[k0 + 4 + t][n] in its high nibble (t = 0..3): one vpdpbusd per nibble half;
 *   int4 scales: per panel, per group, 32 float16: d[0..15] then lo[0..15];
 *   int8 codes: per panel, per block of 4 inputs, 64 bytes: byte 4n + t = c[k0 + t][n] + 128;
 *   int8 scales: [N] floats;
 *   q8_0 scales: per panel, per group, 16 float16.
 * Every output is computed the same way whatever M and the tiling: the results do not depend on
 * the rows beside it.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VNNI__)
#error "int4_gemm.c needs AVX-512 with VNNI"
#endif

#define G 32      /* inputs per activation group (and per int4 weight group) */
#define PANEL 16  /* outputs per panel */
#define MAXR 6    /* rows per tile */

/* x [M, K] (float32, or bfloat16 when x_bf16) -> codes per group of G, scale sx [M, K/G] and
 * xs [M, K/G] = sx * (sum of the group's codes). xbits 8: xq [M, K] int8. xbits 16: xq [M, K] the
 * codes' signed high bytes, xl [M, K] their low bytes, hs [M, K/G] the sum of the group's high bytes. */
static void quantize_rows(const void *x, int x_bf16, long M, long K, int xbits, int8_t *xq, uint8_t *xl, float *sx,
                          float *xs, int32_t *hs)
{
    const long ng = K / G;
    const float top = xbits == 16 ? 32767.0f : 127.0f;
    for (long m = 0; m < M; m++) {
        for (long g = 0; g < ng; g++) {
            __m512 v[2];
            for (int h = 0; h < 2; h++) {
                const long off = m * K + g * G + h * 16;
                if (x_bf16) {
                    __m256i b = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + off));
                    v[h] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
                } else {
                    v[h] = _mm512_loadu_ps((const float *)x + off);
                }
            }
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
            const float s = amax / top, inv = amax > 0.0f ? top / amax : 0.0f;
            int sum = 0, hsum = 0;
            for (int h = 0; h < 2; h++) {
                const long off = m * K + g * G + h * 16;
                __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], _mm512_set1_ps(inv))); /* round to nearest */
                sum += _mm512_reduce_add_epi32(q);
                if (xbits == 16) {
                    const __m512i hi = _mm512_srai_epi32(q, 8);
                    hsum += _mm512_reduce_add_epi32(hi);
                    _mm_storeu_si128((__m128i *)(xq + off), _mm512_cvtepi32_epi8(hi));
                    _mm_storeu_si128((__m128i *)(xl + off), _mm512_cvtepi32_epi8(_mm512_and_si512(q, _mm512_set1_epi32(255))));
                } else {
                    _mm_storeu_si128((__m128i *)(xq + off), _mm512_cvtsepi32_epi8(q));
                }
            }
            sx[m * ng + g] = s;
            xs[m * ng + g] = s * (float)sum;
            hs[m * ng + g] = xbits == 16 ? hsum : sum; /* the sum of the codes in xq */
        }
    }
}

static inline void store_row(void *y, int y_bf16, long off, __m512 v)
{
    if (y_bf16) { /* round to nearest even */
        __m512i u = _mm512_castps_si512(v);
        __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
        _mm256_storeu_si256((__m256i *)((uint16_t *)y + off), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
    } else {
        _mm512_storeu_ps((float *)y + off, v);
    }
}

/* int4: one tile of MR rows x NR panels, against XB-bit activations */
#define TILE4(MR, NR, XB)                                                                                    \
    static void t4x##XB##_##MR##_##NR(const int8_t *xq, const uint8_t *xl, const float *sx, const float *xs,  \
                                      const int32_t *hs, long K, const uint8_t *wq, const void *ws, void *y,  \
                                      int y_bf16, long N)                                                    \
    {                                                                                                        \
        (void)hs; (void)xl;                                                                                  \
        const long ng = K / G, pq = K * 8, pw = ng * 2 * PANEL;                                              \
        const __m512i lowmask = _mm512_set1_epi8(0x0F);                                                      \
        __m512 acc[MR * NR];                                                                                 \
        _Pragma("GCC unroll 32") for (int i = 0; i < MR * NR; i++) acc[i] = _mm512_setzero_ps();            \
        for (long g = 0; g < ng; g++) {                                                                      \
            __m512i dot[MR * NR], dotl[MR * NR];                                                             \
            _Pragma("GCC unroll 32") for (int i = 0; i < MR * NR; i++) dot[i] = dotl[i] = _mm512_setzero_si512(); \
            _Pragma("GCC unroll 4") for (int b = 0; b < G / 8; b++) {                                        \
                const long kb = g * G + b * 8;                                                               \
                __m512i b0[MR], b1[MR], l0[MR], l1[MR];                                                      \
                _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) {                                       \
                    int32_t a0, a1;                                                                          \
                    memcpy(&a0, xq + i * K + kb, 4);                                                         \
                    memcpy(&a1, xq + i * K + kb + 4, 4);                                                     \
                    b0[i] = _mm512_set1_epi32(a0);                                                           \
                    b1[i] = _mm512_set1_epi32(a1);                                                           \
                    if (XB == 16) {                                                                          \
                        memcpy(&a0, xl + i * K + kb, 4);                                                     \
                        memcpy(&a1, xl + i * K + kb + 4, 4);                                                 \
                        l0[i] = _mm512_set1_epi32(a0);                                                       \
                        l1[i] = _mm512_set1_epi32(a1);                                                       \
                    }                                                                                        \
                }                                                                                            \
                _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++) {                                       \
                    const __m512i c = _mm512_loadu_si512(wq + j * pq + kb * 8);                              \
                    const __m512i lo = _mm512_and_si512(c, lowmask);                                         \
                    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(c, 4), lowmask);                   \
                    _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) {                                   \
                        dot[i * NR + j] = _mm512_dpbusd_epi32(dot[i * NR + j], lo, b0[i]);                   \
                        dot[i * NR + j] = _mm512_dpbusd_epi32(dot[i * NR + j], hi, b1[i]);                   \
                        if (XB == 16) { /* the low bytes unsigned, the 4-bit codes as signed */              \
                            dotl[i * NR + j] = _mm512_dpbusd_epi32(dotl[i * NR + j], l0[i], lo);             \
                            dotl[i * NR + j] = _mm512_dpbusd_epi32(dotl[i * NR + j], l1[i], hi);             \
                        }                                                                                    \
                    }                                                                                        \
                }                                                                                            \
            }                                                                                                \
            _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++) {                                           \
                const uint16_t *s16 = (const uint16_t *)ws + j * pw + g * 2 * PANEL;                         \
                const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)s16));                  \
                const __m512 mins = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s16 + PANEL)));     \
                _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) {                                       \
                    __m512i dd = dot[i * NR + j];                                                            \
                    if (XB == 16)                                                                            \
                        dd = _mm512_add_epi32(_mm512_slli_epi32(dd, 8), dotl[i * NR + j]);                   \
                    const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(sx[i * ng + g]));                      \
                    acc[i * NR + j] = _mm512_fmadd_ps(ds, _mm512_cvtepi32_ps(dd), acc[i * NR + j]);          \
                    acc[i * NR + j] = _mm512_fmadd_ps(mins, _mm512_set1_ps(xs[i * ng + g]), acc[i * NR + j]);  \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++)                                                 \
            _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++) store_row(y, y_bf16, i * N + j * PANEL, acc[i * NR + j]); \
    }

/* int8 with a scale per output: one tile of MR rows x NR panels, against 8-bit activations */
#define TILE8(MR, NR)                                                                                        \
    static void t8_##MR##_##NR(const int8_t *xq, const uint8_t *xl, const float *sx, const float *xs,         \
                               const int32_t *hs, long K, const uint8_t *wq, const void *ws_, void *y,        \
                               int y_bf16, long N)                                                           \
    {                                                                                                        \
        (void)hs; (void)xl;                                                                                  \
        const long ng = K / G, pq = K * PANEL;                                                               \
        const float *ws = (const float *)ws_;                                                                \
        __m512 acc[MR * NR];                                                                                 \
        _Pragma("GCC unroll 32") for (int i = 0; i < MR * NR; i++) acc[i] = _mm512_setzero_ps();            \
        float corr[MR];                                                                                      \
        _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) corr[i] = 0.0f;                                 \
        for (long g = 0; g < ng; g++) {                                                                      \
            __m512i dot[MR * NR];                                                                            \
            _Pragma("GCC unroll 32") for (int i = 0; i < MR * NR; i++) dot[i] = _mm512_setzero_si512();     \
            _Pragma("GCC unroll 8") for (int b = 0; b < G / 4; b++) {                                        \
                const long kb = g * G + b * 4;                                                               \
                __m512i c[NR];                                                                               \
                _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++) c[j] = _mm512_loadu_si512(wq + j * pq + kb * PANEL); \
                _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) {                                       \
                    int32_t a;                                                                               \
                    memcpy(&a, xq + i * K + kb, 4);                                                          \
                    const __m512i bb = _mm512_set1_epi32(a);                                                 \
                    _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++)                                     \
                        dot[i * NR + j] = _mm512_dpbusd_epi32(dot[i * NR + j], c[j], bb);                    \
                }                                                                                            \
            }                                                                                                \
            _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) {                                           \
                const __m512 s = _mm512_set1_ps(sx[i * ng + g]);                                             \
                corr[i] += 128.0f * xs[i * ng + g];                                                          \
                _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++)                                         \
                    acc[i * NR + j] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(dot[i * NR + j]), acc[i * NR + j]); \
            }                                                                                                \
        }                                                                                                    \
        _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++)                                                 \
            _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++) {                                           \
                const __m512 s = _mm512_loadu_ps(ws + j * PANEL);                                            \
                store_row(y, y_bf16, i * N + j * PANEL,                                                      \
                          _mm512_mul_ps(s, _mm512_sub_ps(acc[i * NR + j], _mm512_set1_ps(corr[i]))));         \
            }                                                                                                \
    }

/* Q8_0: one tile of MR rows x NR panels, against XB-bit activations */
#define TILEQ8(MR, NR, XB)                                                                                   \
    static void q8x##XB##_##MR##_##NR(const int8_t *xq, const uint8_t *xl, const float *sx, const float *xs,  \
                                      const int32_t *hs, long K, const uint8_t *wq, const void *ws, void *y,  \
                                      int y_bf16, long N)                                                    \
    {                                                                                                        \
        (void)xs; (void)xl;                                                                                  \
        const long ng = K / G, pq = K * PANEL, pw = ng * PANEL;                                              \
        const __m512i flip = _mm512_set1_epi8((char)0x80);                                                   \
        __m512 acc[MR * NR];                                                                                 \
        _Pragma("GCC unroll 32") for (int i = 0; i < MR * NR; i++) acc[i] = _mm512_setzero_ps();            \
        for (long g = 0; g < ng; g++) {                                                                      \
            __m512i dot[MR * NR], dotl[MR * NR];                                                             \
            _Pragma("GCC unroll 32") for (int i = 0; i < MR * NR; i++) dot[i] = dotl[i] = _mm512_setzero_si512(); \
            _Pragma("GCC unroll 8") for (int b = 0; b < G / 4; b++) {                                        \
                const long kb = g * G + b * 4;                                                               \
                __m512i c[NR], cs[NR];                                                                       \
                _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++) {                                       \
                    c[j] = _mm512_loadu_si512(wq + j * pq + kb * PANEL);                                     \
                    if (XB == 16) cs[j] = _mm512_xor_si512(c[j], flip); /* c + 128 -> c, signed */           \
                }                                                                                            \
                _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) {                                       \
                    int32_t a;                                                                               \
                    memcpy(&a, xq + i * K + kb, 4);                                                          \
                    const __m512i bb = _mm512_set1_epi32(a);                                                 \
                    _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++)                                     \
                        dot[i * NR + j] = _mm512_dpbusd_epi32(dot[i * NR + j], c[j], bb);                    \
                    if (XB == 16) {                                                                          \
                        memcpy(&a, xl + i * K + kb, 4);                                                      \
                        const __m512i bl = _mm512_set1_epi32(a);                                             \
                        _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++)                                 \
                            dotl[i * NR + j] = _mm512_dpbusd_epi32(dotl[i * NR + j], bl, cs[j]);             \
                    }                                                                                        \
                }                                                                                            \
            }                                                                                                \
            _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++) {                                           \
                const __m512 d = _mm512_cvtph_ps(                                                            \
                    _mm256_loadu_si256((const __m256i *)((const uint16_t *)ws + j * pw + g * PANEL)));       \
                _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) {                                       \
                    /* sum c x = sum (c + 128) xq - 128 sum xq, in int32 */                                  \
                    __m512i dd = _mm512_sub_epi32(dot[i * NR + j], _mm512_set1_epi32(128 * hs[i * ng + g])); \
                    if (XB == 16)                                                                            \
                        dd = _mm512_add_epi32(_mm512_slli_epi32(dd, 8), dotl[i * NR + j]);                   \
                    acc[i * NR + j] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(sx[i * ng + g])),       \
                                                      _mm512_cvtepi32_ps(dd), acc[i * NR + j]);              \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++)                                                 \
            _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++) store_row(y, y_bf16, i * N + j * PANEL, acc[i * NR + j]); \
    }

/* Tiles of one panel (NR = 1): a tile reads its codes as one contiguous stream. Side by side
 * panels (up to 8 for one row: 8 streams a panel's length apart) measured slower: one pass over
 * the default draft's 30 layers of 4-bit matrices, 1 row 3.00 against 2.39 ms, 4 rows 3.57
 * against 2.95, 9 rows 6.74 against 6.41 (one thread, best of 7 medians; the int8 head the same
 * either way). */
#define TILES(T, ...) T(1, 1 __VA_ARGS__) T(2, 1 __VA_ARGS__) T(3, 1 __VA_ARGS__) T(4, 1 __VA_ARGS__) \
    T(5, 1 __VA_ARGS__) T(6, 1 __VA_ARGS__)
TILES(TILE4, , 8)
TILES(TILE4, , 16)
TILES(TILE8)
TILES(TILEQ8, , 8)
TILES(TILEQ8, , 16)

/* weight formats (cpu_gemm.py's LOWBIT_*) */
#define W_Q4_1 4   /* 4-bit codes, float16 d and lo per group of 32 inputs */
#define W_I8_ROW 8 /* 8-bit codes, a float32 scale per output */
#define W_Q8_0 9   /* 8-bit codes, a float16 scale per group of 32 inputs */

typedef void (*tile_fn)(const int8_t *, const uint8_t *, const float *, const float *, const int32_t *, long,
                        const uint8_t *, const void *, void *, int, long);
#define CASE(P, MR) case MR: return P##_##MR##_1;
#define CASES(P) CASE(P, 1) CASE(P, 2) CASE(P, 3) CASE(P, 4) CASE(P, 5) CASE(P, 6)
/* the one-panel tile of mr rows (1..MAXR) for a weight format and activation bits, or 0 */
static tile_fn pick(int fmt, int xbits, int mr)
{
    if (fmt == W_Q4_1 && xbits == 8) {
        switch (mr) { CASES(t4x8) }
    } else if (fmt == W_Q4_1 && xbits == 16) {
        switch (mr) { CASES(t4x16) }
    } else if (fmt == W_I8_ROW && xbits == 8) {
        switch (mr) { CASES(t8) }
    } else if (fmt == W_Q8_0 && xbits == 8) {
        switch (mr) { CASES(q8x8) }
    } else if (fmt == W_Q8_0 && xbits == 16) {
        switch (mr) { CASES(q8x16) }
    }
    return 0;
}

/* scratch for the quantized activations: xq and xl [M, K] bytes each, then sx, xs and hs [M, K/G] */
long lowbit_scratch_bytes(long M, long K) { return 2 * M * K + 3 * M * (K / G) * 4 + 128; }

/* fmt W_Q4_1, W_I8_ROW or W_Q8_0; xbits 8 or 16 (W_I8_ROW: 8 only); wq, ws as in the header
 * (ws: float16, float32 for W_I8_ROW); x [M, K]; y [M, N]; K % 32 == 0, N % 16 == 0.
 * Returns 0, or -1 for a combination it does not take. */
int lowbit_gemm(int fmt, int xbits, const void *x, int x_bf16, long M, long K, const uint8_t *wq, const void *ws,
                long N, void *y, int y_bf16, void *scratch)
{
    if (!pick(fmt, xbits, 1))
        return -1;
    const long ng = K / G;
    int8_t *xq = (int8_t *)scratch;
    uint8_t *xl = (uint8_t *)(xq + M * K);
    float *sx = (float *)(((uintptr_t)(xl + M * K) + 63) & ~(uintptr_t)63);
    float *xs = sx + M * ng;
    int32_t *hs = (int32_t *)(xs + M * ng);
    quantize_rows(x, x_bf16, M, K, xbits, xq, xl, sx, xs, hs);
    const long np = N / PANEL;
    const long pq = fmt == W_Q4_1 ? K * 8 : K * PANEL;                                       /* code bytes per panel */
    const long pw = fmt == W_Q4_1 ? ng * 2 * PANEL : fmt == W_Q8_0 ? ng * PANEL : PANEL;    /* scales per panel */
    const long sb = fmt == W_I8_ROW ? 4 : 2;                                                 /* bytes per scale */
    for (long p = 0; p < np; p++) /* a panel stays in cache while every row tile passes */
        for (long m0 = 0; m0 < M; m0 += MAXR) {
            const int mr = M - m0 < MAXR ? (int)(M - m0) : MAXR;
            pick(fmt, xbits, mr)(xq + m0 * K, xl + m0 * K, sx + m0 * ng, xs + m0 * ng, hs + m0 * ng, K, wq + p * pq,
                                 (const char *)ws + p * pw * sb, (char *)y + (m0 * N + p * PANEL) * (y_bf16 ? 2 : 4),
                                 y_bf16, N);
        }
    return 0;
}
