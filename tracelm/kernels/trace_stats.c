/* tracelm.kernels._core, the trace's kernels: a stage output's statistics and digest, and the JSON lines of a batch
 * of stage events with their hash chain (docs/trace.md; tracelm/pipeline/trace.py holds the Python statement of
 * each, which tests/test_trace_kernels.py compares with these bit for bit and byte for byte).
 *
 * Statistics of an event's n float32 values x (its output arrays' elements, C order, one array after another), as
 * numpy's np.add.reduceat gives them for a group (its first value, plus numpy's pairwise sum of the rest):
 *     S  = x[0] + pw(x[1..n))          Q = x[0]*x[0] + pw(x[1..n)^2)        (float32; each square rounded first)
 *     mean = S / n, rms = sqrt(Q / n)  (double)        maxabs = max |x|, NaN when any x is NaN
 * pw(v, n) (numpy's FLOAT_pairwise_sum): n < 8: one chain from -0.0; n <= 128: 8 lanes, lane l = v[l], then
 * lane l + v[i + l] for i = 8, 16, .. below n - n % 8, the tree ((0+1)+(2+3))+((4+5)+(6+7)), then the rest in order;
 * n > 128: pw of the first n2 = n/2 - (n/2) % 8 values + pw of the others. The AVX2 path runs the 8 lanes as one
 * vector (the same additions); n = 0 gives NaN for all three.
 *
 * Digest: sha256 over the event's bytes, the first 16 bytes as hex. Lines: a template per batch, one line head per
 * event, each ended by '\0', with one-byte fields (the FIELD_* below) filled from the event's numbers; each line
 * is then closed as trace.py's _chain closes it: BODY = head + prev + '"', H = sha256(BODY), line = BODY +
 * ',"hash":"H"' [+ ',"mac":"HMAC(key, H)"'] + '}' + '\n'; an optional tail line (a token event's, rendered in Python
 * up to its prev) follows the events. A batch posted (trace_lines_post) is rendered as the pool's idle work: by its
 * waiting worker, a few lines at a time between kernel jobs, and finished by the caller that needs it.
 */
#include "pyglue.h"
#include "sha256.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <structmember.h>
#include <time.h>

/* ======================================================================================================
 * statistics
 * ==================================================================================================== */
typedef struct { float s, q, mx; int nan; } sums;   /* sum, sum of squares, max |x|, a NaN seen */

static void leaf_tail(const float *x, int64_t i, int64_t n, sums *a) {   /* values i..n-1 into a, in order */
    for (; i < n; i++) {
        float v = x[i], m = fabsf(v);
        a->s = a->s + v;
        a->q = a->q + v * v;
        a->nan |= v != v;
        a->mx = m > a->mx ? m : a->mx;
    }
}

static float tree8(const float r[8]) { return ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7])); }

/* 8 <= n <= 128, portable: lane l of r (sums) and q (squares) as numpy's loop has them */
static void leaf8_c(const float *x, int64_t n, sums *a) {
    float r[8], q[8];
    const int64_t m = n - n % 8;
    for (int l = 0; l < 8; l++) { r[l] = x[l]; q[l] = x[l] * x[l]; }
    for (int64_t i = 8; i < m; i += 8)
        for (int l = 0; l < 8; l++) { r[l] = r[l] + x[i + l]; q[l] = q[l] + x[i + l] * x[i + l]; }
    for (int64_t i = 0; i < m; i++) {
        float v = fabsf(x[i]);
        a->nan |= v != v;
        a->mx = v > a->mx ? v : a->mx;
    }
    a->s = tree8(r);
    a->q = tree8(q);
    leaf_tail(x, m, n, a);
}

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
/* the same, the 8 lanes as one vector (no FMA: a multiply, then an add) */
__attribute__((target("avx2"))) static void leaf8_avx2(const float *x, int64_t n, sums *a) {
    const int64_t m = n - n % 8;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 r = _mm256_loadu_ps(x), q = _mm256_mul_ps(r, r), mx = _mm256_andnot_ps(sign, r);
    __m256 un = _mm256_cmp_ps(r, r, _CMP_UNORD_Q);
    for (int64_t i = 8; i < m; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        r = _mm256_add_ps(r, v);
        q = _mm256_add_ps(q, _mm256_mul_ps(v, v));
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v));
        un = _mm256_or_ps(un, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float rl[8], ql[8], ml[8];
    _mm256_storeu_ps(rl, r); _mm256_storeu_ps(ql, q); _mm256_storeu_ps(ml, mx);
    for (int l = 0; l < 8; l++) a->mx = ml[l] > a->mx ? ml[l] : a->mx;
    a->nan |= _mm256_movemask_ps(un) != 0;
    a->s = tree8(rl);
    a->q = tree8(ql);
    leaf_tail(x, m, n, a);
}
#endif

typedef void (*leaf_fn)(const float *x, int64_t n, sums *a);

/* pw of x[0..n) and of its squares into a->s, a->q (max and NaN accumulate) */
static void pairwise(leaf_fn leaf8, const float *x, int64_t n, sums *a) {
    if (n < 8) {
        a->s = -0.0f; a->q = -0.0f;
        leaf_tail(x, 0, n, a);
    } else if (n <= 128) {
        leaf8(x, n, a);
    } else {
        int64_t n2 = n / 2;
        n2 -= n2 % 8;
        sums b = {0, 0, a->mx, a->nan};
        pairwise(leaf8, x, n2, a);
        b.mx = a->mx; b.nan = a->nan;
        pairwise(leaf8, x + n2, n - n2, &b);
        a->s = a->s + b.s;
        a->q = a->q + b.q;
        a->mx = b.mx; a->nan = b.nan;
    }
}

/* mean, rms, max |x| of x[0..n) as reduceat's group (the header) */
static void event_stats(leaf_fn leaf8, const float *x, int64_t n, double out[3]) {
    if (n == 0) { out[0] = out[1] = out[2] = NAN; return; }
    sums a = {0, 0, fabsf(x[0]), x[0] != x[0]};
    float s = x[0], q = x[0] * x[0];
    if (n > 1) {
        pairwise(leaf8, x + 1, n - 1, &a);
        s = s + a.s;
        q = q + a.q;
    }
    out[0] = (double)s / (double)n;
    out[1] = sqrt((double)q / (double)n);
    out[2] = a.nan ? NAN : (double)a.mx;
}

static leaf_fn current_leaf(void) {
#if defined(__x86_64__) || defined(__i386__)
    if (strcmp(current_path()->name, "avx2") == 0) return leaf8_avx2;
#endif
    return leaf8_c;
}

static int use_sha_ni(void) { return strcmp(current_path()->name, "avx2") == 0 && sha256_ni_available(); }

/* ======================================================================================================
 * numbers as Python's %-format writes them
 * ==================================================================================================== */
typedef unsigned __int128 u128;

static int bitlen(u128 v) { int b = 0; while (v) { b++; v >>= 1; } return b; }

/* N = v * 10^q rounded half to even, exactly (v > 0 finite); -1 when it is out of this 128-bit reach */
static int round_scaled(double v, int q, u128 *N) {
    static const uint64_t P5[28] = {1ULL, 5ULL, 25ULL, 125ULL, 625ULL, 3125ULL, 15625ULL, 78125ULL, 390625ULL,
        1953125ULL, 9765625ULL, 48828125ULL, 244140625ULL, 1220703125ULL, 6103515625ULL, 30517578125ULL,
        152587890625ULL, 762939453125ULL, 3814697265625ULL, 19073486328125ULL, 95367431640625ULL,
        476837158203125ULL, 2384185791015625ULL, 11920928955078125ULL, 59604644775390625ULL,
        298023223876953125ULL, 1490116119384765625ULL, 7450580596923828125ULL};
    if (q > 27 || q < -27) return -1;
    int e;
    double f = frexp(v, &e);
    u128 num = (u128)(uint64_t)ldexp(f, 53), den = 1;   /* v = num 2^(e - 53), exactly */
    int s = e - 53 + q;                                  /* v 10^q = num 5^q 2^s (q >= 0), num 2^s / 5^-q (q < 0) */
    if (q >= 0) num *= P5[q];
    else den = P5[-q];
    if (s >= 0) {
        if (s > 126 - bitlen(num)) return -1;
        num <<= s;
    } else if (den == 1) {   /* num / 2^-s, by shifts */
        if (-s > 126) { *N = 0; return 0; }   /* num < 2^117: below one half */
        const u128 Q = num >> -s, R = num - (Q << -s), half = (u128)1 << (-s - 1);
        *N = Q + (R > half || (R == half && (Q & 1)));
        return 0;
    } else {
        if (-s > 126 - bitlen(den)) return -1;
        den <<= -s;
    }
    u128 Q = num / den, R = num - Q * den;
    if (2 * R > den || (2 * R == den && (Q & 1))) Q++;
    *N = Q;
    return 0;
}

static int digits_of(uint64_t N, char *out) {   /* N in decimal; returns the length */
    char t[24];
    int n = 0;
    do { t[n++] = (char)('0' + (int)(N % 10)); N /= 10; } while (N);
    for (int i = 0; i < n; i++) out[i] = t[n - 1 - i];
    return n;
}

/* "%.7g" % x for finite x: 7 significant digits d, exponent X after rounding; X in [-4, 7): fixed, else d.ddddddde+XX,
 * trailing zeros (and a bare '.') dropped */
static int fmt_g7(double x, char *out) {
    if (x == 0) return sprintf(out, signbit(x) ? "-0" : "0");
    double v = fabs(x);
    int k = (int)floor(log10(v));
    u128 N;
    for (int tries = 0;; tries++) {
        if (tries > 3 || round_scaled(v, 6 - k, &N)) return sprintf(out, "%.7g", x);
        if (N >= 10000000) k++;
        else if (N < 1000000) k--;
        else break;
    }
    char d[8], *o = out;
    digits_of((uint64_t)N, d);
    int nd = 7;
    while (nd > 1 && d[nd - 1] == '0') nd--;
    if (x < 0) *o++ = '-';
    if (k < -4 || k >= 7) {
        *o++ = d[0];
        if (nd > 1) { *o++ = '.'; memcpy(o, d + 1, nd - 1); o += nd - 1; }
        o += sprintf(o, "e%c%02d", k < 0 ? '-' : '+', k < 0 ? -k : k);
    } else if (k < 0) {
        *o++ = '0'; *o++ = '.';
        for (int i = 0; i < -k - 1; i++) *o++ = '0';
        memcpy(o, d, nd); o += nd;
    } else {
        memcpy(o, d, k + 1); o += k + 1;
        if (nd > k + 1) { *o++ = '.'; memcpy(o, d + k + 1, nd - k - 1); o += nd - k - 1; }
    }
    return (int)(o - out);
}

/* a statistic as trace.py's _num writes it: %.7g, or "nan" / "inf" / "-inf" as JSON strings */
static int fmt_stat(double x, char *out) {
    if (x != x) return sprintf(out, "\"nan\"");
    if (isinf(x)) return sprintf(out, x > 0 ? "\"inf\"" : "\"-inf\"");
    return fmt_g7(x, out);
}

static int fmt_int(int64_t v, char *out) {   /* "%d" */
    if (v < 0) { out[0] = '-'; return 1 + digits_of(0 - (uint64_t)v, out + 1); }
    return digits_of((uint64_t)v, out);
}

/* "%.1f" % (ns / 1000): microseconds, one decimal */
static int fmt_us(int64_t ns, char *out) {
    double v = (double)ns / 1000.0;
    u128 N;
    if (v < 0 || round_scaled(v, 1, &N) || N >> 64) return sprintf(out, "%.1f", v);
    int n = N < 10 ? (out[0] = '0', 1) : digits_of((uint64_t)(N / 10), out);
    out[n] = '.';
    out[n + 1] = (char)('0' + (int)(N % 10));
    return n + 2;
}

/* ======================================================================================================
 * Python face
 * ==================================================================================================== */
/* an array (any strides) of float32, its elements in C order to dst */
static void copy_c_order(const char *src, const Py_ssize_t *shape, const Py_ssize_t *strides, int ndim, float **dst) {
    if (ndim == 0) { memcpy(*dst, src, 4); *dst += 1; return; }
    if (ndim == 1 && strides[0] == 4) { memcpy(*dst, src, (size_t)shape[0] * 4); *dst += shape[0]; return; }
    for (Py_ssize_t i = 0; i < shape[0]; i++) copy_c_order(src + i * strides[0], shape + 1, strides + 1, ndim - 1, dst);
}

/* the arrays' shapes into a row of meta from META_SHAPES on: k arrays, then per array ndim, its dims...; 0 if they do
 * not fit (k = 0 then) */
enum { META_END, META_START, META_DUR, META_STAGE, META_LAYER, META_SHAPES };
static int shapes_row(const buf *v, Py_ssize_t k, int64_t *row, Py_ssize_t width) {
    Py_ssize_t at = META_SHAPES + 1;
    int fits = 1;
    for (Py_ssize_t i = 0; i < k && fits; i++) {
        if (at + 1 + v[i].v.ndim > width) fits = 0;
        else {
            row[at++] = v[i].v.ndim;
            for (int d = 0; d < v[i].v.ndim; d++) row[at++] = v[i].v.shape[d];
        }
    }
    if (!fits) at = META_SHAPES + 1;
    row[META_SHAPES] = fits ? k : 0;
    while (at < width) row[at++] = 0;
    return fits;
}

static int get_c(PyObject *o, const char *name, char fmt, Py_ssize_t itemsize, int writable, buf *b) {
    if (PyObject_GetBuffer(o, &b->v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) != 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "trace kernels: %s must be a C-contiguous%s array", name, writable ? " writable" : "");
        return -1;
    }
    b->held = 1;
    if ((fmt_is(&b->v, fmt) || (fmt == 'q' && fmt_is(&b->v, 'l'))) && b->v.itemsize == itemsize) return 0;
    PyErr_Format(PyExc_ValueError, "trace kernels: %s has format '%s' (itemsize %zd)", name, fmt_name(&b->v),
                 b->v.itemsize);
    return -1;
}

/* ======================================================================================================
 * the holder: the Tracer's hot path, one call per stage event
 * ==================================================================================================== */
/* TraceHolder(arena, meta, stats, stage_ids, refused, keep): a batch of stage events as they come. Event i's row of
 * meta (int64 [rows, width]) is [its end in the arena, start, dur_ns, stage id (stage_ids: name -> id, a new name
 * gets the next id), layer (-1: None), its shapes (shapes_row)]; stats[i] (float64 [rows, 3]) its mean, rms, max |x|,
 * computed as it is held, from the bytes just written. `keep`: its float32 bytes stay in the arena (uint8) up to its
 * end, for the digests; otherwise the arena is scratch (for outputs not one contiguous run of floats). */
enum { BOUND_MAX = 16 };
typedef struct {   /* a stage of a pass whose output arrays were bound (bind): its name, id, arrays and their buffers */
    PyObject *stage, *arrays;
    int64_t id;
    buf v[8];
    Py_ssize_t k;
} bound_stage;

typedef struct {
    PyObject_HEAD
    buf arena, meta, stats;
    PyObject *stage_ids, *refused;
    Py_ssize_t n, used;   /* events and arena bytes held */
    int64_t mark;         /* the clock when the last event was held */
    int64_t held_ns;      /* the durations of every event held so far (a running total) */
    int64_t *last;        /* the rows of the batch before (the last reset), from META_STAGE on */
    Py_ssize_t last_n;
    int differs;          /* a row so far is not the batch before's */
    int keep;
    const kernel_path *path;   /* the path `leaf` is for (current_leaf without a strcmp per event) */
    leaf_fn leaf;
    bound_stage bound[BOUND_MAX];   /* the stages bound (bind), their outputs' start bound_start */
    int n_bound;
    int64_t bound_start;
} holder;

static int64_t now_ns(void) {   /* time.perf_counter_ns's clock */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* the float32 arrays' elements (C order) into dst */
static void copy_arrays(const buf *v, Py_ssize_t k, float *dst) {
    for (Py_ssize_t i = 0; i < k; i++) {
        const Py_buffer *b = &v[i].v;
        if (PyBuffer_IsContiguous(b, 'C')) { memcpy(dst, b->buf, (size_t)b->len); dst += b->len / 4; }
        else copy_c_order((const char *)b->buf, b->shape, b->strides, b->ndim, &dst);
    }
}

static int one_run(const buf *v, Py_ssize_t k) {   /* the arrays are one C-order run of memory, in order */
    for (Py_ssize_t i = 0; i < k; i++)
        if (!PyBuffer_IsContiguous(&v[i].v, 'C') || (i && (char *)v[i - 1].v.buf + v[i - 1].v.len != v[i].v.buf))
            return 0;
    return 1;
}

/* the id of a stage name (stage_ids: a new name gets the next id); -1 on a Python error */
static int64_t stage_id(holder *h, PyObject *stage) {
    PyObject *id = PyDict_GetItemWithError(h->stage_ids, stage);
    if (id) return PyLong_AsLongLong(id);
    if (PyErr_Occurred() || !(id = PyLong_FromSsize_t(PyDict_GET_SIZE(h->stage_ids)))) return -1;
    const int err = PyDict_SetItem(h->stage_ids, stage, id);
    Py_DECREF(id);
    return err ? -1 : (int64_t)PyDict_GET_SIZE(h->stage_ids) - 1;
}

/* hold one event, its k arrays' buffers taken: 0; -1 an array is not float32 (or the shapes do not fit a row): its row
 * holds no statistics; -2 no room in the arena or no row left (nothing held) */
static int hold_bufs(holder *h, int64_t id, int64_t ly, int64_t start, const buf *v, Py_ssize_t k, int64_t dur) {
    const Py_ssize_t width = h->meta.v.shape[1];
    if (h->n >= h->meta.v.shape[0]) return -2;
    Py_ssize_t need = 0;
    int status = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        if (!fmt_is(&v[i].v, 'f') || v[i].v.itemsize != 4) status = -1;
        need += v[i].v.len;
    }
    const int run = !status && one_run(v, k), copy = h->keep || !run;
    const Py_ssize_t at = h->keep ? h->used : 0;
    if (!status && copy && need > h->arena.v.len - at) return -2;
    int64_t *r = (int64_t *)h->meta.v.buf + h->n * width;
    r[META_START] = start; r[META_DUR] = dur; r[META_STAGE] = id; r[META_LAYER] = ly;
    if (!shapes_row(v, k, r, width)) status = -1;
    h->held_ns += dur;
    h->differs |= h->n >= h->last_n ||
                  memcmp(r + META_STAGE, h->last + h->n * (width - META_STAGE), (size_t)(width - META_STAGE) * 8);
    double *st = (double *)h->stats.v.buf + 3 * h->n;
    if (status) st[0] = st[1] = st[2] = NAN;
    else {
        const float *x = run && !copy ? (const float *)v[0].v.buf : (const float *)((char *)h->arena.v.buf + at);
        if (copy) copy_arrays(v, k, (float *)((char *)h->arena.v.buf + at));
        if (h->path != current_path()) h->path = current_path(), h->leaf = current_leaf();
        event_stats(h->leaf, x, need / 4, st);
        if (h->keep) h->used += need;
    }
    r[META_END] = h->used;
    h->n++;
    return status;
}

/* the arrays' buffers (a tuple of at most 8) into v: their number, -1 too many (not an error), -2 a Python error */
static Py_ssize_t get_arrays(PyObject *arrays, buf *v) {
    const Py_ssize_t k = PyTuple_GET_SIZE(arrays);
    if (k > 8) return -1;
    for (Py_ssize_t i = 0; i < k; i++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(arrays, i), &v[i].v, PyBUF_STRIDES | PyBUF_FORMAT) != 0) {
            for (Py_ssize_t j = 0; j < i; j++) release(&v[j]);
            return -2;
        }
        v[i].held = 1;
    }
    return k;
}

/* hold one event: hold_bufs' 0, -1, -2; -3 a Python error */
static int hold(holder *h, PyObject *stage, PyObject *layer, int64_t start, PyObject *arrays, int64_t dur) {
    if (h->n >= h->meta.v.shape[0]) return -2;
    buf v[8] = {{{0}}};
    const Py_ssize_t k = get_arrays(arrays, v);
    if (k < 0) return k == -1 ? -1 : -3;
    const int64_t id = stage_id(h, stage), ly = layer == Py_None ? -1 : PyLong_AsLongLong(layer);
    const int status = id < 0 || PyErr_Occurred() ? -3 : hold_bufs(h, id, ly, start, v, k, dur);
    for (Py_ssize_t i = 0; i < k; i++) release(&v[i]);
    return status;
}

/* an event not held as float32 (status -1: held, its statistics left to Python; -2: no room) to refused(stage, layer,
 * start, arrays, dur, status); -1 on a Python error */
static int refuse(holder *h, PyObject *stage, PyObject *layer, int64_t start, PyObject *arrays, int64_t dur, int status) {
    PyObject *r = PyObject_CallFunction(h->refused, "OOLOLi", stage, layer, (long long)start, arrays, (long long)dur,
                                        status);
    Py_XDECREF(r);
    return r ? 0 : -1;
}

/* note(stage, layer, start, arrays[, dur]): hold the event (arrays: a tuple of arrays); its dur_ns is `dur`, or
 * without it the time since the last event was held. An event not held as float32 (-1: held, its statistics left
 * to Python) or not held (-2: no room) is handed to refused(stage, layer, start, arrays, dur, status). */
static PyObject *holder_note(holder *h, PyObject *const *args, Py_ssize_t nargs) {
    const int64_t t = now_ns();
    if ((nargs != 4 && nargs != 5) || !PyTuple_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "note(stage, layer, start, arrays: tuple[, dur])");
        return NULL;
    }
    const int64_t start = PyLong_AsLongLong(args[2]), dur = nargs == 5 ? PyLong_AsLongLong(args[4]) : t - h->mark;
    if (PyErr_Occurred()) return NULL;
    int status = hold(h, args[0], args[1], start, args[3], dur);
    if (status == -3 || (status < 0 && refuse(h, args[0], args[1], start, args[3], dur, status))) return NULL;
    h->mark = now_ns();
    Py_RETURN_NONE;
}

static void unbind(holder *h) {
    for (int j = 0; j < h->n_bound; j++) {
        for (Py_ssize_t i = 0; i < h->bound[j].k; i++) release(&h->bound[j].v[i]);
        Py_CLEAR(h->bound[j].stage);
        Py_CLEAR(h->bound[j].arrays);
    }
    h->n_bound = 0;
}

/* bind(start, stages): a pass's stages (name -> tuple of its output arrays: buffers the pass rewrites in place, the
 * same at every layer), their buffers taken once for mark; their outputs' first position `start`. Replaces any
 * binding before. */
static PyObject *holder_bind(holder *h, PyObject *args) {
    long long start;
    PyObject *stages, *name, *arrays;
    if (!PyArg_ParseTuple(args, "LO!:bind", &start, &PyDict_Type, &stages)) return NULL;
    unbind(h);
    if (PyDict_GET_SIZE(stages) > BOUND_MAX) {
        PyErr_Format(PyExc_ValueError, "bind: at most %d stages, got %zd", BOUND_MAX, PyDict_GET_SIZE(stages));
        return NULL;
    }
    for (Py_ssize_t pos = 0; PyDict_Next(stages, &pos, &name, &arrays);) {
        bound_stage *b = &h->bound[h->n_bound];
        if (!PyUnicode_Check(name) || !PyTuple_Check(arrays) || PyTuple_GET_SIZE(arrays) > 8) {
            PyErr_SetString(PyExc_TypeError, "bind: stages must map a stage name to a tuple of at most 8 arrays");
            goto fail;
        }
        if ((b->id = stage_id(h, name)) < 0 || (b->k = get_arrays(arrays, b->v)) < 0) goto fail;
        b->stage = Py_NewRef(name);
        b->arrays = Py_NewRef(arrays);
        h->n_bound++;
    }
    h->bound_start = start;
    Py_RETURN_NONE;
fail:
    unbind(h);
    return NULL;
}

/* mark(stage, layer): hold the event of a bound stage (its arrays as they are now), its dur_ns the time since the last
 * event was held -- note without taking the arrays' buffers again */
static PyObject *holder_mark(holder *h, PyObject *const *args, Py_ssize_t nargs) {
    const int64_t t = now_ns();
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "mark(stage, layer)");
        return NULL;
    }
    const bound_stage *b = NULL;
    for (int j = 0; j < h->n_bound && !b; j++)   /* the name as bound (a constant: the same object), else equal */
        if (h->bound[j].stage == args[0]) b = &h->bound[j];
    for (int j = 0; j < h->n_bound && !b; j++)
        if (PyUnicode_Check(args[0]) && PyUnicode_Compare(h->bound[j].stage, args[0]) == 0) b = &h->bound[j];
    if (!b) {
        PyErr_Format(PyExc_KeyError, "mark: stage %R is not bound", args[0]);
        return NULL;
    }
    const int64_t ly = args[1] == Py_None ? -1 : PyLong_AsLongLong(args[1]), dur = t - h->mark;
    if (PyErr_Occurred()) return NULL;
    const int status = hold_bufs(h, b->id, ly, h->bound_start, b->v, b->k, dur);
    if (status < 0 && refuse(h, b->stage, args[1], h->bound_start, b->arrays, dur, status)) return NULL;
    h->mark = now_ns();
    Py_RETURN_NONE;
}

static PyObject *holder_unbind(holder *h, PyObject *unused) {   /* unbind(): release the stages bound */
    (void)unused;
    unbind(h);
    Py_RETURN_NONE;
}

/* reset([arena]): forget the events held (a drain took them; their rows, from META_STAGE on, kept to compare the next
 * batch's with), holding into `arena` from now on if given */
static PyObject *holder_reset(holder *h, PyObject *args) {
    PyObject *ao = NULL;
    if (!PyArg_ParseTuple(args, "|O:reset", &ao)) return NULL;
    if (ao) {
        buf a = {0};
        if (PyObject_GetBuffer(ao, &a.v, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) return NULL;
        a.held = 1;
        release(&h->arena);
        h->arena = a;
    }
    const Py_ssize_t width = h->meta.v.shape[1];
    for (Py_ssize_t e = 0; e < h->n; e++)
        memcpy(h->last + e * (width - META_STAGE), (const int64_t *)h->meta.v.buf + e * width + META_STAGE,
               (size_t)(width - META_STAGE) * 8);
    h->last_n = h->n;
    h->n = h->used = 0;
    h->differs = 0;
    Py_RETURN_NONE;
}

static PyObject *holder_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    (void)kw;
    PyObject *ao, *mo, *so, *ids, *refused;
    int keep;
    if (!PyArg_ParseTuple(args, "OOOO!Op:TraceHolder", &ao, &mo, &so, &PyDict_Type, &ids, &refused, &keep))
        return NULL;
    holder *h = (holder *)type->tp_alloc(type, 0);
    if (!h) return NULL;
    h->stage_ids = Py_NewRef(ids);
    h->refused = Py_NewRef(refused);
    h->keep = keep;
    h->mark = now_ns();
    if (PyObject_GetBuffer(ao, &h->arena.v, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) goto fail;
    h->arena.held = 1;
    if (get_c(mo, "meta", 'q', 8, 1, &h->meta) || get_c(so, "stats", 'd', 8, 1, &h->stats)) goto fail;
    if (h->meta.v.ndim != 2 || h->meta.v.shape[1] < META_SHAPES + 2 || h->stats.v.len < 24 * h->meta.v.shape[0]) {
        PyErr_SetString(PyExc_ValueError, "TraceHolder: meta must be int64 [rows, width >= 7], stats float64 [rows, 3]");
        goto fail;
    }
    h->last = malloc((size_t)h->meta.v.shape[0] * (size_t)(h->meta.v.shape[1] - META_STAGE) * 8 + 8);
    if (!h->last) { PyErr_NoMemory(); goto fail; }
    return (PyObject *)h;
fail:
    Py_DECREF(h);
    return NULL;
}

static int holder_traverse(holder *h, visitproc visit, void *arg) {
    Py_VISIT(h->stage_ids);
    Py_VISIT(h->refused);
    for (int j = 0; j < h->n_bound; j++) Py_VISIT(h->bound[j].arrays);
    return 0;
}

static int holder_clear(holder *h) {
    unbind(h);
    Py_CLEAR(h->stage_ids);
    Py_CLEAR(h->refused);
    return 0;
}

static void holder_dealloc(holder *h) {
    PyObject_GC_UnTrack(h);
    holder_clear(h);
    release(&h->arena); release(&h->meta); release(&h->stats);
    free(h->last);
    Py_TYPE(h)->tp_free((PyObject *)h);
}

static PyMethodDef holder_methods[] = {
    {"note", (PyCFunction)(void (*)(void))holder_note, METH_FASTCALL,
     "note(stage, layer, start, arrays[, dur]): hold one stage event"},
    {"reset", (PyCFunction)holder_reset, METH_VARARGS, "reset([arena]): forget the events held"},
    {"bind", (PyCFunction)holder_bind, METH_VARARGS, "bind(start, {stage: arrays}): a pass's stages, for mark"},
    {"mark", (PyCFunction)(void (*)(void))holder_mark, METH_FASTCALL, "mark(stage, layer): hold a bound stage's event"},
    {"unbind", (PyCFunction)holder_unbind, METH_NOARGS, "unbind(): release the stages bound"},
    {NULL, NULL, 0, NULL},
};

static PyObject *holder_repeats(holder *h, void *closure) {
    (void)closure;
    return PyBool_FromLong(h->n == h->last_n && !h->differs);
}

static PyGetSetDef holder_getset[] = {
    {"repeats", (getter)holder_repeats, NULL, "the rows held are the batch before's (stages, layers, shapes)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef holder_members[] = {
    {"n", T_PYSSIZET, offsetof(holder, n), READONLY, "events held"},
    {"used", T_PYSSIZET, offsetof(holder, used), READONLY, "arena bytes held"},
    {"held_ns", T_LONGLONG, offsetof(holder, held_ns), READONLY, "the durations of every event held, in all"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject holder_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tracelm.kernels._core.TraceHolder",
    .tp_basicsize = sizeof(holder),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "TraceHolder(arena, meta, stats, stage_ids, refused, keep): a batch of stage events as they come",
    .tp_new = holder_new,
    .tp_dealloc = (destructor)holder_dealloc,
    .tp_traverse = (traverseproc)holder_traverse,
    .tp_clear = (inquiry)holder_clear,
    .tp_methods = holder_methods,
    .tp_members = holder_members,
    .tp_getset = holder_getset,
};

static PyTypeObject pending_type;   /* PendingLines, below */

int add_trace_types(PyObject *m) {
    if (PyType_Ready(&holder_type) < 0 || PyType_Ready(&pending_type) < 0) return -1;
    Py_INCREF(&holder_type);
    if (PyModule_AddObject(m, "TraceHolder", (PyObject *)&holder_type) < 0) { Py_DECREF(&holder_type); return -1; }
    return 0;
}

typedef struct {
    leaf_fn leaf8;
    int ni;
    const uint8_t *arena;
    const int64_t *offsets, *order;   /* the events, largest first */
    int64_t n;
    double *stats;
    uint8_t *dig;
} stats_job;

static void event_digests(const stats_job *j, int64_t a, int64_t b) {   /* events a and b (b < 0: a alone) */
    const int64_t *o = j->offsets;
    uint8_t ha[32], hb[32];
    if (b < 0) sha256(j->arena + o[a], (size_t)(o[a + 1] - o[a]), ha, j->ni);
    else sha256_x2(j->arena + o[a], (size_t)(o[a + 1] - o[a]), j->arena + o[b], (size_t)(o[b + 1] - o[b]), ha, hb, j->ni);
    memcpy(j->dig + 16 * a, ha, 16);
    if (b >= 0) memcpy(j->dig + 16 * b, hb, 16);
}

/* task t: the events order[2t] and order[2t + 1] (their digests hashed side by side) */
static void stats_tasks(void *ctx, int64_t t0, int64_t t1) {
    const stats_job *j = (const stats_job *)ctx;
    for (int64_t t = t0; t < t1; t++) {
        const int64_t a = j->order[2 * t], b = 2 * t + 1 < j->n ? j->order[2 * t + 1] : -1;
        for (int k = 0; k < 2; k++) {
            const int64_t e = k ? b : a;
            if (e >= 0 && j->stats) event_stats(j->leaf8, (const float *)(j->arena + j->offsets[e]),
                                    (j->offsets[e + 1] - j->offsets[e]) / 4, j->stats + 3 * e);
        }
        if (j->dig) event_digests(j, a, b);
    }
}

static const int64_t *sizes_for_sort;
static int larger_first(const void *x, const void *y) {
    const int64_t a = *(const int64_t *)x, b = *(const int64_t *)y, *o = sizes_for_sort;
    const int64_t sa = o[a + 1] - o[a], sb = o[b + 1] - o[b];
    return sa != sb ? (sa < sb) - (sa > sb) : (a > b) - (a < b);
}


/* trace_stats(arena, offsets, stats, digests): event e is the float32 values at byte offsets[e]..offsets[e+1] of
 * arena; stats[e] = (mean, rms, maxabs), digests[e] = its sha256's first 16 bytes (stats or digests None: none).
 * Events run on the pool. */
static PyObject *py_trace_stats(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ao, *oo, *so, *dobj;
    if (!PyArg_ParseTuple(args, "OOOO:trace_stats", &ao, &oo, &so, &dobj)) return NULL;
    buf arena = {0}, offs = {0}, st = {0}, dg = {0};
    PyObject *ret = NULL;
    if (get_c(ao, "arena", 'B', 1, 0, &arena) || get_c(oo, "offsets", 'q', 8, 0, &offs) ||
        (so != Py_None && get_c(so, "stats", 'd', 8, 1, &st)) ||
        (dobj != Py_None && get_c(dobj, "digests", 'B', 1, 1, &dg)))
        goto done;
    const int64_t n = offs.v.len / 8 - 1, *o = (const int64_t *)offs.v.buf;
    for (int64_t e = 0; e < n; e++)
        if (o[e] < 0 || o[e + 1] < o[e] || o[e + 1] > arena.v.len || (o[e + 1] - o[e]) % 4 || o[e] % 4) {
            PyErr_Format(PyExc_ValueError, "trace_stats: event %lld's offsets are not whole floats in the arena",
                         (long long)e);
            goto done;
        }
    if (n < 0 || (st.held && st.v.len < 24 * n) || (dg.held && dg.v.len < 16 * n)) {
        PyErr_SetString(PyExc_ValueError, "trace_stats: stats [n, 3] / digests [n, 16] too small for the offsets");
        goto done;
    }
    int64_t *order = malloc((size_t)(n + 1) * sizeof(int64_t));
    if (!order) { PyErr_NoMemory(); goto done; }
    for (int64_t e = 0; e < n; e++) order[e] = e;
    sizes_for_sort = o;   /* under the GIL */
    qsort(order, (size_t)n, sizeof(int64_t), larger_first);
    stats_job j = {current_leaf(), use_sha_ni(), (const uint8_t *)arena.v.buf, o, order, n, st.held ? (double *)st.v.buf : NULL,
                   dg.held ? (uint8_t *)dg.v.buf : NULL};
    Py_BEGIN_ALLOW_THREADS
    pool_run(stats_tasks, &j, (n + 1) / 2, 2);
    Py_END_ALLOW_THREADS
    free(order);
    ret = Py_None;
    Py_INCREF(ret);
done:
    release(&arena); release(&offs); release(&st); release(&dg);
    return ret;
}

/* the one-byte fields of a line template */
enum { FIELD_SEQ = 1, FIELD_TOK, FIELD_START, FIELD_MEAN, FIELD_RMS, FIELD_MAXABS, FIELD_DIGEST, FIELD_DUR };

enum { FIELD_ROOM = 64 };   /* the most bytes one field takes */
enum { LINE_TAIL = 65 + 9 + 64 + 73 + 3 };   /* the most bytes after a head: prev, hash, mac, '}' and '\n' */
enum { STEP_LINES = 8 };    /* lines per step of a batch (a few microseconds: a worker stepping it joins a job soon) */

/* A batch's lines, rendered in order a few at a time (lines_step): by the pool's waiting worker between kernel jobs
 * when posted (trace_lines_post), else by the caller. Line e is its head from the template with its fields filled
 * in, then prev + '"': its BODY, hashed; then ',"hash":"H"' [',"mac":"HMAC(key, H)"'] '}' and '\n'. The job reads
 * the template in place (its str is kept alive by whoever holds the job) and owns copies of the rest, so the holder's
 * rows are free again as soon as it is posted. A template that does not fit is found as its lines are rendered:
 * the job stops there, and its result is the error. */
typedef struct {
    const char *tpl;        /* the template's line heads, each ended by '\0' (not owned) */
    size_t tlen, at;        /* its length; where the next line's head starts */
    char *tail;             /* one more line after them (its whole head, no fields), or NULL */
    size_t tail_len;
    int64_t rows, next;     /* the template's lines (one per event); the next line to render */
    int64_t seq, tok;
    int64_t *start_dur;     /* event e's start and dur_ns */
    double *stats;          /* [rows][3] */
    uint8_t *digests;       /* [rows][16], or NULL */
    uint8_t *key;           /* NULL: unsigned */
    size_t klen;
    int ni;
    char *out;              /* the lines so far */
    size_t len, cap;
    const char *error;      /* why the job stopped early, or NULL */
    char prev[64];          /* the last line's hash (the one before the batch until its first line) */
} lines_job;

/* one field of event e at o; returns its length */
static int put_field(int field, const lines_job *j, int64_t e, char *o) {
    switch (field) {
    case FIELD_SEQ: return fmt_int(j->seq + e, o);
    case FIELD_TOK: return fmt_int(j->tok, o);
    case FIELD_START: return fmt_int(j->start_dur[2 * e], o);
    case FIELD_MEAN: case FIELD_RMS: case FIELD_MAXABS: return fmt_stat(j->stats[3 * e + field - FIELD_MEAN], o);
    case FIELD_DIGEST: hex_of(j->digests + 16 * e, 16, o); return 32;
    default: return fmt_us(j->start_dur[2 * e + 1], o);
    }
}

/* the first field byte (<= FIELD_DUR: a field or the line's NUL) in [p, end): eight bytes at a time while none is
 * below 9 (a byte b < 0x80 has b - 9 negative exactly when b < 9; a borrow only follows such a byte) */
static const char *next_field(const char *p, const char *end) {
    for (uint64_t w; end - p >= 8; p += 8) {
        memcpy(&w, p, 8);
        if ((w - 0x0909090909090909ULL) & ~w & 0x8080808080808080ULL) break;
    }
    while (p < end && (unsigned char)*p > FIELD_DUR) p++;
    return p;
}

static int room(lines_job *j, size_t n) {   /* at least n more bytes of out; 0 on no memory */
    if (j->len + n <= j->cap) return 1;
    size_t cap = 2 * j->cap > j->len + n ? 2 * j->cap : j->len + n;
    char *out = realloc(j->out, cap);
    if (!out) return 0;
    j->out = out; j->cap = cap;
    return 1;
}

/* line e (its head [p, end), with fields when it is an event's) to out; 0 when it cannot be */
static int render_line(lines_job *j, int64_t e, const char *p, const char *end, int fields) {
    const size_t line = j->len;
    while (p < end) {
        const char *q = fields ? next_field(p, end) : end;
        if (!room(j, (size_t)(q - p) + FIELD_ROOM + LINE_TAIL)) { j->error = "out of memory"; return 0; }
        memcpy(j->out + j->len, p, (size_t)(q - p));
        j->len += (size_t)(q - p);
        if ((p = q) < end) {
            if (*p == FIELD_DIGEST && !j->digests) { j->error = "the template has digests and none were given"; return 0; }
            j->len += (size_t)put_field((unsigned char)*p++, j, e, j->out + j->len);
        }
    }
    if (!room(j, LINE_TAIL)) { j->error = "out of memory"; return 0; }
    char *o = j->out + j->len;
    memcpy(o, j->prev, 64); o += 64;
    *o++ = '"';
    uint8_t h[32];
    sha256(j->out + line, (size_t)(o - (j->out + line)), h, j->ni);
    hex_of(h, 32, j->prev);
    memcpy(o, ",\"hash\":\"", 9); o += 9;
    memcpy(o, j->prev, 64); o += 64;
    if (j->key) {
        uint8_t m[32];
        hmac_sha256(j->key, j->klen, j->prev, 64, m, j->ni);
        memcpy(o, "\",\"mac\":\"", 9); o += 9;
        hex_of(m, 32, o); o += 64;
    }
    memcpy(o, "\"}\n", 3); o += 3;
    j->len = (size_t)(o - j->out);
    return 1;
}

static int lines_done(const lines_job *j) { return j->error || j->next == j->rows + (j->tail != NULL); }

static int lines_step(void *ctx) {   /* idle_fn: the next STEP_LINES lines */
    lines_job *j = (lines_job *)ctx;
    for (int k = 0; k < STEP_LINES && !lines_done(j); k++, j->next++) {
        if (j->next == j->rows) {   /* the tail, once the template is used up */
            if (j->at != j->tlen) j->error = "the template's lines are more than the events";
            else render_line(j, j->next, j->tail, j->tail + j->tail_len, 0);
            continue;
        }
        const char *p = j->tpl + j->at, *z = memchr(p, '\0', j->tlen - j->at);
        if (!z) j->error = "the template's lines are fewer than the events";
        else if (render_line(j, j->next, p, z, 1)) j->at = (size_t)(z + 1 - j->tpl);
    }
    if (!j->error && !j->tail && j->next == j->rows && j->at != j->tlen)
        j->error = "the template's lines are more than the events";
    return lines_done(j);
}

static void lines_free(lines_job *j) {
    if (!j) return;
    free(j->tail); free(j->start_dur); free(j->stats); free(j->digests); free(j->key); free(j->out);
    free(j);
}

/* the job of trace_lines' arguments (the template read in place), prev its first line's prev; NULL with a Python
 * error when they do not fit */
static lines_job *lines_job_new(const char *tpl, size_t tlen, const char *tail, size_t tail_len, int64_t seq, int64_t tok,
                                const buf *meta, const buf *stats, const buf *dg, const buf *key, const char *prev) {
    const int64_t rows = meta->v.shape[0], width = meta->v.shape[1];
    for (size_t i = 0; tail && i < tail_len; i++)
        if ((unsigned char)tail[i] <= FIELD_DUR) {
            PyErr_SetString(PyExc_ValueError, "trace_lines: the tail line has a field or a NUL");
            return NULL;
        }
    lines_job *j = calloc(1, sizeof(lines_job));
    if (!j) { PyErr_NoMemory(); return NULL; }
    j->tpl = tpl; j->tlen = tlen; j->rows = rows; j->seq = seq; j->tok = tok; j->ni = use_sha_ni();
    memcpy(j->prev, prev, 64);
    j->start_dur = malloc((size_t)(rows ? rows : 1) * 2 * sizeof(int64_t));
    j->stats = malloc((size_t)(rows ? rows : 1) * 3 * sizeof(double));
    if (tail) j->tail = malloc(tail_len ? tail_len : 1);
    if (dg->held) j->digests = malloc((size_t)(rows ? rows : 1) * 16);
    if (key->held) j->key = malloc((size_t)(key->v.len ? key->v.len : 1));
    j->cap = tlen + tail_len + (size_t)(rows + 1) * (6 * 24 + 32 + LINE_TAIL);   /* room enough for usual fields */
    j->out = malloc(j->cap);
    if (!j->start_dur || !j->stats || (tail && !j->tail) || (dg->held && !j->digests) || (key->held && !j->key) ||
        !j->out) {
        lines_free(j);
        PyErr_NoMemory();
        return NULL;
    }
    if (tail) { memcpy(j->tail, tail, tail_len); j->tail_len = tail_len; }
    const int64_t *m = (const int64_t *)meta->v.buf;
    for (int64_t e = 0; e < rows; e++) {
        j->start_dur[2 * e] = m[e * width + META_START];
        j->start_dur[2 * e + 1] = m[e * width + META_DUR];
    }
    memcpy(j->stats, stats->v.buf, (size_t)rows * 24);
    if (dg->held) memcpy(j->digests, dg->v.buf, (size_t)rows * 16);
    if (key->held) { memcpy(j->key, key->v.buf, (size_t)key->v.len); j->klen = (size_t)key->v.len; }
    return j;
}

/* the arguments of trace_lines (and trace_lines_post): a new job, or NULL with a Python error; *tpl_obj: the template
 * (a str), which must outlive the job */
static lines_job *lines_job_of(PyObject *args, const char *fn, PyObject **tpl_obj) {
    const char *prev_in, *tail = NULL;
    Py_ssize_t plen, tail_len = 0, tlen;
    long long seq, tok;
    PyObject *mo, *sto, *dobj, *ko;
    char format[48];
    snprintf(format, sizeof format, "ULLOOOs#O|z#:%s", fn);
    if (!PyArg_ParseTuple(args, format, tpl_obj, &seq, &tok, &mo, &sto, &dobj, &prev_in, &plen, &ko, &tail, &tail_len))
        return NULL;
    const char *tpl = PyUnicode_AsUTF8AndSize(*tpl_obj, &tlen);
    if (!tpl) return NULL;
    buf meta = {0}, stats = {0}, dg = {0}, key = {0};
    lines_job *j = NULL;
    if (get_c(mo, "meta", 'q', 8, 0, &meta) || get_c(sto, "stats", 'd', 8, 0, &stats) ||
        (dobj != Py_None && get_c(dobj, "digests", 'B', 1, 0, &dg)))
        goto done;
    if (ko != Py_None && PyObject_GetBuffer(ko, &key.v, PyBUF_SIMPLE) != 0) goto done;
    key.held = ko != Py_None;
    if (plen != 64 || meta.v.ndim != 2 || meta.v.shape[1] <= META_DUR || stats.v.len / 24 < meta.v.shape[0] ||
        (dg.held && dg.v.len / 16 < meta.v.shape[0])) {
        PyErr_Format(PyExc_ValueError, "%s: prev must be 64 hex digits; meta [n, width], stats, digests one row per "
                     "event", fn);
        goto done;
    }
    j = lines_job_new(tpl, (size_t)tlen, tail, (size_t)tail_len, seq, tok, &meta, &stats, &dg, &key, prev_in);
done:
    release(&meta); release(&stats); release(&dg); release(&key);
    return j;
}

static PyObject *lines_result(lines_job *j) {   /* (lines, last hash) of a complete job, or its error */
    if (j->error) {
        if (strcmp(j->error, "out of memory") == 0) return PyErr_NoMemory();
        return PyErr_Format(PyExc_ValueError, "trace_lines: %s", j->error);
    }
    PyObject *text = PyUnicode_FromStringAndSize(j->out, (Py_ssize_t)j->len);
    return text ? Py_BuildValue("(Ns#)", text, j->prev, (Py_ssize_t)64) : NULL;
}

/* trace_lines(template, seq, tok, meta, stats, digests, prev, key[, tail]) -> (lines, last hash): the batch's lines,
 * each ended by '\n' (template: one line head per event, each ended by '\0', with one-byte fields FIELD_*; seq of the
 * first line; meta int64 [n, width], the holder's rows: start and dur_ns in columns META_START, META_DUR; stats
 * float64 [n, 3]; digests uint8 [n, 16] or None; prev the hash before the first line; key the HMAC key or None;
 * tail: one more line after them, its head given whole) */
static PyObject *py_trace_lines(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *tpl;
    lines_job *j = lines_job_of(args, "trace_lines", &tpl);
    if (!j) return NULL;
    Py_BEGIN_ALLOW_THREADS
    while (!lines_step(j)) {}
    Py_END_ALLOW_THREADS
    PyObject *ret = lines_result(j);
    lines_free(j);
    return ret;
}

/* PendingLines: a batch posted to the pool's idle work; result() completes it (on this thread, what is left) */
typedef struct {
    PyObject_HEAD
    lines_job *job;
    PyObject *template;   /* the str the job reads */
} pending;

static void pending_finish(pending *p) {
    Py_BEGIN_ALLOW_THREADS
    pool_idle_finish(p->job);
    while (!lines_step(p->job)) {}   /* a job finished by an earlier post's caller: nothing left */
    Py_END_ALLOW_THREADS
}

/* result(text=True) -> (lines, last hash): the lines as a str, or (text False) this object, a bytes-like view of them
 * in UTF-8 (written as they are, not copied) */
static PyObject *pending_result(pending *p, PyObject *args) {
    int text = 1;
    if (!PyArg_ParseTuple(args, "|p:result", &text)) return NULL;
    pending_finish(p);
    if (text || p->job->error) return lines_result(p->job);
    return Py_BuildValue("(Os#)", (PyObject *)p, p->job->prev, (Py_ssize_t)64);
}

static int pending_getbuffer(pending *p, Py_buffer *view, int flags) {
    pending_finish(p);
    if (p->job->error) {
        PyErr_Format(PyExc_ValueError, "trace_lines: %s", p->job->error);
        view->obj = NULL;
        return -1;
    }
    return PyBuffer_FillInfo(view, (PyObject *)p, p->job->out, (Py_ssize_t)p->job->len, 1, flags);
}

static PyBufferProcs pending_as_buffer = {.bf_getbuffer = (getbufferproc)pending_getbuffer};

static void pending_dealloc(pending *p) {
    if (p->job) {
        Py_BEGIN_ALLOW_THREADS
        pool_idle_finish(p->job);   /* no worker reads it any more */
        Py_END_ALLOW_THREADS
        lines_free(p->job);
    }
    Py_XDECREF(p->template);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

static PyMethodDef pending_methods[] = {
    {"result", (PyCFunction)pending_result, METH_VARARGS,
     "result(text=True) -> (lines, last hash), once they are all rendered: lines a str, or this bytes-like object"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject pending_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tracelm.kernels._core.PendingLines",
    .tp_basicsize = sizeof(pending),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "a batch of trace lines being rendered on the pool's idle worker (trace_lines_post)",
    .tp_dealloc = (destructor)pending_dealloc,
    .tp_methods = pending_methods,
    .tp_as_buffer = &pending_as_buffer,
};

/* trace_lines_post(the arguments of trace_lines) -> PendingLines: the same lines, rendered by the pool's worker while
 * it waits between kernel jobs (posting finishes any batch posted before, on this thread) */
static PyObject *py_trace_lines_post(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *tpl;
    lines_job *j = lines_job_of(args, "trace_lines_post", &tpl);
    if (!j) return NULL;
    pending *p = PyObject_New(pending, &pending_type);
    if (!p) { lines_free(j); return NULL; }
    p->job = j;
    p->template = Py_NewRef(tpl);
    Py_BEGIN_ALLOW_THREADS
    pool_idle_post(lines_step, j);
    Py_END_ALLOW_THREADS
    return (PyObject *)p;
}

/* ---- for the tests: the pieces alone ---- */
static PyObject *py_trace_sha256(PyObject *self, PyObject *args) {   /* trace_sha256(data, ni) -> 32 bytes */
    (void)self;
    Py_buffer v;
    int ni;
    if (!PyArg_ParseTuple(args, "y*p:trace_sha256", &v, &ni)) return NULL;
    uint8_t h[32];
    sha256(v.buf, (size_t)v.len, h, ni && sha256_ni_available());
    PyBuffer_Release(&v);
    return PyBytes_FromStringAndSize((const char *)h, 32);
}

static PyObject *py_trace_hmac(PyObject *self, PyObject *args) {   /* trace_hmac(key, msg, ni) -> 32 bytes */
    (void)self;
    Py_buffer k, v;
    int ni;
    if (!PyArg_ParseTuple(args, "y*y*p:trace_hmac", &k, &v, &ni)) return NULL;
    uint8_t h[32];
    hmac_sha256((const uint8_t *)k.buf, (size_t)k.len, v.buf, (size_t)v.len, h, ni && sha256_ni_available());
    PyBuffer_Release(&k);
    PyBuffer_Release(&v);
    return PyBytes_FromStringAndSize((const char *)h, 32);
}

static PyObject *py_trace_format(PyObject *self, PyObject *args) {   /* trace_format(x, ns) -> (stat, dur_us) */
    (void)self;
    double x;
    long long ns;
    if (!PyArg_ParseTuple(args, "dL:trace_format", &x, &ns)) return NULL;
    char a[64], b[400];
    int na = fmt_stat(x, a), nb = fmt_us(ns, b);
    return Py_BuildValue("(s#s#)", a, (Py_ssize_t)na, b, (Py_ssize_t)nb);
}

PyMethodDef trace_methods[] = {
    {"trace_stats", py_trace_stats, METH_VARARGS,
     "trace_stats(arena, offsets, stats, digests): per event mean, rms, max|x| (and sha256-128)"},
    {"trace_lines", py_trace_lines, METH_VARARGS,
     "trace_lines(template, seq, tok, meta, stats, digests, prev, key[, tail]) -> (lines, last hash)"},
    {"trace_lines_post", py_trace_lines_post, METH_VARARGS,
     "trace_lines_post(template, seq, tok, meta, stats, digests, prev, key[, tail]) -> PendingLines: rendered on "
     "the pool's idle worker; .result() -> (lines, last hash)"},
    {"trace_sha256", py_trace_sha256, METH_VARARGS, "trace_sha256(data, ni): sha256 (plain C or SHA-NI)"},
    {"trace_hmac", py_trace_hmac, METH_VARARGS, "trace_hmac(key, msg, ni): HMAC-SHA256"},
    {"trace_format", py_trace_format, METH_VARARGS, "trace_format(x, ns): (_num(x), '%.1f' % (ns / 1000))"},
    {NULL, NULL, 0, NULL},
};
