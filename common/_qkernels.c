/* One-pass kernels of the int8 / int4 wire codecs (common/quant.py holds the format and the
 * reference implementation in torch; these compute the same bytes, faster).
 *
 * Built by setup.py as an optional extension: where no C compiler is found the build is
 * skipped and common.quant uses its torch implementation. Both are tested to produce identical
 * payloads and identical decoded values.
 *
 * Format (see common/quant.py): blocks of 64 values, scale = bf16_rne(absmax / L),
 * q = clamp(round_half_even(x / d), -L, L) with d = scale (or 1 when the scale is 0), decoded
 * as q * scale. int4 packs two values per byte, low nibble first, 4-bit two's complement; the
 * nibbles of an odd tail are zero.
 *
 * The GIL is released while a kernel runs, so a learner's network thread and a shard's merge
 * workers encode and decode beside the Python threads of the same process.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 64
#define ROUND_MAGIC 12582912.0f /* 1.5 * 2^23: v + M - M rounds v half-to-even for |v| < 2^22 */

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define MULTIVERSION
#endif

static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* float -> bf16 bits, round to nearest even (c10::BFloat16's rule; the input is finite). */
static inline uint16_t bf16_rne(float f) {
    uint32_t u = f32_bits(f);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float bf16_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

/* The b-th bf16 scale of a frame, which need not be 2-byte aligned. */
static inline uint16_t load_scale(const uint8_t *scales, Py_ssize_t b) {
    uint16_t h;
    memcpy(&h, scales + 2 * b, 2);
    return h;
}

static inline void pack_block(const int8_t *q, uint8_t *out) {
    uint16_t w[BLOCK / 2];                     /* (low, high) value pairs, little-endian */
    memcpy(w, q, BLOCK);
    for (int j = 0; j < BLOCK / 2; j++) {
        uint16_t t = w[j] & 0x0F0Fu;
        out[j] = (uint8_t)(t | (t >> 4));
    }
}

#define CHUNK 64 /* blocks per pass: 16 KiB of input, still in L1 while it is quantised */

/* Quantise n_blocks full blocks (n_blocks <= CHUNK); returns 0 if they hold NaN/inf. The
 * per-block scale arithmetic runs as loops over the chunk's blocks, so it vectorises too. */
static inline int quantise_chunk(const float *x, Py_ssize_t n_blocks, int levels,
                                 uint8_t *values_out, uint16_t *scales_out) {
    uint32_t amax[CHUNK], worst = 0;
    float d[CHUNK];
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        uint32_t m = 0;
        for (int i = 0; i < BLOCK; i++) {
            uint32_t a = f32_bits(x[b * BLOCK + i]) & 0x7FFFFFFFu; /* |x| as bits, same order */
            m = a > m ? a : m;
        }
        amax[b] = m;
        worst = m > worst ? m : worst;
    }
    if (worst >= 0x7F800000u) return 0;          /* inf, or NaN (whose bits sort above inf) */
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        uint16_t sc = bf16_rne(bits_f32(amax[b]) / (float)levels);
        float sf = bf16_f32(sc);
        scales_out[b] = sc;
        d[b] = sf > 0.0f ? sf : 1.0f;            /* an all-zero (or underflowed) block: 0s */
    }
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        int8_t q[BLOCK];
        for (int i = 0; i < BLOCK; i++) {        /* |x / d| stays below ~15: no overflow */
            int32_t r = (int32_t)((x[b * BLOCK + i] / d[b] + ROUND_MAGIC) - ROUND_MAGIC);
            r = r < levels ? r : levels;         /* an integer clamp vectorises, a float one less */
            r = r > -levels ? r : -levels;
            q[i] = (int8_t)r;
        }
        if (levels == 7) pack_block(q, values_out + b * (BLOCK / 2));
        else memcpy(values_out + b * BLOCK, q, BLOCK);
    }
    return 1;
}

/* Encode n floats. int8: values_out has n bytes; int4: (n + 1) / 2 bytes. Returns 0 on NaN/inf. */
MULTIVERSION
static int encode_blocks(const float *x, Py_ssize_t n, int levels, uint8_t *values_out,
                         uint16_t *scales_out) {
    Py_ssize_t full = n / BLOCK, stride = levels == 7 ? BLOCK / 2 : BLOCK;
    for (Py_ssize_t b = 0; b < full; b += CHUNK) {
        Py_ssize_t k = full - b < CHUNK ? full - b : CHUNK;
        if (!quantise_chunk(x + b * BLOCK, k, levels, values_out + b * stride, scales_out + b))
            return 0;
    }
    Py_ssize_t rest = n - full * BLOCK;
    if (rest) {                                   /* the tail, padded with zeros */
        float tail[BLOCK] = {0};
        uint8_t v[BLOCK];
        memcpy(tail, x + full * BLOCK, (size_t)rest * sizeof(float));
        if (!quantise_chunk(tail, 1, levels, v, scales_out + full)) return 0;
        memcpy(values_out + full * stride, v, (size_t)(levels == 7 ? (rest + 1) / 2 : rest));
    }
    return 1;
}

static inline void dequantise_block(const uint8_t *v, int levels, float s, float *out) {
    if (levels == 7) {
        for (int j = 0; j < BLOCK / 2; j++) {
            int32_t p = v[j];
            out[2 * j] = (float)(((p & 0x0F) ^ 8) - 8) * s;
            out[2 * j + 1] = (float)(((p >> 4) ^ 8) - 8) * s;
        }
    } else {
        const int8_t *q = (const int8_t *)v;
        for (int i = 0; i < BLOCK; i++) out[i] = (float)q[i] * s;
    }
}

/* Decode n values; returns 0 if a scale is NaN/inf. */
MULTIVERSION
static int decode_blocks(const uint8_t *values, const uint8_t *scales, Py_ssize_t n, int levels,
                         float *out) {
    Py_ssize_t n_blocks = (n + BLOCK - 1) / BLOCK;
    for (Py_ssize_t b = 0; b < n_blocks; b++)
        if ((load_scale(scales, b) & 0x7F80u) == 0x7F80u) return 0;
    Py_ssize_t full = n / BLOCK;
    Py_ssize_t stride = levels == 7 ? BLOCK / 2 : BLOCK;
    for (Py_ssize_t b = 0; b < full; b++)
        dequantise_block(values + b * stride, levels, bf16_f32(load_scale(scales, b)), out + b * BLOCK);
    Py_ssize_t rest = n - full * BLOCK;
    if (rest) {
        uint8_t v[BLOCK] = {0};
        float tail[BLOCK];
        memcpy(v, values + full * stride, (size_t)(levels == 7 ? (rest + 1) / 2 : rest));
        dequantise_block(v, levels, bf16_f32(load_scale(scales, full)), tail);
        memcpy(out + full * BLOCK, tail, (size_t)rest * sizeof(float));
    }
    return 1;
}

/* ------------------------------------------------------------------------------------------ */

static int check_levels(int levels) {
    if (levels != 7 && levels != 127) {
        PyErr_SetString(PyExc_ValueError, "levels must be 7 (int4) or 127 (int8)");
        return 0;
    }
    return 1;
}

static int check_size(const Py_buffer *b, Py_ssize_t want, const char *what) {
    if (b->len != want) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, expected %zd", what, b->len, want);
        return 0;
    }
    return 1;
}

static Py_ssize_t values_nbytes(Py_ssize_t n, int levels) { return levels == 7 ? (n + 1) / 2 : n; }

PyDoc_STRVAR(encode_doc,
"encode(x, levels, values_out, scales_out) -> bool\n\n"
"Quantise the float32 buffer x into values_out (int8: n bytes, int4: ceil(n/2)) and the bf16\n"
"scales into scales_out (2 * ceil(n/64) bytes). False if x holds NaN/inf.");

static PyObject *py_encode(PyObject *self, PyObject *args) {
    Py_buffer x, vals, scales;
    int levels;
    if (!PyArg_ParseTuple(args, "y*iw*w*", &x, &levels, &vals, &scales)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = x.len / 4;
    if (!check_levels(levels)) goto done;
    if (x.len % 4) { PyErr_SetString(PyExc_ValueError, "x: not a float32 buffer"); goto done; }
    if (!check_size(&vals, values_nbytes(n, levels), "values_out")) goto done;
    if (!check_size(&scales, 2 * ((n + BLOCK - 1) / BLOCK), "scales_out")) goto done;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = encode_blocks((const float *)x.buf, n, levels, (uint8_t *)vals.buf, (uint16_t *)scales.buf);
    Py_END_ALLOW_THREADS
    result = PyBool_FromLong(ok);
done:
    PyBuffer_Release(&x);
    PyBuffer_Release(&vals);
    PyBuffer_Release(&scales);
    return result;
}

PyDoc_STRVAR(decode_doc,
"decode(values, scales, levels, out) -> bool\n\n"
"Dequantise into the float32 buffer out (n values). False if a scale is NaN/inf.");

static PyObject *py_decode(PyObject *self, PyObject *args) {
    Py_buffer vals, scales, out;
    int levels;
    if (!PyArg_ParseTuple(args, "y*y*iw*", &vals, &scales, &levels, &out)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = out.len / 4;
    if (!check_levels(levels)) goto done;
    if (out.len % 4) { PyErr_SetString(PyExc_ValueError, "out: not a float32 buffer"); goto done; }
    if (!check_size(&vals, values_nbytes(n, levels), "values")) goto done;
    if (!check_size(&scales, 2 * ((n + BLOCK - 1) / BLOCK), "scales")) goto done;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = decode_blocks((const uint8_t *)vals.buf, (const uint8_t *)scales.buf, n, levels,
                       (float *)out.buf);
    Py_END_ALLOW_THREADS
    result = PyBool_FromLong(ok);
done:
    PyBuffer_Release(&vals);
    PyBuffer_Release(&scales);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"encode", py_encode, METH_VARARGS, encode_doc},
    {"decode", py_decode, METH_VARARGS, decode_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "common._qkernels",
    "One-pass int8/int4 codec kernels (see common/quant.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__qkernels(void) { return PyModule_Create(&module); }
