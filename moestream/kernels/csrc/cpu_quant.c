/* Quantized matrix-vector products on the CPU, straight from GGUF blocks (the types block_bytes names).
 *
 * y[p][r] = sum_i W[mats[p]][r][i] * x[p][i], for the experts a small batch chose, read where they lie (the
 * memory-mapped file): no dequantized copy. Each block is unpacked to floats on the stack and multiplied in
 * float32; rows are shared out over OpenMP threads. Compiled on first use for the machine it runs on
 * (kernels/cpu_quant.py), so -march=native picks its vector units.
 */
#include <stdint.h>
#include <string.h>

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q6_K = 14, MXFP4 = 39 };

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

/* The 32-value blocks: d (and m) fp16, then for the _1 types' fifth bits a little-endian uint32 (bit j: value
 * j), then 16 bytes of nibbles (low: values 0..15, high: 16..31). */
static void q4_0_block(const uint8_t *b, float *out) {
    const float d = f16(b);
    for (int l = 0; l < 16; l++) {
        out[l] = d * ((b[2 + l] & 15) - 8);
        out[l + 16] = d * ((b[2 + l] >> 4) - 8);
    }
}

static void q4_1_block(const uint8_t *b, float *out) {
    const float d = f16(b), m = f16(b + 2);
    for (int l = 0; l < 16; l++) {
        out[l] = d * (b[4 + l] & 15) + m;
        out[l + 16] = d * (b[4 + l] >> 4) + m;
    }
}

static uint32_t fifth_bits(const uint8_t *p) { return p[0] | p[1] << 8 | p[2] << 16 | (uint32_t)p[3] << 24; }

static void q5_0_block(const uint8_t *b, float *out) {
    const float d = f16(b);
    const uint32_t qh = fifth_bits(b + 2);
    for (int l = 0; l < 16; l++) {
        out[l] = d * (int)(((b[6 + l] & 15) | ((qh >> l) & 1) << 4) - 16);
        out[l + 16] = d * (int)(((b[6 + l] >> 4) | ((qh >> (l + 16)) & 1) << 4) - 16);
    }
}

static void q5_1_block(const uint8_t *b, float *out) {
    const float d = f16(b), m = f16(b + 2);
    const uint32_t qh = fifth_bits(b + 4);
    for (int l = 0; l < 16; l++) {
        out[l] = d * ((b[8 + l] & 15) | ((qh >> l) & 1) << 4) + m;
        out[l + 16] = d * ((b[8 + l] >> 4) | ((qh >> (l + 16)) & 1) << 4) + m;
    }
}

static const int8_t E2M1_DOUBLED[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static float e8m0_half(uint8_t e) { /* half the scale 2^(e - 127): 2^(e - 128), a subnormal for e 0 and 1 */
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static void mxfp4_block(const uint8_t *b, float *out) {
    const float d = e8m0_half(b[0]);
    for (int l = 0; l < 16; l++) {
        out[l] = d * E2M1_DOUBLED[b[1 + l] & 15];
        out[l + 16] = d * E2M1_DOUBLED[b[1 + l] >> 4];
    }
}

/* Bytes a block of qtype takes (and *elems the values it holds); 0 for a type this file does not know. */
static int block_bytes(int qtype, int *elems) {
    switch (qtype) {
    case Q4_K: *elems = 256; return 144;
    case Q6_K: *elems = 256; return 210;
    case Q4_0: *elems = 32; return 18;
    case Q4_1: *elems = 32; return 20;
    case Q5_0: *elems = 32; return 22;
    case Q5_1: *elems = 32; return 24;
    case Q8_0: *elems = 32; return 34;
    case MXFP4: *elems = 32; return 17;
    }
    return 0;
}

static void expand(int qtype, const uint8_t *b, float *out) {
    switch (qtype) {
    case Q4_K: q4_k_block(b, out); break;
    case Q6_K: q6_k_block(b, out); break;
    case Q4_0: q4_0_block(b, out); break;
    case Q4_1: q4_1_block(b, out); break;
    case Q5_0: q5_0_block(b, out); break;
    case Q5_1: q5_1_block(b, out); break;
    case Q8_0: q8_0_block(b, out); break;
    case MXFP4: mxfp4_block(b, out); break;
    }
}

/* One row of n_blocks blocks against x. */
static float row_dot(int qtype, const uint8_t *row, int64_t n_blocks, const float *x) {
    float w[256], acc = 0.0f;
    int elems;
    const int size = block_bytes(qtype, &elems);
    for (int64_t j = 0; j < n_blocks; j++) {
        expand(qtype, row + j * size, w);
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
    int elems;
    if (!block_bytes(qtype, &elems)) return -1;
    const int64_t n_blocks = n_in / elems;
#pragma omp parallel for collapse(2) schedule(static) num_threads(n_threads)
    for (int64_t p = 0; p < n_pick; p++) {
        for (int64_t r = 0; r < n_out; r++) {
            const uint8_t *row = w + ((mats ? mats[p] : 0) * n_out + r) * row_bytes;
            y[p * n_out + r] = row_dot(qtype, row, n_blocks, x + p * n_in);
        }
    }
    return 0;
}
