/* Quantized matrix-vector products on the CPU, straight from GGUF blocks (Q4_K, Q6_K, Q8_0).
 *
 * y[p][r] = sum_i W[mats[p]][r][i] * x[p][i], for the experts a small batch chose, read where they lie (the
 * memory-mapped file): no dequantized copy. Each block is unpacked to floats on the stack and multiplied in
 * float32; rows are shared out over OpenMP threads. Compiled on first use for the machine it runs on
 * (kernels/cpu_quant.py), so -march=native picks its vector units.
 */
#include <stdint.h>
#include <string.h>

enum { Q4_K = 12, Q6_K = 14, Q8_0 = 8 };

static float f16(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 1024)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 1023) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static void q4_k_block(const uint8_t *b, float *out) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t *s = b + 4, *qs = b + 16;
    for (int j = 0; j < 4; j++) {
        float sc[2], mn[2];
        for (int h = 0; h < 2; h++) {
            int k = 2 * j + h;
            int a = k < 4 ? (s[k] & 63) : ((s[k + 4] & 15) | ((s[k - 4] >> 6) << 4));
            int m = k < 4 ? (s[k + 4] & 63) : ((s[k + 4] >> 4) | ((s[k] >> 6) << 4));
            sc[h] = d * a;
            mn[h] = dmin * m;
        }
        for (int l = 0; l < 32; l++) {
            out[64 * j + l] = sc[0] * (qs[32 * j + l] & 15) - mn[0];
            out[64 * j + 32 + l] = sc[1] * (qs[32 * j + l] >> 4) - mn[1];
        }
    }
}

static void q6_k_block(const uint8_t *b, float *out) {
    const float d = f16(b + 208);
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
        const int8_t *sc = (const int8_t *)(b + 192 + 8 * h);
        float *o = out + 128 * h;
        for (int g = 0; g < 2; g++) { /* 16 elements share a scale: a constant inner loop vectorises */
            const float s0 = d * sc[g], s1 = d * sc[g + 2], s2 = d * sc[g + 4], s3 = d * sc[g + 6];
            for (int l = 16 * g; l < 16 * g + 16; l++) {
                o[l] = s0 * (((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4)) - 32);
                o[l + 32] = s1 * (((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32);
                o[l + 64] = s2 * (((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                o[l + 96] = s3 * (((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
        }
    }
}

static void q8_0_block(const uint8_t *b, float *out) {
    const float d = f16(b);
    for (int l = 0; l < 32; l++) out[l] = d * (int8_t)b[2 + l];
}

/* One row of n_blocks blocks against x. */
static float row_dot(int qtype, const uint8_t *row, int64_t n_blocks, const float *x) {
    float w[256], acc = 0.0f;
    const int elems = qtype == Q8_0 ? 32 : 256, size = qtype == Q4_K ? 144 : qtype == Q6_K ? 210 : 34;
    for (int64_t j = 0; j < n_blocks; j++) {
        const uint8_t *b = row + j * size;
        if (qtype == Q4_K) q4_k_block(b, w);
        else if (qtype == Q6_K) q6_k_block(b, w);
        else q8_0_block(b, w);
        const float *xs = x + j * elems;
        float part = 0.0f;
#pragma omp simd reduction(+ : part)
        for (int l = 0; l < elems; l++) part += w[l] * xs[l];
        acc += part;
    }
    return acc;
}

/* Returns 0, or -1 for a type this file does not know. */
int matvec_picked(const uint8_t *w, int qtype, int64_t n_out, int64_t n_in, int64_t row_bytes, const int64_t *mats,
                  int64_t n_pick, const float *x, float *y, int n_threads) {
    if (qtype != Q4_K && qtype != Q6_K && qtype != Q8_0) return -1;
    const int64_t elems = qtype == Q8_0 ? 32 : 256, n_blocks = n_in / elems;
#pragma omp parallel for collapse(2) schedule(static) num_threads(n_threads)
    for (int64_t p = 0; p < n_pick; p++) {
        for (int64_t r = 0; r < n_out; r++) {
            const uint8_t *row = w + ((mats ? mats[p] : 0) * n_out + r) * row_bytes;
            y[p * n_out + r] = row_dot(qtype, row, n_blocks, x + p * n_in);
        }
    }
    return 0;
}
