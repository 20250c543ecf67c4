/* The syncer's round step as two loops over the fragment (see syncer/fused.py for the torch
 * version and the arithmetic; syncer/native/__init__.py builds and loads this file).
 *
 * Contributions are int8 codes (int4 or int8 on the wire) with one fp32 scale per block, all
 * with the same block. Segments are given by their bounds (S + 1 offsets, 0 .. numel).
 *
 * dld_gram:    G[s][m][n] = sum over segment s of v_m * v_n, v = code * scale, exactly: integer
 *              dot products of the codes per block, times the two scales, summed in double.
 * dld_publish: per output block: merged g = sum_m (coef[s][m] * scale_m) * code_m, Nesterov (momentum <- g + beta * momentum;
 *              residual <- residual - lr * g - lr * beta * momentum), blockwise absmax
 *              quantization of the residual (round half to even by adding and subtracting
 *              1.5 * 2^23, as syncer/codec.py), packing, then theta += code * scale and
 *              residual -= code * scale as two separate fp32 operations.
 *
 * Build with -ffp-contract=off and without -ffast-math: theta must receive exactly the fp32
 * product a learner computes and adds (no fused multiply-add).
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_BLOCK 4096
#define MAX_M 16
#define ROUNDER 12582912.0f /* 1.5 * 2^23 */

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define HOT __attribute__((target_clones("avx2", "default")))
#else
#define HOT
#endif

HOT static int32_t dot_i16(const int16_t *restrict a, const int16_t *restrict b, int64_t n) {
    int32_t acc = 0;
    for (int64_t k = 0; k < n; k++) acc += (int32_t)a[k] * (int32_t)b[k];
    return acc;
}

HOT static void widen(const int8_t *restrict src, int16_t *restrict dst, int64_t n) {
    for (int64_t k = 0; k < n; k++) dst[k] = src[k];
}

/* out: S * M * M doubles, zeroed by the caller; at most MAX_M contributions. */
int dld_gram(const int8_t **codes, const float **scales, int32_t m_count, int64_t block,
             const int64_t *bounds, int32_t s_count, double *out) {
    if (m_count > MAX_M || block > MAX_BLOCK) return -1;
    int16_t wide[MAX_M][MAX_BLOCK];
    for (int32_t s = 0; s < s_count; s++) {
        double *g = out + (int64_t)s * m_count * m_count;
        for (int64_t i = bounds[s]; i < bounds[s + 1];) {
            int64_t b = i / block, end = (b + 1) * block;
            if (end > bounds[s + 1]) end = bounds[s + 1];
            for (int32_t m = 0; m < m_count; m++) widen(codes[m] + i, wide[m], end - i);
            for (int32_t m = 0; m < m_count; m++) {
                for (int32_t n = 0; n <= m; n++) {
                    int32_t dot = dot_i16(wide[m], wide[n], end - i);
                    g[m * m_count + n] += (double)scales[m][b] * (double)scales[n][b] * (double)dot;
                }
            }
            i = end;
        }
        for (int32_t m = 0; m < m_count; m++)
            for (int32_t n = 0; n < m; n++) g[n * m_count + m] = g[m * m_count + n];
    }
    return 0;
}

/* g[lo, hi) = (or +=) ka * a + kb * b: two contributions per pass over g */
HOT static void accumulate2(float *restrict g, const int8_t *restrict a, const int8_t *restrict b, float ka,
                            float kb, int64_t lo, int64_t hi, int first) {
    if (first) {
        for (int64_t j = lo; j < hi; j++) g[j] = ka * (float)a[j] + kb * (float)b[j];
    } else {
        for (int64_t j = lo; j < hi; j++) g[j] += ka * (float)a[j] + kb * (float)b[j];
    }
}

HOT static void accumulate1(float *restrict g, const int8_t *restrict a, float ka, int64_t lo, int64_t hi, int first) {
    if (first) {
        for (int64_t j = lo; j < hi; j++) g[j] = ka * (float)a[j];
    } else {
        for (int64_t j = lo; j < hi; j++) g[j] += ka * (float)a[j];
    }
}

/* momentum and residual updates of one block; returns the largest |residual| as its bit
 * pattern (integer max vectorizes; a NaN shows as > 0x7f800000) */
HOT static uint32_t outer_step(const float *restrict g, float *restrict mom, float *restrict res, int64_t len,
                               float lr, float beta) {
    float lr_beta = lr * beta;
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

/* quantize the block's residual into codes, apply code * scale to theta and the residual */
HOT static void quantize_apply(float *restrict theta, float *restrict res, int8_t *restrict q, int64_t len,
                               int64_t block, float inv, float scale) {
    for (int64_t j = 0; j < len; j++) {
        float y = res[j] * inv;
        y = (y + ROUNDER) - ROUNDER;
        q[j] = (int8_t)y;
    }
    for (int64_t j = len; j < block; j++) q[j] = 0;
    for (int64_t j = 0; j < len; j++) {
        float applied = (float)q[j] * scale;
        theta[j] = theta[j] + applied;
        res[j] = res[j] - applied;
    }
}

HOT static void pack4(const int8_t *restrict q, uint8_t *restrict dst, int64_t half) {
    for (int64_t k = 0; k < half; k++) dst[k] = (uint8_t)(((uint8_t)q[k] & 15u) | ((uint8_t)q[k + half] << 4));
}

static void merge_block(const int8_t **codes, const float **scales, int32_t m_count, const float *coefs,
                        const int64_t *bounds, int32_t *seg, int64_t b, int64_t b0, int64_t len, float *g) {
    for (int64_t i = 0; i < len;) {
        while (bounds[*seg + 1] <= b0 + i) (*seg)++;
        int64_t end = bounds[*seg + 1] - b0;
        if (end > len) end = len;
        const float *k = coefs + (int64_t)(*seg) * m_count;
        int32_t m = 0;
        for (; m + 1 < m_count; m += 2)
            accumulate2(g, codes[m] + b0, codes[m + 1] + b0, k[m] * scales[m][b], k[m + 1] * scales[m + 1][b], i, end, m == 0);
        if (m < m_count) accumulate1(g, codes[m] + b0, k[m] * scales[m][b], i, end, m == 0);
        i = end;
    }
}

/* Returns 0, or -1 if the block is larger than MAX_BLOCK (nothing is written then).
 * out_scales: nblocks floats; out_codes: nblocks * block / 2 bytes (qmax 7) or nblocks * block (qmax 127). */
int dld_publish(const int8_t **codes, const float **scales, int32_t m_count, int64_t block,
                const float *coefs, const int64_t *bounds, int64_t numel,
                float *theta, float *mom, float *res, float lr, float beta, int32_t qmax,
                float *out_scales, uint8_t *out_codes) {
    if (block > MAX_BLOCK || block < 2) return -1;
    float g[MAX_BLOCK];
    int8_t q[MAX_BLOCK];
    int32_t seg = 0;
    int64_t half = block / 2;
    for (int64_t b = 0, b0 = 0; b0 < numel; b++, b0 += block) {
        int64_t len = numel - b0 < block ? numel - b0 : block;
        merge_block(codes, scales, m_count, coefs, bounds, &seg, b, b0, len, g);
        uint32_t bits = outer_step(g, mom + b0, res + b0, len, lr, beta);
        float amax;
        memcpy(&amax, &bits, 4);
        if (bits > 0x7f800000u) amax = NAN;
        float scale = amax / (float)qmax;
        float inv = amax > 0.0f ? (float)qmax / (amax > 1e-30f ? amax : 1e-30f) : 0.0f;
        out_scales[b] = scale;
        if (!(scale <= 3.4e38f)) inv = 0.0f;   /* NaN/Inf: codes 0; learners refuse the scale */
        quantize_apply(theta + b0, res + b0, q, len, block, inv, scale);
        if (qmax == 7) {
            pack4(q, out_codes + b * half, half);
        } else {
            memcpy(out_codes + b * block, q, (size_t)block);
        }
    }
    return 0;
}

/* int4 payload -> int8 codes (codec format 2: byte k of a block holds code k in its low nibble and
 * code k + block/2 in its high one, two's complement). Returns 1 if a nibble is 0b1000 (-8, never
 * produced by an encoder: the payload is refused), else 0. */
HOT int dld_unpack4(const uint8_t *restrict packed, int64_t nblocks, int64_t block, int8_t *restrict codes) {
    int64_t half = block / 2;
    int bad = 0;
    for (int64_t b = 0; b < nblocks; b++) {
        const uint8_t *src = packed + b * half;
        int8_t *lo = codes + b * block, *hi = lo + half;
        for (int64_t k = 0; k < half; k++) {
            int v = src[k];
            int l = ((v & 15) ^ 8) - 8, h = ((v >> 4) ^ 8) - 8;
            lo[k] = (int8_t)l;
            hi[k] = (int8_t)h;
            bad |= (l == -8) | (h == -8);
        }
    }
    return bad;
}
