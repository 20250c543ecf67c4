/* The syncer's round step as two loops over the fragment (see syncer/fused.py for the torch
 * version and the arithmetic; syncer/native/__init__.py builds and loads this file).
 *
 * Contributions are int4 or int8 codes with one fp32 scale per block, all with the same block.
 * int4 contributions stay packed as they came on the wire (codec format 2: byte k of a block's
 * block/2 bytes holds code k in its low nibble and code k + block/2 in its high one, two's
 * complement), `packed[m]` = 1; int8 ones are one code a byte, `packed[m]` = 0. Each loop
 * unpacks a block of every contribution into the L1 cache and uses it there: the fragment's
 * codes are never written out as int8. Segments are given by their bounds (S + 1 offsets,
 * 0 .. numel).
 *
 * dld_check:   what a receiver refuses: the int4 nibble 0b1000 (-8, never produced), a scale
 *              that is negative or makes some code * scale non-finite.
 * dld_gram:    G[s][m][n] = sum over segment s of v_m * v_n, v = code * scale: integer dot
 *              products of the codes per block, times the two scales; summed in double
 *              (exact but for the sums' rounding), or with AVX-512 VNNI in float lanes that
 *              move into the double sums every 32 blocks (relative error ~1e-7).
 * dld_publish: per output block: merged g = sum_m (coef[s][m] * scale_m) * code_m, Nesterov
 *              (momentum <- g + beta * momentum;
 *              residual <- residual - lr * g - lr * look * momentum; look = beta but for a
 *              round of part of a sync period, merge.partial_momentum), blockwise absmax
 *              quantization of the residual (round half to even by adding and subtracting
 *              1.5 * 2^23, as syncer/wire/quant.py), packing, then theta += code * scale and
 *              residual -= code * scale as two separate fp32 operations.
 * dld_crc32:   zlib's crc32 (of the new fragment), folded with carry-less multiplication.
 *
 * Build with -ffp-contract=off and without -ffast-math: theta must receive exactly the fp32
 * product a learner computes and adds (no fused multiply-add). The exported functions are
 * compiled once per instruction set (target_clones) with every helper inlined into them, so
 * each clone's loops are vectorized for its own registers; every result is elementwise IEEE
 * arithmetic or an integer sum, so all clones give the same bits.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_BLOCK 4096
#define MAX_M 256 /* contributions (pushes) a round step takes; their unpacked blocks are on the heap */
#define ROUNDER 12582912.0f /* 1.5 * 2^23 */

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && __GNUC__ >= 11
#define HOT __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#elif defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define HOT __attribute__((target_clones("avx2", "default")))
#else
#define HOT
#endif
#if defined(__GNUC__)
#define INLINE static inline __attribute__((always_inline))
#else
#define INLINE static inline
#endif
/* x86-64: the Gram matrices with AVX-512 VNNI (u8 x s8 dot products) and crc32 with PCLMULQDQ
 * where the CPU has them (checked at run time); older compilers build without them */
#if defined(__x86_64__) && ((defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 9) || __clang_major__ >= 10)
#include <immintrin.h>
#define X86 1
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))
#define CLMUL __attribute__((target("pclmul,sse4.1")))
#define MAX_M_VNNI 4
#else
#define X86 0
#endif

/* codes [0, block) of block b of one contribution: a pointer into an int8 payload, or the int4
 * block unpacked into `buf` */
INLINE const int8_t *block_codes(const uint8_t *src, int32_t packed, int64_t block, int64_t b,
                                 int8_t *restrict buf) {
    if (!packed) return (const int8_t *)src + b * block;
    int64_t half = block / 2;
    const uint8_t *restrict p = src + b * half;
    /* (x ^ 8) - 8 sign-extends a 4-bit x; + 0xf8 is - 8 modulo 256 */
    for (int64_t k = 0; k < half; k++) buf[k] = (int8_t)(uint8_t)(((p[k] & 15u) ^ 8u) + 0xf8u);
    for (int64_t k = 0; k < half; k++) buf[half + k] = (int8_t)(uint8_t)(((p[k] >> 4) ^ 8u) + 0xf8u);
    return buf;
}

/* codes [0, block) of block b as int16 (the width the dot products multiply at) */
INLINE void block_codes16(const uint8_t *src, int32_t packed, int64_t block, int64_t b, int16_t *restrict dst) {
    if (!packed) {
        const int8_t *restrict p = (const int8_t *)src + b * block;
        for (int64_t k = 0; k < block; k++) dst[k] = p[k];
        return;
    }
    int64_t half = block / 2;
    const uint8_t *restrict p = src + b * half;
    for (int64_t k = 0; k < half; k++) dst[k] = (int16_t)((int16_t)((p[k] & 15) ^ 8) - 8);
    for (int64_t k = 0; k < half; k++) dst[half + k] = (int16_t)((int16_t)((p[k] >> 4) ^ 8) - 8);
}

INLINE int32_t dot_i16(const int16_t *restrict a, const int16_t *restrict b, int64_t n) {
    int32_t acc = 0;
    for (int64_t k = 0; k < n; k++) acc += (int32_t)a[k] * (int32_t)b[k];
    return acc;
}

/* What a receiver checks of an int4/int8 payload, in one read: returns 1 if a nibble of the n
 * packed int4 bytes is 0b1000 (pass n = 0 for int8 codes), 2 if a scale times qmax is negative,
 * NaN or infinite (some code * scale would not be finite), 3 if both, else 0. */
HOT int dld_check(const float *restrict scales, int64_t nblocks, float qmax, const uint8_t *restrict packed,
                  int64_t n) {
    uint8_t bad = 0;
    for (int64_t k = 0; k < n; k++) {
        uint8_t v = packed[k];
        bad |= (uint8_t)(((v & 0x0fu) == 0x08u) | ((v & 0xf0u) == 0x80u));
    }
    int ok = 1;
    for (int64_t b = 0; b < nblocks; b++) {
        float t = scales[b] * qmax;
        ok &= (t >= 0.0f) & (t < INFINITY);
    }
    return (bad != 0) | (ok ? 0 : 2);
}

/* g (M x M, lower triangle) += the products of the codes (int16, unpacked: contribution m's at
 * v + m * stride) over [i, end) of block b: exact integer dots, times the two scales, in double */
INLINE void gram_piece(const int16_t *v, int64_t stride, const float **scales, int32_t m_count, int64_t b, int64_t i,
                       int64_t end, double *g) {
    for (int32_t m = 0; m < m_count; m++) {
        const int16_t *vm = v + m * stride;
        for (int32_t n = 0; n <= m; n++) {
            const int16_t *vn = v + n * stride;
            /* a whole block of the usual size: a constant trip count, fully unrolled */
            int32_t dot = i == 0 && end == 128 ? dot_i16(vm, vn, 128) : dot_i16(vm + i, vn + i, end - i);
            g[m * m_count + n] += (double)scales[m][b] * (double)scales[n][b] * (double)dot;
        }
    }
}

/* Any block size, any mix of int4 and int8: block by block, piece by piece (lower triangles).
 * Returns 0, or -2 if the unpacked blocks (M x block int16) could not be allocated. */
HOT static int gram_generic(const uint8_t **codes, const int32_t *packed, const float **scales, int32_t m_count,
                            int64_t block, const int64_t *bounds, int32_t s_count, double *out) {
    int16_t *v = malloc((size_t)m_count * (size_t)block * sizeof(int16_t));
    if (v == NULL) return -2;
    int64_t numel = bounds[s_count];
    int32_t s = 0;
    for (int64_t b = 0, b0 = 0; b0 < numel; b++, b0 += block) {
        int64_t len = numel - b0 < block ? numel - b0 : block;
        for (int32_t m = 0; m < m_count; m++) block_codes16(codes[m], packed[m], block, b, v + m * block);
        for (int64_t i = 0; i < len;) {
            while (bounds[s + 1] <= b0 + i) s++;
            int64_t end = bounds[s + 1] - b0 < len ? bounds[s + 1] - b0 : len;
            gram_piece(v, block, scales, m_count, b, i, end, out + (int64_t)s * m_count * m_count);
            i = end;
        }
    }
    free(v);
    return 0;
}

#if X86
#define FLUSH 32 /* blocks a float lane sum holds before it moves into the double total */

/* block b (128 codes) of one contribution as unsigned (code + 8 for int4, + 128 for int8) and
 * signed bytes: [0] codes 0..63, [1] codes 64..127 */
VNNI INLINE void codes_vnni(const uint8_t *src, int32_t packed, int64_t b, __m512i *u, __m512i *s) {
    if (packed) {
        const __m512i low = _mm512_set1_epi8(0x0f), eight = _mm512_set1_epi8(8);
        __m512i p = _mm512_loadu_si512(src + b * 64);
        u[0] = _mm512_xor_si512(_mm512_and_si512(p, low), eight); /* nibble ^ 8 = code + 8 */
        u[1] = _mm512_xor_si512(_mm512_and_si512(_mm512_srli_epi16(p, 4), low), eight);
        s[0] = _mm512_sub_epi8(u[0], eight);
        s[1] = _mm512_sub_epi8(u[1], eight);
    } else {
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        s[0] = _mm512_loadu_si512(src + b * 128);
        s[1] = _mm512_loadu_si512(src + b * 128 + 64);
        u[0] = _mm512_xor_si512(s[0], flip); /* code + 128 */
        u[1] = _mm512_xor_si512(s[1], flip);
    }
}

/* g (lower triangle) += the Gram of the whole blocks [b_lo, b_hi) of M (a constant once inlined)
 * contributions, all int4 or all int8: per pair and block two u8 x s8 dot instructions give 16
 * lane sums of (code_m + off) * code_n, off * (lane sums of code_n) comes off, and the lanes are
 * scaled into float accumulators that stay in registers (FLUSH blocks, then summed in double) */
VNNI INLINE void gram_blocks_vnni(const uint8_t **codes, int32_t packed, const float **scales, const int32_t M,
                                  int64_t b_lo, int64_t b_hi, double *g) {
    const __m512i ones = _mm512_set1_epi8(1), zero = _mm512_setzero_si512();
    const __m128i shift = _mm_cvtsi32_si128(packed ? 3 : 7);
    __m512 acc[MAX_M_VNNI * (MAX_M_VNNI + 1) / 2];
    for (int64_t start = b_lo; start < b_hi; start += FLUSH) {
        int64_t stop = b_hi - start < FLUSH ? b_hi : start + FLUSH;
        for (int32_t p = 0; p < M * (M + 1) / 2; p++) acc[p] = _mm512_setzero_ps();
        for (int64_t b = start; b < stop; b++) {
            __m512i u[MAX_M_VNNI][2], s[MAX_M_VNNI][2], c[MAX_M_VNNI];
            for (int32_t m = 0; m < M; m++) /* 8 blocks ahead: the codes come from L3 or memory */
                _mm_prefetch((const char *)codes[m] + (b + 8) * (packed ? 64 : 128), _MM_HINT_T0);
            for (int32_t m = 0; m < M; m++) {
                codes_vnni(codes[m], packed, b, u[m], s[m]);
                __m512i sums = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, ones, s[m][0]), ones, s[m][1]);
                c[m] = _mm512_sll_epi32(sums, shift); /* off * lane sums */
            }
            for (int32_t m = 0, p = 0; m < M; m++) {
                for (int32_t n = 0; n <= m; n++, p++) {
                    __m512i d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, u[m][0], s[n][0]), u[m][1], s[n][1]);
                    __m512 k = _mm512_set1_ps(scales[m][b] * scales[n][b]);
                    acc[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(d, c[n])), k, acc[p]);
                }
            }
        }
        for (int32_t m = 0, p = 0; m < M; m++) {
            for (int32_t n = 0; n <= m; n++, p++) {
                __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(acc[p]));
                __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[p]), 1)));
                g[m * M + n] += _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
            }
        }
    }
}

/* block 128, at most MAX_M_VNNI contributions, all int4 or all int8: the whole blocks of each
 * segment by gram_blocks_vnni, the pieces of blocks it shares with a neighbour by gram_piece */
VNNI static void gram_vnni(const uint8_t **codes, int32_t packed, const float **scales, int32_t m_count,
                           const int64_t *bounds, int32_t s_count, double *out) {
    int16_t v[MAX_M_VNNI * 128];
    for (int32_t s = 0; s < s_count; s++) {
        int64_t lo = bounds[s], hi = bounds[s + 1], first = (lo + 127) / 128, last = hi / 128;
        double *g = out + (int64_t)s * m_count * m_count;
        if (hi <= lo) continue;
        if (first > last) { /* inside one block */
            for (int32_t m = 0; m < m_count; m++) block_codes16(codes[m], packed, 128, last, v + m * 128);
            gram_piece(v, 128, scales, m_count, last, lo - last * 128, hi - last * 128, g);
            continue;
        }
        if (lo < first * 128) {
            for (int32_t m = 0; m < m_count; m++) block_codes16(codes[m], packed, 128, first - 1, v + m * 128);
            gram_piece(v, 128, scales, m_count, first - 1, lo - (first - 1) * 128, 128, g);
        }
        switch (m_count) { /* M a constant: the accumulators are registers */
        case 1: gram_blocks_vnni(codes, packed, scales, 1, first, last, g); break;
        case 2: gram_blocks_vnni(codes, packed, scales, 2, first, last, g); break;
        case 3: gram_blocks_vnni(codes, packed, scales, 3, first, last, g); break;
        default: gram_blocks_vnni(codes, packed, scales, 4, first, last, g); break;
        }
        if (hi > last * 128) {
            for (int32_t m = 0; m < m_count; m++) block_codes16(codes[m], packed, 128, last, v + m * 128);
            gram_piece(v, 128, scales, m_count, last, 0, hi - last * 128, g);
        }
    }
}

/* whether gram_vnni takes these contributions on this CPU */
static int vnni_fits(const int32_t *packed, int32_t m_count, int64_t block) {
    if (block != 128 || m_count > MAX_M_VNNI) return 0;
    for (int32_t m = 1; m < m_count; m++)
        if (packed[m] != packed[0]) return 0;
    return __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
}
#endif

/* out: S * M * M doubles, zeroed by the caller; at most MAX_M contributions. Returns 0, -1 for
 * arguments out of range, -2 if memory ran out. */
int dld_gram(const uint8_t **codes, const int32_t *packed, const float **scales, int32_t m_count, int64_t block,
             const int64_t *bounds, int32_t s_count, double *out) {
    if (m_count > MAX_M || m_count < 1 || block > MAX_BLOCK || block < 2) return -1;
    int rc = 0;
#if X86
    if (vnni_fits(packed, m_count, block))
        gram_vnni(codes, packed[0], scales, m_count, bounds, s_count, out);
    else
#endif
        rc = gram_generic(codes, packed, scales, m_count, block, bounds, s_count, out);
    if (rc != 0) return rc;
    for (int32_t t = 0; t < s_count; t++) {
        double *g = out + (int64_t)t * m_count * m_count;
        for (int32_t m = 0; m < m_count; m++)
            for (int32_t n = 0; n < m; n++) g[n * m_count + m] = g[m * m_count + n];
    }
    return 0;
}

/* zlib's crc32, bit by bit (the few bytes the folding below leaves) */
static uint32_t crc_bytes(uint32_t c, const uint8_t *p, int64_t n) {
    for (int64_t k = 0; k < n; k++) {
        c ^= p[k];
        for (int i = 0; i < 8; i++) c = (c >> 1) ^ (0xedb88320u & (0u - (c & 1u)));
    }
    return c;
}

#if X86
/* Carry-less folding (Intel, "Fast CRC computation for generic polynomials using PCLMULQDQ"):
 * a 16-byte chunk H:L moves D bits forward as H * (x^(D+32) mod P) + L * (x^(D-32) mod P),
 * bit-reflected into 33-bit constants; four chunks fold 64 bytes at a time. What is left of the
 * last chunk and the tail go bit by bit: zlib.crc32's value for any length. */
CLMUL INLINE __m128i fold16(__m128i x, __m128i k) {
    return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
}

CLMUL static uint32_t crc_clmul(uint32_t c, const uint8_t *p, int64_t n) {
    const __m128i k512 = _mm_set_epi64x(0x1c6e41596, 0x154442bd4), k384 = _mm_set_epi64x(0x174359406, 0x3db1ecdc);
    const __m128i k256 = _mm_set_epi64x(0x15a546366, 0xf1da05aa), k128 = _mm_set_epi64x(0xccaa009e, 0x1751997d0);
    __m128i x[4];
    for (int i = 0; i < 4; i++) x[i] = _mm_loadu_si128((const __m128i *)(p + 16 * i));
    x[0] = _mm_xor_si128(x[0], _mm_cvtsi32_si128((int)c)); /* the register enters as the first 32 bits */
    int64_t pos = 64;
    for (; n - pos >= 64; pos += 64)
        for (int i = 0; i < 4; i++) x[i] = _mm_xor_si128(fold16(x[i], k512), _mm_loadu_si128((const __m128i *)(p + pos + 16 * i)));
    __m128i y = _mm_xor_si128(_mm_xor_si128(fold16(x[0], k384), fold16(x[1], k256)), _mm_xor_si128(fold16(x[2], k128), x[3]));
    for (; n - pos >= 16; pos += 16) y = _mm_xor_si128(fold16(y, k128), _mm_loadu_si128((const __m128i *)(p + pos)));
    uint8_t last[16];
    _mm_storeu_si128((__m128i *)last, y);
    return crc_bytes(crc_bytes(0, last, 16), p + pos, n - pos);
}
#endif

/* *out = zlib.crc32(p[0, n), crc); returns 0, or -1 where the CPU has no carry-less multiply
 * (the caller uses zlib then). */
int dld_crc32(const uint8_t *p, int64_t n, int64_t crc, uint32_t *out) {
    uint32_t c = ~(uint32_t)crc;
    if (n < 64) {
        *out = ~crc_bytes(c, p, n);
        return 0;
    }
#if X86
    if (__builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1")) {
        *out = ~crc_clmul(c, p, n);
        return 0;
    }
#endif
    return -1;
}

/* g[lo, hi) = (or +=) ka * a + kb * b: two contributions per pass over g */
INLINE void accumulate2(float *restrict g, const int8_t *restrict a, const int8_t *restrict b, float ka, float kb,
                        int64_t lo, int64_t hi, int first) {
    if (first) {
        for (int64_t j = lo; j < hi; j++) g[j] = ka * (float)a[j] + kb * (float)b[j];
    } else {
        for (int64_t j = lo; j < hi; j++) g[j] += ka * (float)a[j] + kb * (float)b[j];
    }
}

INLINE void accumulate1(float *restrict g, const int8_t *restrict a, float ka, int64_t lo, int64_t hi, int first) {
    if (first) {
        for (int64_t j = lo; j < hi; j++) g[j] = ka * (float)a[j];
    } else {
        for (int64_t j = lo; j < hi; j++) g[j] += ka * (float)a[j];
    }
}

/* momentum and residual updates of one block; returns the largest |residual| as its bit
 * pattern (integer max vectorizes; a NaN shows as > 0x7f800000) */
INLINE uint32_t outer_step(const float *restrict g, float *restrict mom, float *restrict res, int64_t len, float lr,
                           float beta, float look) {
    float lr_beta = lr * look;
    uint32_t top = 0;
    for (int64_t j = 0; j < len; j++) {
        float buf = g[j] + beta * mom[j];
        mom[j] = buf;
        float r = res[j] - lr * g[j] - lr_beta * buf;
        res[j] = r;
        uint32_t u;
        memcpy(&u, &r, 4);
        u &= 0x7fffffffu;
        top = u > top ? u : top;
    }
    return top;
}

/* quantize the block's residual into codes, apply code * scale to theta and the residual. y is
 * the code as a float (exactly: an integer of at most qmax), so y * scale is float(code) * scale,
 * the product every learner computes from the blob. */
INLINE void quantize_apply(float *restrict theta, float *restrict res, int8_t *restrict q, int64_t len, int64_t block,
                           float inv, float scale) {
    for (int64_t j = 0; j < len; j++) {
        float y = res[j] * inv;
        y = (y + ROUNDER) - ROUNDER;
        q[j] = (int8_t)y;
        float applied = y * scale;
        theta[j] = theta[j] + applied;
        res[j] = res[j] - applied;
    }
    for (int64_t j = len; j < block; j++) q[j] = 0;
}

INLINE void pack4(const int8_t *restrict q, uint8_t *restrict dst, int64_t half) {
    for (int64_t k = 0; k < half; k++) dst[k] = (uint8_t)(((uint8_t)q[k] & 15u) | ((uint8_t)q[k + half] << 4));
}

/* Ask for values [at, at + len) of the three state vectors a line at a time, for writing: the
 * hardware prefetcher alone left the first loads of every block waiting on memory (~10% of the
 * round at 11 MB fragments). */
INLINE void prefetch_state(const float *theta, const float *mom, const float *res, int64_t at, int64_t len) {
    for (int64_t k = 0; k < len; k += 16) {
        __builtin_prefetch(theta + at + k, 1, 3);
        __builtin_prefetch(mom + at + k, 1, 3);
        __builtin_prefetch(res + at + k, 1, 3);
    }
}

/* g[0, len) = the merged gradient of block b (starting at value b0), segment piece by piece */
INLINE void merge_block(const int8_t **v, const float **scales, int32_t m_count, const float *coefs,
                        const int64_t *bounds, int32_t *seg, int64_t b, int64_t b0, int64_t len, float *restrict g) {
    for (int64_t i = 0; i < len;) {
        while (bounds[*seg + 1] <= b0 + i) (*seg)++;
        int64_t end = bounds[*seg + 1] - b0;
        if (end > len) end = len;
        const float *k = coefs + (int64_t)(*seg) * m_count;
        int32_t m = 0;
        for (; m + 1 < m_count; m += 2)
            accumulate2(g, v[m], v[m + 1], k[m] * scales[m][b], k[m + 1] * scales[m + 1][b], i, end, m == 0);
        if (m < m_count) accumulate1(g, v[m], k[m] * scales[m][b], i, end, m == 0);
        i = end;
    }
}

/* The blocks of dld_publish; buf: M x block bytes, v: M pointers (scratch). */
HOT static void publish_blocks(const uint8_t **codes, const int32_t *packed, const float **scales, int32_t m_count,
                               int64_t block, const float *coefs, const int64_t *bounds, int64_t numel,
                               float *theta, float *mom, float *res, float lr, float beta, float look, int32_t qmax,
                               float *out_scales, uint8_t *out_codes, int8_t *buf, const int8_t **v) {
    float g[MAX_BLOCK];
    int8_t q[MAX_BLOCK];
    int32_t seg = 0;
    int64_t half = block / 2, ahead = block > 512 ? block : 512; /* prefetch 2 KiB or a block ahead */
    for (int64_t b = 0, b0 = 0; b0 < numel; b++, b0 += block) {
        int64_t len = numel - b0 < block ? numel - b0 : block;
        if (b0 + ahead + block <= numel) prefetch_state(theta, mom, res, b0 + ahead, block);
        for (int32_t m = 0; m < m_count; m++) v[m] = block_codes(codes[m], packed[m], block, b, buf + m * block);
        merge_block(v, scales, m_count, coefs, bounds, &seg, b, b0, len, g);
        uint32_t bits = outer_step(g, mom + b0, res + b0, len, lr, beta, look);
        float amax;
        memcpy(&amax, &bits, 4);
        if (bits > 0x7f800000u) amax = NAN;
        float scale = amax / (float)qmax;
        float inv = amax > 0.0f ? (float)qmax / (amax > 1e-30f ? amax : 1e-30f) : 0.0f;
        out_scales[b] = scale;
        if (!(scale <= 3.4e38f)) inv = 0.0f; /* NaN/Inf: codes 0; learners refuse the scale */
        quantize_apply(theta + b0, res + b0, q, len, block, inv, scale);
        if (qmax == 7) {
            pack4(q, out_codes + b * half, half);
        } else {
            memcpy(out_codes + b * block, q, (size_t)block);
        }
    }
}

/* Returns 0, -1 for arguments out of range, -2 if memory ran out (nothing is written then).
 * out_scales: nblocks floats; out_codes: nblocks * block / 2 bytes (qmax 7) or nblocks * block (qmax 127). */
int dld_publish(const uint8_t **codes, const int32_t *packed, const float **scales, int32_t m_count, int64_t block,
                const float *coefs, const int64_t *bounds, int64_t numel, float *theta, float *mom, float *res,
                float lr, float beta, float look, int32_t qmax, float *out_scales, uint8_t *out_codes) {
    if (block > MAX_BLOCK || block < 2 || m_count > MAX_M || m_count < 1) return -1;
    int8_t *buf = malloc((size_t)m_count * (size_t)block);
    const int8_t **v = malloc((size_t)m_count * sizeof(*v));
    if (buf == NULL || v == NULL) {
        free(buf);
        free((void *)v);
        return -2;
    }
    publish_blocks(codes, packed, scales, m_count, block, coefs, bounds, numel, theta, mom, res, lr, beta, look, qmax,
                   out_scales, out_codes, buf, v);
    free(buf);
    free((void *)v);
    return 0;
}
