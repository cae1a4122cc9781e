/* tracelm.kernels._core, the layer kernels' Python face: rms_norm, rms_norm_add, rope, attend (and attend_parts: the
 * attends of a pass's sequences as one job, each storing its own new keys/values first), silu_mul,
 * gelu_tanh_mul, and the kernels' own exp and tanh (for the tests). Arguments are checked as core.c checks
 * matmul's (a ValueError naming the argument, its shape and dtype); the work runs on the current path's layer_ops
 * (portable or AVX2), over the pool when there is enough of it, the GIL released. The orders: kernels.h.
 *
 * Strides: every array is read through its strides (in items); the last dim of q, x, values, out, cos, sin must be
 * unit-strided, keys may have any strides (the Cache keeps them as a transposed view). An out may be its input
 * itself (rms_norm, rms_norm_add, rope, exp, tanh) but no other overlap: its rows must lie apart, and what a call
 * writes shares no byte with anything else it reads or writes (check_apart: a ValueError).
 *
 * attend's scratch: one buffer per thread (thread-local, grown to the largest task seen, freed when the thread
 * ends): per task of nh heads over a span of n keys, qs and acc [nh][hd], a tile (keys, or q8_0's) and the scores
 * [nh][n] (kernels.h, attend_scratch_floats); in phases the scores of every row and head are one buffer of the
 * calling thread's, grown alike -- no allocation per call once warm.
 */
#include "pyglue.h"

#include <float.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#define SERIAL_WORK (1 << 15)   /* fewer values (x dims) than this: run on the calling thread */
#define PHASE_KEYS 512          /* attend in phases from spans this long (measured: they pay from ~500 keys) */

/* ======================================================================================================
 * arrays
 * ==================================================================================================== */
typedef struct { buf b; int ndim; int64_t n[3], s[3]; } arr;   /* shape and strides (in items) */

enum { K_F32, K_F32_OR_F16, K_KV, K_I64, K_U8, K_F32_OR_F64 };   /* K_KV: float32, float16, or uint8 (q8_0 blocks) */

static int fail(const char *fn, const char *name, const arr *a, const char *what) {
    char shp[96];
    shape_str(&a->b.v, shp, sizeof shp);
    PyErr_Format(PyExc_ValueError, "%s: %s %s, got shape %s, format '%s' (itemsize %zd)", fn, name, what, shp,
                 fmt_name(&a->b.v), a->b.v.itemsize);
    return -1;
}

/* a float32 (or float16, or int64) array of nd_lo..nd_hi dims, strides a whole number of items */
static int get_arr(PyObject *o, const char *fn, const char *name, int kind, int nd_lo, int nd_hi, int writable,
                   arr *a) {
    if (PyObject_GetBuffer(o, &a->b.v, PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) != 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: %s must be a%s numpy array (buffer), got %s", fn, name,
                     writable ? " writable" : "", Py_TYPE(o)->tp_name);
        return -1;
    }
    a->b.held = 1;
    const Py_buffer *v = &a->b.v;
    const int u8 = fmt_is(v, 'B') && v->itemsize == 1;
    int ok = kind == K_I64 ? v->itemsize == 8 && (fmt_is(v, 'l') || fmt_is(v, 'q'))
           : kind == K_U8 ? u8
           : kind == K_F32_OR_F64 ? (fmt_is(v, 'f') && v->itemsize == 4) || (fmt_is(v, 'd') && v->itemsize == 8)
           : (fmt_is(v, 'f') && v->itemsize == 4) || (kind != K_F32 && fmt_is(v, 'e') && v->itemsize == 2) ||
             (kind == K_KV && u8);
    if (!ok)
        return fail(fn, name, a, kind == K_I64 ? "must be int64" : kind == K_F32 ? "must be float32" :
                                 kind == K_U8 ? "must be uint8" : kind == K_F32_OR_F64 ? "must be float32 or float64" :
                                 kind == K_KV ? "must be float32, float16 or uint8 (q8_0 blocks)" : "must be float32 or float16");
    if (v->ndim < nd_lo || v->ndim > nd_hi) {
        char want[32];
        snprintf(want, sizeof want, nd_lo == nd_hi ? "must be %d-D" : "must be %d-D or %d-D", nd_lo, nd_hi);
        return fail(fn, name, a, want);
    }
    a->ndim = v->ndim;
    for (int i = 0; i < v->ndim; i++) {
        Py_ssize_t st = v->strides ? v->strides[i] : 0;
        if (!v->strides) {   /* C-contiguous */
            st = v->itemsize;
            for (int k = i + 1; k < v->ndim; k++) st *= v->shape[k];
        }
        if (st % v->itemsize) return fail(fn, name, a, "must have strides that are whole items");
        a->n[i] = v->shape[i];
        a->s[i] = v->shape[i] > 1 ? st / v->itemsize : 0;   /* a dim of size 1: its stride is never used */
    }
    return 0;
}

static int unit_last(const char *fn, const char *name, const arr *a) {
    int l = a->ndim - 1;
    return a->n[l] > 1 && a->s[l] != 1 ? fail(fn, name, a, "must have unit stride in its last dim") : 0;
}

/* a 2-D array as 3-D [n0, 1, n1] */
static void as3(arr *a) {
    if (a->ndim == 2) {
        a->n[2] = a->n[1]; a->s[2] = a->s[1];
        a->n[1] = 1; a->s[1] = 0;
        a->ndim = 3;
    }
}

/* an output [n0, n1, d] (3-D): unit last stride, rows (a, b) at positive strides, none overlapping another */
static int rows_apart(const char *fn, const char *name, const arr *a) {
    int64_t n0 = a->n[0], n1 = a->n[1], d = a->n[2], s0 = a->s[0], s1 = a->s[1];
    if (unit_last(fn, name, a)) return -1;
    if ((n1 <= 1 || s1 >= d) && (n0 <= 1 || s0 >= (n1 > 1 ? (n1 - 1) * s1 : 0) + d)) return 0;
    return fail(fn, name, a, "must have its rows apart at positive strides (e.g. a slice of a C-contiguous array)");
}

static int same_shape(const char *fn, const char *name, const arr *a, const char *ref_name, const arr *ref) {
    int same = a->ndim == ref->ndim;
    for (int i = 0; same && i < a->ndim; i++) same = a->n[i] == ref->n[i];
    if (same) return 0;
    char want[128], shp[96];
    shape_str(&ref->b.v, shp, sizeof shp);
    snprintf(want, sizeof want, "must have the shape of %s %s", ref_name, shp);
    return fail(fn, name, a, want);
}

static rows3 rows_of(const arr *a) { return (rows3){(const float *)a->b.v.buf, a->s[0], a->s[1]}; }

static void run(task_fn fn, void *ctx, int64_t ntasks, int64_t work) {
    if (work < SERIAL_WORK) fn(ctx, 0, ntasks);
    else pool_run(fn, ctx, ntasks, chunk_for(ntasks));
}

/* ======================================================================================================
 * rms_norm, rms_norm_add
 * ==================================================================================================== */
typedef struct { const layer_ops *ops; rows3 x, res, out; int64_t nb, d; const float *w; float eps; } rms_ctx;

static void rms_tasks(void *ctx, int64_t r0, int64_t r1) {
    const rms_ctx *c = (const rms_ctx *)ctx;
    for (int64_t r = r0; r < r1; r++) {
        const int64_t a = r / c->nb, b = r % c->nb;
        const float *x = c->x.p + a * c->x.s0 + b * c->x.s1;
        const float *res = c->res.p ? c->res.p + a * c->res.s0 + b * c->res.s1 : NULL;
        const float inv = rms_inv(c->ops->sumsq(x, c->d), c->d, c->eps);
        c->ops->rms_row(x, c->w, res, inv, c->d, (float *)c->out.p + a * c->out.s0 + b * c->out.s1);
    }
}

static PyObject *rms_common(const char *fn, PyObject *xo, PyObject *wo, double eps, PyObject *ro, PyObject *oo) {
    arr x = {0}, w = {0}, r = {0}, out = {0};
    PyObject *ret = NULL;
    if (get_arr(xo, fn, "x", K_F32, 2, 3, 0, &x) || unit_last(fn, "x", &x) ||
        get_arr(wo, fn, "w", K_F32, 1, 1, 0, &w) || unit_last(fn, "w", &w) ||
        (ro && (get_arr(ro, fn, "residual", K_F32, 2, 3, 0, &r) || unit_last(fn, "residual", &r) ||
                same_shape(fn, "residual", &r, "x", &x))) ||
        get_arr(oo, fn, "out", K_F32, 2, 3, 1, &out) || same_shape(fn, "out", &out, "x", &x) ||
        check_apart(fn, "out", &out.b.v, "x", &x.b.v, 1) || check_apart(fn, "out", &out.b.v, "w", &w.b.v, 0) ||
        (ro && check_apart(fn, "out", &out.b.v, "residual", &r.b.v, 1)))
        goto done;
    as3(&x); as3(&r); as3(&out);
    if (rows_apart(fn, "out", &out)) goto done;
    if (w.n[0] != x.n[2]) {
        PyErr_Format(PyExc_ValueError, "%s: w must have shape [%lld] (x's last dim), got [%lld]", fn,
                     (long long)x.n[2], (long long)w.n[0]);
        goto done;
    }
    rms_ctx c = {current_path()->layer, rows_of(&x), ro ? rows_of(&r) : (rows3){0}, rows_of(&out), x.n[1], x.n[2],
                 (const float *)w.b.v.buf, (float)eps};
    const int64_t rows = x.n[0] * x.n[1];
    Py_BEGIN_ALLOW_THREADS
    run(rms_tasks, &c, rows, rows * c.d);
    Py_END_ALLOW_THREADS
    Py_INCREF(oo);
    ret = oo;
done:
    release(&x.b); release(&w.b); release(&r.b); release(&out.b);
    return ret;
}

static PyObject *py_rms_norm(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *wo, *oo;
    double eps;
    if (!PyArg_ParseTuple(args, "OOdO:rms_norm", &xo, &wo, &eps, &oo)) return NULL;
    return rms_common("rms_norm", xo, wo, eps, NULL, oo);
}

static PyObject *py_rms_norm_add(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *wo, *ro, *oo;
    double eps;
    if (!PyArg_ParseTuple(args, "OOdOO:rms_norm_add", &xo, &wo, &eps, &ro, &oo)) return NULL;
    return rms_common("rms_norm_add", xo, wo, eps, ro, oo);
}

/* ======================================================================================================
 * rope
 * ==================================================================================================== */
typedef struct { const layer_ops *ops; rope_job j; } rope_ctx;

static void rope_tasks(void *ctx, int64_t t0, int64_t t1) {
    const rope_ctx *c = (const rope_ctx *)ctx;
    for (int64_t t = t0; t < t1; t++) c->ops->rope_row(&c->j, t);
}

static PyObject *py_rope(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *co, *so, *oo;
    int mode;
    if (!PyArg_ParseTuple(args, "OOOiO:rope", &xo, &co, &so, &mode, &oo)) return NULL;
    const char *fn = "rope";
    arr x = {0}, cs = {0}, sn = {0}, out = {0};
    PyObject *ret = NULL;
    if (get_arr(xo, fn, "x", K_F32, 3, 3, 0, &x) || unit_last(fn, "x", &x) ||
        get_arr(co, fn, "cos", K_F32, 2, 2, 0, &cs) || unit_last(fn, "cos", &cs) ||
        get_arr(so, fn, "sin", K_F32, 2, 2, 0, &sn) || unit_last(fn, "sin", &sn) ||
        same_shape(fn, "sin", &sn, "cos", &cs) ||
        get_arr(oo, fn, "out", K_F32, 3, 3, 1, &out) || same_shape(fn, "out", &out, "x", &x) ||
        rows_apart(fn, "out", &out) || check_apart(fn, "out", &out.b.v, "x", &x.b.v, 1) ||
        check_apart(fn, "out", &out.b.v, "cos", &cs.b.v, 0) || check_apart(fn, "out", &out.b.v, "sin", &sn.b.v, 0))
        goto done;
    if (mode != 0 && mode != 1) {
        PyErr_Format(PyExc_ValueError, "rope: mode must be 0 (adjacent pairs) or 1 (neox), got %d", mode);
        goto done;
    }
    const int64_t T = x.n[0], hd = x.n[2], rd = cs.n[1];
    if (cs.n[0] != T || rd % 2 || rd > hd) {
        PyErr_Format(PyExc_ValueError, "rope: cos and sin must be [T, rope_dim] with T = %lld (x's rows) and rope_dim "
                     "even and <= %lld (x's head dim), got [%lld, %lld]", (long long)T, (long long)hd,
                     (long long)cs.n[0], (long long)rd);
        goto done;
    }
    rope_ctx c = {current_path()->layer,
                  {T, x.n[1], hd, rd, mode, rows_of(&x), rows_of(&out), (const float *)cs.b.v.buf,
                   (const float *)sn.b.v.buf, cs.s[0], sn.s[0]}};
    Py_BEGIN_ALLOW_THREADS
    run(rope_tasks, &c, T, T * x.n[1] * hd);
    Py_END_ALLOW_THREADS
    Py_INCREF(oo);
    ret = oo;
done:
    release(&x.b); release(&cs.b); release(&sn.b); release(&out.b);
    return ret;
}

/* ======================================================================================================
 * attend
 * ==================================================================================================== */
static pthread_key_t scratch_key[2];   /* a task's own; the phases' shared one (the calling thread's) */
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static void scratch_key_make(void) { pthread_key_create(&scratch_key[0], free); pthread_key_create(&scratch_key[1], free); }

typedef struct { int64_t cap; float f[]; } scratch_buf;

/* this thread's scratch (which: 0, or 1 the shared one) of at least n floats (NULL: out of memory) */
static float *thread_scratch(int64_t n, int which) {
    pthread_once(&scratch_once, scratch_key_make);
    scratch_buf *b = (scratch_buf *)pthread_getspecific(scratch_key[which]);
    if (b && b->cap >= n) return b->f;
    int64_t cap = n < 4096 ? 4096 : n + n / 4;
    scratch_buf *nb = (scratch_buf *)realloc(b, sizeof(scratch_buf) + (size_t)cap * sizeof(float));
    if (!nb) return NULL;
    nb->cap = cap;
    pthread_setspecific(scratch_key[which], nb);
    return nb->f;
}

/* heads h0..h0+nh-1 (of one kv head) of row t in one go, the scores in this thread's scratch */
static void attend_heads(const layer_ops *ops, const attend_job *j, int64_t t, int64_t h0, int64_t nh,
                         float *scratch) {
    const int64_t hd = j->hd, n = j->spans[2 * t + 1] - j->spans[2 * t], s_s = up8(n);
    if (n == 0) {
        memset(j->out + t * j->out_s + h0 * hd, 0, (size_t)(nh * hd) * sizeof(float));
        return;
    }
    float *s = scratch + attend_scratch_floats(hd, 0, nh);
    ops->attend_scores(j, t, h0, nh, 0, n, s, s_s, scratch);
    for (int64_t h = 0; h < nh; h++) {
        lanes8 r;
        float lane[8];
        for (int l = 0; l < 8; l++) lane[l] = -__builtin_inff();
        ops->lane_max(s + h * s_s, n, &r);
        lanes8_join(lane, &r, n);
        ops->exps(s + h * s_s, n, lanes8_max(lane));
    }
    ops->weighted(j, t, h0, nh, 0, hd, s, s_s, scratch);
}

/* One task or phases. A task: query row t, kv head kvh, its query heads sub * group .. (+ group, within the kv
 * head's g). Phases, when the (row, kv head) units do not divide among the threads: the first `whole` units are a
 * task each (all g heads), the rest are shared by every thread, all heads g of a unit together, their scores in one
 * buffer s [T][H][s_s]: phase 1 (with the whole units' tasks), the scores and the max's lanes of a run of ck keys;
 * 2, the run's exps, m joined from every run's lanes; 3, dims d0.. (db of them) of the outputs, each task summing
 * the p itself (the same lanes, in order) -- every chain as in one task. */
typedef struct {
    const layer_ops *ops; attend_job j; int64_t group, subs, need; atomic_int no_memory;
    int phase; int64_t whole, ck, nch, db, ndb, s_s; float *s; lanes8 *lanes;
    const arr *kn, *vn;   /* a decode step's new key and value, stored by its kv head's task (attend_many) */
} attend_ctx;

static void attend_store(const layer_ops *ops, const attend_job *j, const arr *kn, const arr *vn, int64_t h0,
                         int64_t h1);

static void attend_tasks(void *ctx, int64_t t0, int64_t t1) {
    attend_ctx *c = (attend_ctx *)ctx;
    float *scratch = thread_scratch(c->need, 0);
    if (!scratch) {
        atomic_store(&c->no_memory, 1);
        return;
    }
    const attend_job *j = &c->j;
    const int64_t g = j->H / j->Hkv, per_row = j->Hkv * c->subs, whole = c->phase == 1 ? c->whole : 0;
    for (int64_t k = t0; k < t1 && (!c->phase || k < whole); k++) {
        const int64_t t = k / per_row, kvh = k % per_row / c->subs, sub = k % c->subs;
        const int64_t h0 = kvh * g + sub * c->group, nh = g - sub * c->group < c->group ? g - sub * c->group : c->group;
        if (c->kn) attend_store(c->ops, j, c->kn, c->vn, kvh, kvh + 1);
        attend_heads(c->ops, j, t, h0, nh, scratch);
    }
    const int64_t per = c->phase == 3 ? c->ndb : c->nch;
    for (int64_t k = t0 > whole ? t0 : whole; k < t1 && c->phase; k++) {
        const int64_t u = c->whole + (k - whole) / per, t = u / j->Hkv, h0 = u % j->Hkv * g, part = (k - whole) % per;
        const int64_t n = j->spans[2 * t + 1] - j->spans[2 * t], i0 = part * c->ck, i1 = n < i0 + c->ck ? n : i0 + c->ck;
        float *s = c->s + (t * j->H + h0) * c->s_s;
        lanes8 *lanes = c->lanes + (t * j->H + h0) * c->nch;
        if (c->phase == 1 && i0 < i1) {
            c->ops->attend_scores(j, t, h0, g, i0, i1, s, c->s_s, scratch);
            for (int64_t h = 0; h < g; h++) c->ops->lane_max(s + h * c->s_s + i0, i1 - i0, lanes + h * c->nch + part);
        } else if (c->phase == 2 && i0 < i1) {
            for (int64_t h = 0; h < g; h++) {
                float lane[8];
                for (int l = 0; l < 8; l++) lane[l] = -__builtin_inff();
                for (int64_t r = 0; r * c->ck < n; r++) lanes8_join(lane, lanes + h * c->nch + r, n - r * c->ck);
                c->ops->exps(s + h * c->s_s + i0, i1 - i0, lanes8_max(lane));
            }
        } else if (c->phase == 3) {
            const int64_t d0 = part * c->db, d1 = j->hd < d0 + c->db ? j->hd : d0 + c->db;
            float *o = j->out + t * j->out_s + h0 * j->hd;
            if (n) c->ops->weighted(j, t, h0, g, d0, d1, s, c->s_s, scratch);
            else
                for (int64_t h = 0; h < g; h++) memset(o + h * j->hd + d0, 0, (size_t)(d1 - d0) * sizeof(float));
        }
    }
}

/* phases: -1 when they pay (above), 0 never, 1 always (for the tests: the bits are the same) */
static int phases_mode = -1;

static PyObject *py_attend_phases(PyObject *self, PyObject *args) {
    (void)self;
    int mode, old = phases_mode;
    if (!PyArg_ParseTuple(args, "i:attend_phases", &mode)) return NULL;
    if (mode < -1 || mode > 1) {
        PyErr_Format(PyExc_ValueError, "attend_phases: mode must be -1 (when they pay), 0 (never) or 1, got %d", mode);
        return NULL;
    }
    phases_mode = mode;
    return PyLong_FromLong(old);
}

/* n values as q8_0 blocks of 34 bytes at o: d's f16 bits (little-endian), then 32 int8 (the last block padded) */
static void q8_store(const float *x, int64_t n, uint8_t *o) {
    for (int64_t b = 0; 32 * b < n; b++, o += Q8_BYTES) {
        uint16_t d;
        q8_row(x + 32 * b, n - 32 * b < 32 ? n - 32 * b : 32, 1.0f, &d, 1, (int8_t *)o + 2, 32);
        o[0] = (uint8_t)d, o[1] = (uint8_t)(d >> 8);
    }
}

/* One attend call's arrays, checked, and its job: q, keys, values, spans, out, and (attend_parts) the pass's own
 * keys and values k_new, v_new, which go to the last T positions of keys and values before the scores. */
enum { A_Q, A_K, A_V, A_SP, A_OUT, A_KN, A_VN, A_N };
typedef struct { arr a[A_N]; int64_t longest, keys_seen; } attend_args;

static void attend_release(attend_args *x) { for (int i = 0; i < A_N; i++) release(&x->a[i].b); }

/* attend_setup's keys and values: positions lo..end-1 of them (attend_layer: the Cache's whole arrays), or all */
typedef struct { int64_t lo, end; } positions;

static int attend_setup(const char *fn, PyObject *const o[A_N], double scale, const positions *at, attend_args *x,
                        attend_job *j) {
    arr *q = &x->a[A_Q], *k = &x->a[A_K], *v = &x->a[A_V], *sp = &x->a[A_SP], *out = &x->a[A_OUT];
    const int store = o[A_KN] != NULL;
    if (get_arr(o[A_Q], fn, "q", K_F32, 3, 3, 0, q) || unit_last(fn, "q", q) ||
        get_arr(o[A_K], fn, "keys", K_KV, 3, 3, store, k) ||
        get_arr(o[A_V], fn, "values", K_KV, 3, 3, store, v) || unit_last(fn, "values", v) ||
        same_shape(fn, "values", v, "keys", k) ||
        get_arr(o[A_SP], fn, "spans", K_I64, 2, 2, 0, sp) ||
        get_arr(o[A_OUT], fn, "out", K_F32, 2, 2, 1, out))
        return -1;
    if (v->b.v.itemsize != k->b.v.itemsize) return fail(fn, "values", v, "must have the dtype of keys");
    int64_t k_off = 0, v_off = 0;   /* items to positions lo */
    if (at) {
        if (at->lo < 0 || at->end < at->lo || at->end > k->n[1]) {
            PyErr_Format(PyExc_ValueError, "%s: positions %lld..%lld are not within keys' %lld", fn, (long long)at->lo,
                         (long long)at->end - 1, (long long)k->n[1]);
            return -1;
        }
        k_off = at->lo * k->s[1];
        v_off = at->lo * v->s[1];
        k->n[1] = v->n[1] = at->end - at->lo;
    }
    const int64_t T = q->n[0], H = q->n[1], hd = q->n[2], Hkv = k->n[0], L = k->n[1];
    const int q8 = k->b.v.itemsize == 1;   /* q8_0: a position's blocks of the head dim, in bytes */
    const int64_t width = q8 ? q8_blocks(hd) * Q8_BYTES : hd;
    if (H < 1 || hd < 1) return fail(fn, "q", q, "must be [T, H, hd] with H >= 1 heads of hd >= 1 dims");
    if (k->n[2] != width || Hkv < 1 || H % Hkv) {
        char want[128];
        snprintf(want, sizeof want, "must be [Hkv, L, %lld] with Hkv >= 1 dividing H = %lld (q: [T, H, hd]%s)",
                 (long long)width, (long long)H, q8 ? "; q8_0: ceil(hd / 32) blocks of 34 bytes" : "");
        return fail(fn, "keys", k, want);
    }
    if (q8 && unit_last(fn, "keys", k)) return -1;
    if (sp->n[0] != T || sp->n[1] != 2 || (T > 1 && sp->s[0] != 2) || sp->s[1] != 1) {
        char want[64];
        snprintf(want, sizeof want, "must be C-contiguous [%lld, 2] (T, k0 k1)", (long long)T);
        return fail(fn, "spans", sp, want);
    }
    if (out->n[0] != T || out->n[1] != H * hd) {
        char want[64];
        snprintf(want, sizeof want, "must have shape [%lld, %lld] (T, H * hd)", (long long)T, (long long)(H * hd));
        return fail(fn, "out", out, want);
    }
    as3(out);
    if (rows_apart(fn, "out", out)) return -1;
    for (int i = A_KN; store && i <= A_VN; i++) {
        const char *name = i == A_KN ? "k_new" : "v_new";
        if (get_arr(o[i], fn, name, K_F32, 3, 3, 0, &x->a[i]) || unit_last(fn, name, &x->a[i])) return -1;
        if (x->a[i].n[0] != T || x->a[i].n[1] != Hkv || x->a[i].n[2] != hd || T > L) {
            char want[96];
            snprintf(want, sizeof want, "must have shape [%lld, %lld, %lld] (T, Hkv, hd) with T <= L = %lld",
                     (long long)T, (long long)Hkv, (long long)hd, (long long)L);
            return fail(fn, name, &x->a[i], want);
        }
    }
    const int64_t *spans = (const int64_t *)sp->b.v.buf;
    x->longest = x->keys_seen = 0;
    for (int64_t t = 0; t < T; t++) {
        int64_t k0 = spans[2 * t], k1 = spans[2 * t + 1];
        if (k0 < 0 || k1 < k0 || k1 > L) {
            PyErr_Format(PyExc_ValueError, "%s: spans[%lld] = (%lld, %lld) must satisfy 0 <= k0 <= k1 <= L = %lld", fn,
                         (long long)t, (long long)k0, (long long)k1, (long long)L);
            return -1;
        }
        x->longest = k1 - k0 > x->longest ? k1 - k0 : x->longest;
        x->keys_seen += k1 - k0;
    }
    *j = (attend_job){T, H, Hkv, hd, L, rows_of(q), (const char *)k->b.v.buf + k_off * k->b.v.itemsize,
                      (const char *)v->b.v.buf + v_off * v->b.v.itemsize, k->b.v.itemsize == 2, q8, q8_blocks(hd),
                      k->s[0], k->s[1], q8 ? 1 : k->s[2], v->s[0], v->s[1], spans, (float)scale,
                      (float *)out->b.v.buf, out->s[0]};
    return 0;
}

/* the pass's own keys and values (k_new, v_new [T, Hkv, hd] f32) of kv heads h0..h1-1 to positions L - T .. L - 1,
 * as the Cache stores them: f32 as they are, f16 rounded to nearest even (numpy's astype), q8_0 blocks by q8_block */
static void attend_store(const layer_ops *ops, const attend_job *j, const arr *kn, const arr *vn, int64_t h0,
                         int64_t h1) {
    const int64_t T = j->T, hd = j->hd;
    for (int which = 0; which < 2; which++) {
        const arr *src = which ? vn : kn;
        uint8_t *base = (uint8_t *)(which ? j->v : j->k);
        const int64_t sh = which ? j->v_sh : j->k_sh, sl = which ? j->v_sl : j->k_sl, sd = which ? 1 : j->k_sd;
        const float *x0 = (const float *)src->b.v.buf;
        if (j->f16 && sd != 1 && T >= 8) {   /* keys transposed ([Hkv, hd, n]): along each dim's row of positions */
            for (int64_t h = h0; h < h1; h++)
                for (int64_t d = 0; d < hd; d++)
                    ops->f16_row(x0 + h * src->s[1] + d, src->s[0], T,
                                 (uint16_t *)base + h * sh + (j->L - T) * sl + d * sd, sl);
            continue;
        }
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = h0; h < h1; h++) {
                const float *x = x0 + t * src->s[0] + h * src->s[1];
                const int64_t at = h * sh + (j->L - T + t) * sl;
                if (j->q8) q8_store(x, hd, base + at);
                else if (j->f16) ops->f16_row(x, 1, hd, (uint16_t *)base + at, sd);   /* a few rows: along the key */
                else
                    for (int64_t d = 0; d < hd; d++) ((float *)base)[at + d * sd] = x[d];
            }
    }
}

/* What a call writes (each part's out; its keys and values when it stores its new ones) shares no byte with anything
 * else of the call, its own part's or another's: the spans of all found once, a pair whose spans meet refused. */
static int attend_apart(const char *fn, int named, const attend_args *x, int64_t n) {
    static const char *names[A_N] = {"q", "keys", "values", "spans", "out", "k_new", "v_new"};
    const int64_t m = n * A_N;
    uintptr_t (*sp)[2] = (uintptr_t (*)[2])PyMem_Malloc((size_t)m * sizeof *sp);
    if (!sp) {
        PyErr_NoMemory();
        return -1;
    }
    for (int64_t a = 0; a < m; a++) {
        const Py_buffer *v = &x[a / A_N].a[a % A_N].b.v;
        if (x[a / A_N].a[a % A_N].b.held) span_of(v, &sp[a][0], &sp[a][1]);
        else sp[a][0] = sp[a][1] = 0;
    }
    int rc = 0;
    for (int64_t a = 0; a < m && !rc; a++) {
        const int64_t p = a / A_N, i = a % A_N;
        const int stores = x[p].a[A_KN].b.held;
        if (!(i == A_OUT || (stores && (i == A_K || i == A_V))) || sp[a][0] == sp[a][1]) continue;
        for (int64_t b = 0; b < m && !rc; b++) {
            if (b == a || sp[b][0] == sp[b][1] || sp[a][1] <= sp[b][0] || sp[b][1] <= sp[a][0]) continue;
            char an[48], bn[48];
            if (named) {
                snprintf(an, sizeof an, "parts[%lld] %s", (long long)p, names[i]);
                snprintf(bn, sizeof bn, "parts[%lld] %s", (long long)(b / A_N), names[b % A_N]);
            }
            rc = check_apart(fn, named ? an : names[i], &x[p].a[i].b.v, named ? bn : names[b % A_N],
                             &x[b / A_N].a[b % A_N].b.v, 0);
        }
    }
    PyMem_Free(sp);
    return rc;
}

/* the parts of one attend_parts call, as one job: task k of part p is task k - first[p] of its own */
typedef struct { attend_ctx *c; const int64_t *first; int64_t n; } parts_ctx;

static void parts_tasks(void *ctx, int64_t t0, int64_t t1) {
    const parts_ctx *pc = (const parts_ctx *)ctx;
    for (int64_t p = 0; p < pc->n; p++) {
        const int64_t a = pc->first[p], b = pc->first[p + 1];
        if (a < t1 && b > t0) attend_tasks(&pc->c[p], (t0 > a ? t0 : a) - a, (t1 < b ? t1 : b) - a);
    }
}

/* n parts (o[p]: their objects, k_new / v_new NULL when not given; errors name parts[p] when `named`): checked,
 * stored, attended. One part runs as
 * attend always has (in phases when they pay); several as one job over the pool, their query heads split by the
 * units of all (the bits depend on neither). */
static int attend_many(const char *fn, int named, PyObject *const (*o)[A_N], const positions *at, int64_t n,
                       double scale) {
    attend_args *x = (attend_args *)PyMem_Calloc((size_t)n, sizeof(attend_args));
    attend_ctx *c = (attend_ctx *)PyMem_Calloc((size_t)n, sizeof(attend_ctx));
    int64_t *first = (int64_t *)PyMem_Calloc((size_t)n + 1, sizeof(int64_t));
    int rc = -1;
    if (!x || !c || !first) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t units = 0, work = 0;
    for (int64_t p = 0; p < n; p++) {
        char name[48];
        if (named) snprintf(name, sizeof name, "%s: parts[%lld]", fn, (long long)p);
        if (attend_setup(named ? name : fn, o[p], scale, at ? &at[p] : NULL, &x[p], &c[p].j)) goto done;
        units += c[p].j.T * c[p].j.Hkv;
        work += x[p].keys_seen * c[p].j.H * c[p].j.hd;
    }
    if (attend_apart(fn, named, x, n)) goto done;
    /* the query heads of a kv head go together (its keys and values read once for all), split in as many groups
     * as it takes to give every thread a task when the rows are few (the bits do not depend on it) */
    const int64_t threads = pool_threads();
    int64_t splits = units >= threads || units == 0 ? 1 : (threads + units - 1) / units;
    for (int64_t p = 0; p < n; p++) {
        const int64_t g = c[p].j.H / c[p].j.Hkv, s = splits > g ? g : splits, group = (g + s - 1) / s;
        c[p].ops = current_path()->layer;
        c[p].group = group;
        c[p].subs = (g + group - 1) / group;
        c[p].need = attend_scratch_floats(c[p].j.hd, x[p].longest, group);
        first[p + 1] = first[p] + c[p].j.T * c[p].j.Hkv * c[p].subs;
    }
    attend_ctx *c0 = &c[0];
    const int64_t longest = x[0].longest;
    const int phased = n == 1 && (phases_mode >= 0 ? phases_mode : threads > 1 && units < 2 * threads &&
                                  units % threads && longest >= PHASE_KEYS);
    if (phased && longest) {   /* the last units % threads units shared (all of them when forced) */
        const int64_t g = c0->j.H / c0->j.Hkv, T = c0->j.T, H = c0->j.H, hd = c0->j.hd;
        c0->whole = phases_mode == 1 ? 0 : units - units % threads;
        c0->group = g;
        c0->subs = 1;
        const int64_t shared = units - c0->whole;
        c0->ck = up8((longest + threads - 1) / threads);   /* a run a thread per unit */
        c0->nch = (longest + c0->ck - 1) / c0->ck;
        c0->db = 64;
        while (c0->db > 16 && shared * ((hd + c0->db - 1) / c0->db) < threads) c0->db /= 2;
        c0->ndb = (hd + c0->db - 1) / c0->db;
        c0->s_s = up8(longest);
        c0->need = attend_scratch_floats(hd, c0->whole ? longest : 0, g);
        const int64_t lanes_at = up8(T * H * c0->s_s);
        float *buf = thread_scratch(lanes_at + T * H * c0->nch * (int64_t)(sizeof(lanes8) / sizeof(float)), 1);
        if (!buf) {
            PyErr_Format(PyExc_MemoryError, "%s: no memory for the scores of %lld rows", fn, (long long)T);
            goto done;
        }
        c0->s = buf;
        c0->lanes = (lanes8 *)(buf + lanes_at);
    }
    Py_BEGIN_ALLOW_THREADS
    /* a part's new keys and values go in first; a decode step's (one row, a task per kv head) by each kv head's
     * task just before it reads them, on the pool and into the lines its scores read next */
    for (int64_t p = 0; p < n; p++)
        if (o[p][A_KN] && c[p].j.T == 1 && c[p].subs == 1 && !c0->s) {
            c[p].kn = &x[p].a[A_KN];
            c[p].vn = &x[p].a[A_VN];
        } else if (o[p][A_KN]) {
            attend_store(c[p].ops, &c[p].j, &x[p].a[A_KN], &x[p].a[A_VN], 0, c[p].j.Hkv);
        }
    if (c0->s)
        for (c0->phase = 1; c0->phase <= 3; c0->phase++)
            pool_run(attend_tasks, c0, (c0->phase == 1 ? c0->whole : 0) + (units - c0->whole) *
                     (c0->phase == 3 ? c0->ndb : c0->nch), 1);
    else if (n == 1) run(attend_tasks, c0, first[1], work);
    else {
        parts_ctx pc = {c, first, n};
        run(parts_tasks, &pc, first[n], work);
    }
    Py_END_ALLOW_THREADS
    for (int64_t p = 0; p < n; p++)
        if (atomic_load(&c[p].no_memory)) {
            PyErr_Format(PyExc_MemoryError, "%s: no memory for a scratch of %lld floats", fn, (long long)c[p].need);
            goto done;
        }
    rc = 0;
done:
    for (int64_t p = 0; x && p < n; p++) attend_release(&x[p]);
    PyMem_Free(x); PyMem_Free(c); PyMem_Free(first);
    return rc;
}

static PyObject *py_attend(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o[1][A_N] = {{0}};
    double scale;
    if (!PyArg_ParseTuple(args, "OOOOdO:attend", &o[0][A_Q], &o[0][A_K], &o[0][A_V], &o[0][A_SP], &scale,
                          &o[0][A_OUT]))
        return NULL;
    if (attend_many("attend", 0, (PyObject *const (*)[A_N])o, NULL, 1, scale)) return NULL;
    Py_INCREF(o[0][A_OUT]);
    return o[0][A_OUT];
}

static PyObject *py_attend_parts(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *seq;
    double scale;
    if (!PyArg_ParseTuple(args, "Od:attend_parts", &seq, &scale)) return NULL;
    PyObject *fast = PySequence_Fast(seq, "attend_parts: parts must be a sequence of tuples");
    if (!fast) return NULL;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject *(*o)[A_N] = n ? (PyObject *(*)[A_N])PyMem_Calloc((size_t)n, sizeof *o) : NULL;
    int rc = n ? -1 : 0;
    if (n && !o) PyErr_NoMemory();
    for (Py_ssize_t p = 0; o && p < n; p++) {
        PyObject *t = PySequence_Fast_GET_ITEM(fast, p);
        const Py_ssize_t len = PyTuple_Check(t) ? PyTuple_GET_SIZE(t) : -1;
        if (len != 5 && len != 7) {
            PyErr_Format(PyExc_ValueError, "attend_parts: parts[%zd] must be a tuple (q, keys, values, spans, out) or "
                         "(q, keys, values, spans, out, k_new, v_new), got %s", p, len < 0 ? Py_TYPE(t)->tp_name :
                         "a tuple of another length");
            goto done;
        }
        for (Py_ssize_t i = 0; i < len; i++) o[p][i] = PyTuple_GET_ITEM(t, i);
    }
    if (o) rc = attend_many("attend_parts", 1, (PyObject *const (*)[A_N])o, NULL, n, scale);
done:
    PyMem_Free(o);
    Py_DECREF(fast);
    if (rc) return NULL;
    Py_RETURN_NONE;
}

/* attend_layer(parts, layer, windows, scale): attend_parts for one layer of a pass without a tuple per part and
 * layer: part p is (q, keys, values, end, out, k_new, v_new) once per pass, keys and values the Cache's arrays of
 * every layer; windows[p] = (lo, spans) of this layer. Part p attends over positions lo..end-1 of keys[layer] and
 * values[layer], its k_new and v_new stored at end - T..end - 1 first: attend_parts' part (q, keys[layer][:, lo:end],
 * values[layer][:, lo:end], spans, out, k_new, v_new). */
static PyObject *py_attend_layer(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *seq, *wseq;
    long long layer;
    double scale;
    if (!PyArg_ParseTuple(args, "OLOd:attend_layer", &seq, &layer, &wseq, &scale)) return NULL;
    PyObject *fast = PySequence_Fast(seq, "attend_layer: parts must be a sequence of tuples");
    if (!fast) return NULL;
    PyObject *wfast = PySequence_Fast(wseq, "attend_layer: windows must be a sequence of (lo, spans)");
    if (!wfast) { Py_DECREF(fast); return NULL; }
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject *(*o)[A_N] = n ? (PyObject *(*)[A_N])PyMem_Calloc((size_t)n, sizeof *o) : NULL;
    positions *at = n ? (positions *)PyMem_Calloc((size_t)n, sizeof *at) : NULL;
    int rc = n ? -1 : 0;
    if (n && (!o || !at)) PyErr_NoMemory();
    else if (PySequence_Fast_GET_SIZE(wfast) != n)
        PyErr_Format(PyExc_ValueError, "attend_layer: %zd windows for %zd parts", PySequence_Fast_GET_SIZE(wfast), n);
    else {
        Py_ssize_t p = 0;
        for (; p < n; p++) {
            PyObject *t = PySequence_Fast_GET_ITEM(fast, p), *w = PySequence_Fast_GET_ITEM(wfast, p);
            if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 7) {
                PyErr_Format(PyExc_ValueError, "attend_layer: parts[%zd] must be a tuple (q, keys, values, end, out, "
                             "k_new, v_new)", p);
                break;
            }
            if (!PyTuple_Check(w) || PyTuple_GET_SIZE(w) != 2) {
                PyErr_Format(PyExc_ValueError, "attend_layer: windows[%zd] must be a tuple (lo, spans)", p);
                break;
            }
            at[p].lo = PyLong_AsLongLong(PyTuple_GET_ITEM(w, 0));
            at[p].end = PyLong_AsLongLong(PyTuple_GET_ITEM(t, 3));
            if (PyErr_Occurred()) {
                PyErr_Format(PyExc_ValueError, "attend_layer: parts[%zd]'s end and windows[%zd]'s lo must be "
                             "integers", p, p);
                break;
            }
            o[p][A_Q] = PyTuple_GET_ITEM(t, 0);
            o[p][A_K] = PySequence_GetItem(PyTuple_GET_ITEM(t, 1), (Py_ssize_t)layer);   /* new references */
            o[p][A_V] = o[p][A_K] ? PySequence_GetItem(PyTuple_GET_ITEM(t, 2), (Py_ssize_t)layer) : NULL;
            if (!o[p][A_V]) {
                PyErr_Format(PyExc_ValueError, "attend_layer: parts[%zd] has no keys and values of layer %lld", p,
                             layer);
                break;
            }
            o[p][A_SP] = PyTuple_GET_ITEM(w, 1);
            o[p][A_OUT] = PyTuple_GET_ITEM(t, 4);
            o[p][A_KN] = PyTuple_GET_ITEM(t, 5);
            o[p][A_VN] = PyTuple_GET_ITEM(t, 6);
        }
        if (p == n && n) rc = attend_many("attend_layer", 1, (PyObject *const (*)[A_N])o, at, n, scale);
    }
    for (Py_ssize_t p = 0; o && p < n; p++) { Py_XDECREF(o[p][A_K]); Py_XDECREF(o[p][A_V]); }
    PyMem_Free(o); PyMem_Free(at);
    Py_DECREF(fast); Py_DECREF(wfast);
    if (rc) return NULL;
    Py_RETURN_NONE;
}

/* ======================================================================================================
 * q8_0_blocks: rows of values as kv_cache q8_0's blocks (kernels.h q8_block: the rule of state/cache.py)
 * ==================================================================================================== */
typedef struct { rows3 x; int64_t n1, n, width; uint8_t *out; } q8_ctx;

static void q8_tasks(void *ctx, int64_t r0, int64_t r1) {
    const q8_ctx *c = (const q8_ctx *)ctx;
    for (int64_t r = r0; r < r1; r++) {
        const float *x = c->x.p + r / c->n1 * c->x.s0 + r % c->n1 * c->x.s1;
        q8_store(x, c->n, c->out + r * c->width);
    }
}

static PyObject *py_q8_0_blocks(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *oo;
    if (!PyArg_ParseTuple(args, "OO:q8_0_blocks", &xo, &oo)) return NULL;
    const char *fn = "q8_0_blocks";
    arr x = {0}, out = {0};
    PyObject *ret = NULL;
    if (get_arr(xo, fn, "x", K_F32, 2, 3, 0, &x) || unit_last(fn, "x", &x) ||
        get_arr(oo, fn, "out", K_U8, 2, 3, 1, &out) || check_apart(fn, "out", &out.b.v, "x", &x.b.v, 0))
        goto done;
    as3(&x); as3(&out);
    const int64_t width = q8_blocks(x.n[2]) * Q8_BYTES;
    if (out.n[0] != x.n[0] || out.n[1] != x.n[1] || out.n[2] != width || !PyBuffer_IsContiguous(&out.b.v, 'C')) {
        char want[96];
        snprintf(want, sizeof want, "must be C-contiguous with x's shape but a last dim of %lld (q8_0 blocks)",
                 (long long)width);
        fail(fn, "out", &out, want);
        goto done;
    }
    q8_ctx c = {rows_of(&x), x.n[1], x.n[2], width, (uint8_t *)out.b.v.buf};
    const int64_t rows = x.n[0] * x.n[1];
    Py_BEGIN_ALLOW_THREADS
    run(q8_tasks, &c, rows, rows * x.n[2] * 4);
    Py_END_ALLOW_THREADS
    Py_INCREF(oo);
    ret = oo;
done:
    release(&x.b); release(&out.b);
    return ret;
}

/* ======================================================================================================
 * silu_mul, gelu_tanh_mul (rows of [gate | up]); exp, tanh (one flat array)
 * ==================================================================================================== */
typedef struct { const layer_ops *ops; int act; const float *a; int64_t a_s, b_off; float *out; int64_t out_s, n; } map_ctx;

/* task t: piece t % pieces of row t / pieces, MAP_SPAN values each (elementwise, so any split gives the same bits):
 * a decode step's one row of n_ff activations is spread over the pool too */
#define MAP_SPAN 2048
static int64_t map_pieces(int64_t n) { return (n + MAP_SPAN - 1) / MAP_SPAN; }

static void map_tasks(void *ctx, int64_t t0, int64_t t1) {
    const map_ctx *c = (const map_ctx *)ctx;
    const int64_t pieces = map_pieces(c->n);
    for (int64_t t = t0; t < t1; t++) {
        const int64_t r = t / pieces, k = t % pieces * MAP_SPAN, n = c->n - k < MAP_SPAN ? c->n - k : MAP_SPAN;
        const float *a = c->a + r * c->a_s + k;
        c->ops->map_row(c->act, a, c->b_off ? a + c->b_off : NULL, n, c->out + r * c->out_s + k);
    }
}

static PyObject *glu_common(const char *fn, int act, PyObject *args) {
    PyObject *go, *oo;
    long long n_ff;
    if (!PyArg_ParseTuple(args, act == ACT_SILU ? "OLO:silu_mul" : "OLO:gelu_tanh_mul", &go, &n_ff, &oo)) return NULL;
    arr g = {0}, out = {0};
    PyObject *ret = NULL;
    if (get_arr(go, fn, "gate_up", K_F32, 2, 2, 0, &g) || unit_last(fn, "gate_up", &g) ||
        get_arr(oo, fn, "out", K_F32, 2, 2, 1, &out) || check_apart(fn, "out", &out.b.v, "gate_up", &g.b.v, 0))
        goto done;
    if (n_ff < 1 || n_ff > g.n[1] / 2 || g.n[1] != 2 * n_ff) {
        char want[96];
        snprintf(want, sizeof want, "must be [T, 2 * n_ff] (gate | up) with n_ff = %lld >= 1", n_ff);
        fail(fn, "gate_up", &g, want);
        goto done;
    }
    if (out.n[0] != g.n[0] || out.n[1] != n_ff) {
        char want[64];
        snprintf(want, sizeof want, "must have shape [%lld, %lld] (T, n_ff)", (long long)g.n[0], n_ff);
        fail(fn, "out", &out, want);
        goto done;
    }
    as3(&out);
    if (rows_apart(fn, "out", &out)) goto done;
    map_ctx c = {current_path()->layer, act, (const float *)g.b.v.buf, g.s[0], n_ff, (float *)out.b.v.buf, out.s[0],
                 n_ff};
    Py_BEGIN_ALLOW_THREADS
    run(map_tasks, &c, g.n[0] * map_pieces(n_ff), g.n[0] * n_ff * 8);   /* an activation costs ~8 adds and multiplies */
    Py_END_ALLOW_THREADS
    Py_INCREF(oo);
    ret = oo;
done:
    release(&g.b); release(&out.b);
    return ret;
}

static PyObject *py_silu_mul(PyObject *self, PyObject *args) { (void)self; return glu_common("silu_mul", ACT_SILU, args); }
static PyObject *py_gelu_tanh_mul(PyObject *self, PyObject *args) {
    (void)self;
    return glu_common("gelu_tanh_mul", ACT_GELU_TANH, args);
}

#define FLAT_ROW 4096
static PyObject *flat_map(const char *fn, int act, PyObject *args) {
    PyObject *xo, *oo;
    if (!PyArg_ParseTuple(args, act == FN_EXP ? "OO:exp" : "OO:tanh", &xo, &oo)) return NULL;
    arr x = {0}, out = {0};
    PyObject *ret = NULL;
    if (get_arr(xo, fn, "x", K_F32, 1, 1, 0, &x) || unit_last(fn, "x", &x) ||
        get_arr(oo, fn, "out", K_F32, 1, 1, 1, &out) || unit_last(fn, "out", &out) ||
        same_shape(fn, "out", &out, "x", &x) || check_apart(fn, "out", &out.b.v, "x", &x.b.v, 1))
        goto done;
    const int64_t n = x.n[0], rows = n / FLAT_ROW;
    map_ctx c = {current_path()->layer, act, (const float *)x.b.v.buf, FLAT_ROW, 0, (float *)out.b.v.buf, FLAT_ROW,
                 FLAT_ROW};
    Py_BEGIN_ALLOW_THREADS
    run(map_tasks, &c, rows * map_pieces(FLAT_ROW), rows * FLAT_ROW * 8);
    c.ops->map_row(act, c.a + rows * FLAT_ROW, NULL, n - rows * FLAT_ROW, c.out + rows * FLAT_ROW);
    Py_END_ALLOW_THREADS
    Py_INCREF(oo);
    ret = oo;
done:
    release(&x.b); release(&out.b);
    return ret;
}

static PyObject *py_exp(PyObject *self, PyObject *args) { (void)self; return flat_map("exp", FN_EXP, args); }

/* exp_sum: sum over k of e^(x[k] - shift), the kernels' exp of the float32 difference, summed in float64 in one
 * fixed order: per FLAT_ROW chunk, 8 running sums (value k into sum k mod 8, in order), then ((s0 + s4) + (s2 + s6))
 * + ((s1 + s5) + (s3 + s7)); the chunks' sums added in chunk order. The same bits on every path and thread count. */
typedef struct { const layer_ops *ops; const float *x; int64_t n; float shift; double *part; } exp_sum_ctx;

static double exp_sum_chunk(const layer_ops *ops, const float *x, int64_t n, float shift) {
    float e[FLAT_ROW + 8];
    memcpy(e, x, n * sizeof *e);
    ops->exps(e, n, shift);   /* e^(x - shift), the softmax's own step */
    const int64_t n8 = (n + 7) / 8 * 8;
    for (int64_t k = n; k < n8; k++) e[k] = 0.0f;   /* + 0.0 leaves a sum as it is */
#ifdef __SSE2__
    __m128d s01 = _mm_setzero_pd(), s23 = s01, s45 = s01, s67 = s01;   /* sum l (0..7) in lane l % 2 of s(l/2*2) */
    for (int64_t k = 0; k < n8; k += 8) {
        const __m128 a = _mm_loadu_ps(e + k), b = _mm_loadu_ps(e + k + 4);
        s01 = _mm_add_pd(s01, _mm_cvtps_pd(a));
        s23 = _mm_add_pd(s23, _mm_cvtps_pd(_mm_movehl_ps(a, a)));
        s45 = _mm_add_pd(s45, _mm_cvtps_pd(b));
        s67 = _mm_add_pd(s67, _mm_cvtps_pd(_mm_movehl_ps(b, b)));
    }
    double s[8];
    _mm_storeu_pd(s, s01); _mm_storeu_pd(s + 2, s23); _mm_storeu_pd(s + 4, s45); _mm_storeu_pd(s + 6, s67);
#else
    double s[8] = {0};
    for (int64_t k = 0; k < n8; k += 8)
        for (int l = 0; l < 8; l++) s[l] += e[k + l];
#endif
    return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}

static void exp_sum_tasks(void *ctx, int64_t r0, int64_t r1) {
    const exp_sum_ctx *c = (const exp_sum_ctx *)ctx;
    for (int64_t r = r0; r < r1; r++) {
        const int64_t k0 = r * FLAT_ROW, n = c->n - k0 < FLAT_ROW ? c->n - k0 : FLAT_ROW;
        c->part[r] = exp_sum_chunk(c->ops, c->x + k0, n, c->shift);
    }
}

static PyObject *py_exp_sum(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo;
    float shift;
    if (!PyArg_ParseTuple(args, "Of:exp_sum", &xo, &shift)) return NULL;
    arr x = {0};
    if (get_arr(xo, "exp_sum", "x", K_F32, 1, 1, 0, &x) || unit_last("exp_sum", "x", &x)) {
        release(&x.b);
        return NULL;
    }
    const int64_t n = x.n[0], chunks = (n + FLAT_ROW - 1) / FLAT_ROW;
    double stack_part[64], *part = chunks <= 64 ? stack_part : malloc(chunks * sizeof *part);
    if (!part) { release(&x.b); return PyErr_NoMemory(); }
    exp_sum_ctx c = {current_path()->layer, (const float *)x.b.v.buf, n, shift, part};
    double sum = 0;
    Py_BEGIN_ALLOW_THREADS
    run(exp_sum_tasks, &c, chunks, n * 8);
    for (int64_t r = 0; r < chunks; r++) sum += part[r];
    Py_END_ALLOW_THREADS
    if (part != stack_part) free(part);
    release(&x.b);
    return PyFloat_FromDouble(sum);
}
static PyObject *py_tanh(PyObject *self, PyObject *args) { (void)self; return flat_map("tanh", FN_TANH, args); }

/* ======================================================================================================
 * all_finite: whether no value is NaN or infinite (a pass's logits, checked every step): the exponent bits
 * compared, 16 values at a time, nothing written; rows in chunks over the pool, which is still awake after the
 * head's product and reads the cold logits faster together
 * ==================================================================================================== */
static int row_finite_f32(const float *x, int64_t n) {
    int64_t i = 0;
#ifdef __SSE2__
    const __m128i e = _mm_set1_epi32(0x7f800000);   /* all exponent bits set: inf or NaN */
    for (; i + 16 <= n; i += 16) {
        __m128i bad = _mm_setzero_si128();
        for (int j = 0; j < 16; j += 4)
            bad = _mm_or_si128(bad, _mm_cmpeq_epi32(_mm_and_si128(_mm_loadu_si128((const __m128i *)(x + i + j)), e), e));
        if (_mm_movemask_epi8(bad)) return 0;
    }
#endif
    for (; i < n; i++)
        if (!(x[i] - x[i] == 0.0f)) return 0;   /* inf - inf and NaN - NaN are NaN */
    return 1;
}

static int row_finite_f64(const double *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (!(x[i] - x[i] == 0.0)) return 0;
    return 1;
}

#define FINITE_CHUNK 16384
typedef struct { const char *x; int f64; int64_t n, chunks, stride; atomic_int bad; } finite_ctx;

static void finite_tasks(void *ctx, int64_t t0, int64_t t1) {   /* task t: chunk t % chunks of row t / chunks */
    finite_ctx *c = (finite_ctx *)ctx;
    for (int64_t t = t0; t < t1 && !atomic_load(&c->bad); t++) {
        const int64_t r = t / c->chunks, i0 = t % c->chunks * FINITE_CHUNK;
        const int64_t len = c->n - i0 < FINITE_CHUNK ? c->n - i0 : FINITE_CHUNK;
        const int ok = c->f64 ? row_finite_f64((const double *)c->x + r * c->stride + i0, len)
                              : row_finite_f32((const float *)c->x + r * c->stride + i0, len);
        if (!ok) atomic_store(&c->bad, 1);
    }
}

static PyObject *py_all_finite(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo;
    if (!PyArg_ParseTuple(args, "O:all_finite", &xo)) return NULL;
    arr x = {0};
    if (get_arr(xo, "all_finite", "x", K_F32_OR_F64, 1, 2, 0, &x) || unit_last("all_finite", "x", &x)) {
        release(&x.b);
        return NULL;
    }
    const int64_t rows = x.ndim == 2 ? x.n[0] : 1, n = x.n[x.ndim - 1];
    finite_ctx c = {x.b.v.buf, x.b.v.itemsize == 8, n, (n + FINITE_CHUNK - 1) / FINITE_CHUNK,
                    x.ndim == 2 ? x.s[0] : 0, 0};
    Py_BEGIN_ALLOW_THREADS
    if (n > 0) run(finite_tasks, &c, rows * c.chunks, rows * n);
    Py_END_ALLOW_THREADS
    release(&x.b);
    return PyBool_FromLong(!atomic_load(&c.bad));
}

/* ======================================================================================================
 * mask_logits: a grammar's allowed-token mask applied to a row of logits. Token t is allowed when bit t & 7 of byte
 * t >> 3 is set (the grammar engine's packed int32 words, 32 tokens each, little-endian); every other token of the
 * row gets -inf. Eight bytes at a time: a run of allowed tokens is passed over, a run of forbidden ones filled, the
 * rest token by token without a branch on the bit. Returns how many of the row's tokens are allowed (0: the grammar
 * has no way on).
 * ==================================================================================================== */
#define MASK_ROW(U, NINF)   /* U: the logits' bits as an unsigned integer; NINF: -inf's */                          \
    do {                                                                                                           \
        U *x = (U *)out;                                                                                           \
        for (int64_t t = 0; t < n; t += 64) {                                                                      \
            const int64_t len = n - t < 64 ? n - t : 64;                                                           \
            uint64_t word = 0;                                                                                     \
            memcpy(&word, bits + t / 8, (size_t)(len + 7) / 8);                                                    \
            word = from_le64(word) & (len == 64 ? ~(uint64_t)0 : ((uint64_t)1 << len) - 1);                        \
            allowed += __builtin_popcountll(word);                                                                 \
            if (len == 64 && word == ~(uint64_t)0) continue;   /* a run of allowed tokens */                      \
            if (word == 0) {   /* a run of forbidden ones */                                                        \
                for (int64_t i = 0; i < len; i++) x[t + i] = (U)(NINF);                                            \
                continue;                                                                                          \
            }                                                                                                      \
            for (int64_t i = 0; i < len; i++) {   /* no branch on the bit: keep = all ones where allowed */        \
                const U keep = (U)0 - (U)(word >> i & 1);                                                          \
                x[t + i] = (x[t + i] & keep) | ((U)(NINF) & ~keep);                                                \
            }                                                                                                      \
        }                                                                                                          \
    } while (0)

static inline uint64_t from_le64(uint64_t w) {   /* the bytes' order as the mask's: byte 0 the lowest */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return __builtin_bswap64(w);
#else
    return w;
#endif
}

static PyObject *py_mask_logits(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *oo, *mo;
    if (!PyArg_ParseTuple(args, "OO:mask_logits", &oo, &mo)) return NULL;
    const char *fn = "mask_logits";
    arr o = {0}, m = {0};
    PyObject *ret = NULL;
    if (get_arr(oo, fn, "logits", K_F32_OR_F64, 1, 1, 1, &o) || unit_last(fn, "logits", &o) ||
        get_arr(mo, fn, "mask", K_U8, 1, 1, 0, &m) || unit_last(fn, "mask", &m) ||
        check_apart(fn, "logits", &o.b.v, "mask", &m.b.v, 0))
        goto done;
    const int64_t n = o.n[0];
    if (m.n[0] * 8 < n) {
        PyErr_Format(PyExc_ValueError, "mask_logits: a mask for %lld tokens needs %lld bytes, got %lld", (long long)n,
                     (long long)((n + 7) / 8), (long long)m.n[0]);
        goto done;
    }
    const uint8_t *bits = (const uint8_t *)m.b.v.buf;
    void *out = o.b.v.buf;
    int64_t allowed = 0;
    if (o.b.v.itemsize == 8) MASK_ROW(uint64_t, 0xfff0000000000000u);
    else MASK_ROW(uint32_t, 0xff800000u);
    ret = PyLong_FromLongLong(allowed);
done:
    release(&o.b); release(&m.b);
    return ret;
}

/* ======================================================================================================
 * top_k: the ids (ascending) of the k largest values, the lowest ids winning ties at the k-th value -- top-k
 * sampling's selection. Each range (one per thread, of a million values or more: a vocabulary is one range) is
 * scanned in id order, 16 values at a time, into a buffer that stays in id order: its first k values, then only a
 * value above t, the k-th largest kept (an equal value comes later, so has a higher id, so loses the tie); a full
 * buffer is cut back to k: those above its k-th largest value v_k, then the first (lowest-id) of those equal to v_k.
 * The ranges' survivors, side by side in range order, are cut to k the same way. Comparisons only: the same ids on
 * every path and thread count. NaN is refused (sampling refuses it before; a NaN compares with nothing, so it has no
 * rank).
 * ==================================================================================================== */
#define TOPK_RANGE (1 << 20)   /* the fewest values a range of its own is worth: a scan is ~0.1 ns a value, and
                                  * a pool asleep after a sampling step's Python takes ~50 us to wake */
typedef struct { double v; int64_t i; } ranked;

/* the k-th largest of v[0..m) (1 <= k <= m; v is reordered): a quickselect whose partitions have no branch on
 * the values (a swap every step, the boundary moved by the comparison), so no branch mispredicted per value:
 * [lo, g) > p, then [g, e) == p, then [e, hi) < p */
static double kth_largest(double *v, int64_t m, int64_t k) {
    int64_t lo = 0, hi = m;
    const int64_t want = k - 1;   /* its index in descending order */
    for (;;) {
        const double a = v[lo], b = v[lo + (hi - lo) / 2], c = v[hi - 1];
        const double p = a < b ? (b < c ? b : a < c ? c : a) : (a < c ? a : b < c ? c : b);   /* median of 3 */
        int64_t g = lo, e;
        for (int64_t j = lo; j < hi; j++) {
            const double x = v[j];
            v[j] = v[g]; v[g] = x; g += x > p;
        }
        e = g;
        for (int64_t j = g; j < hi; j++) {
            const double x = v[j];
            v[j] = v[e]; v[e] = x; e += x == p;
        }
        if (want < g) hi = g;
        else if (want < e) return p;
        else lo = e;   /* [g, e) holds p itself: each round takes at least one value off */
    }
}

/* b[0..m) (in id order) cut to its k strongest, still in id order; their k-th largest value is returned */
static double cut_to_k(ranked *b, int64_t m, int64_t k, double *scratch) {
    for (int64_t j = 0; j < m; j++) scratch[j] = b[j].v;
    const double vk = kth_largest(scratch, m, k);
    int64_t ties = k;
    for (int64_t j = 0; j < m; j++) ties -= b[j].v > vk;
    int64_t n = 0;
    for (int64_t j = 0; j < m; j++)
        if (b[j].v > vk || (b[j].v == vk && ties-- > 0)) b[n++] = b[j];
    return vk;
}

typedef struct {
    const void *x; int f64; int64_t n, k, cap, ranges; ranked *bufs; double *scratch; int64_t *count; atomic_int nan;
} topk_ctx;

/* whether any of x[0..16) is not <= t (greater, or NaN): most blocks of a scan are passed over whole */
static inline int any_above_f32(const float *x, float t) {
#ifdef __SSE2__
    const __m128 tv = _mm_set1_ps(t);
    const __m128 a = _mm_or_ps(_mm_cmpnle_ps(_mm_loadu_ps(x), tv), _mm_cmpnle_ps(_mm_loadu_ps(x + 4), tv));
    const __m128 b = _mm_or_ps(_mm_cmpnle_ps(_mm_loadu_ps(x + 8), tv), _mm_cmpnle_ps(_mm_loadu_ps(x + 12), tv));
    return _mm_movemask_ps(_mm_or_ps(a, b));
#else
    int any = 0;
    for (int j = 0; j < 16; j++) any |= !(x[j] <= t);
    return any;
#endif
}

static inline int any_above_f64(const double *x, double t) {
#ifdef __SSE2__
    const __m128d tv = _mm_set1_pd(t);
    __m128d a = _mm_setzero_pd();
    for (int j = 0; j < 16; j += 2) a = _mm_or_pd(a, _mm_cmpnle_pd(_mm_loadu_pd(x + j), tv));
    return _mm_movemask_pd(a);
#else
    int any = 0;
    for (int j = 0; j < 16; j++) any |= !(x[j] <= t);
    return any;
#endif
}

#define TOPK_SCAN(T, ANY_ABOVE)                                                                                    \
    do {                                                                                                           \
        const T *x = (const T *)c->x;                                                                              \
        for (; i < i1 && m < c->k; i++) {   /* the first k values */                                               \
            if (x[i] != x[i]) goto nan;                                                                            \
            b[m++] = (ranked){x[i], i};                                                                            \
        }                                                                                                          \
        T t = m ? x[i0] : 0;   /* the smallest of them */                                                          \
        for (int64_t j = 1; j < m; j++) t = b[j].v < t ? (T)b[j].v : t;                                            \
        while (i < i1) {                                                                                           \
            if (i + 16 <= i1 && !ANY_ABOVE(x + i, t)) {                                                            \
                i += 16;                                                                                           \
                continue;                                                                                          \
            }                                                                                                      \
            for (const int64_t e = i + 16 < i1 ? i + 16 : i1; i < e; i++) {                                        \
                if (x[i] <= t) continue;                                                                           \
                if (x[i] != x[i]) goto nan;                                                                        \
                b[m++] = (ranked){x[i], i};                                                                        \
                if (m == c->cap) {                                                                                 \
                    t = (T)cut_to_k(b, m, c->k, sc);   /* exact: the values kept are T's */                        \
                    m = c->k;                                                                                      \
                }                                                                                                  \
            }                                                                                                      \
        }                                                                                                          \
    } while (0)

static void topk_tasks(void *ctx, int64_t r0, int64_t r1) {
    topk_ctx *c = (topk_ctx *)ctx;
    for (int64_t r = r0; r < r1; r++) {
        const int64_t i0 = c->n * r / c->ranges, i1 = c->n * (r + 1) / c->ranges;
        ranked *b = c->bufs + r * c->cap;
        double *sc = c->scratch + r * c->cap;
        int64_t m = 0, i = i0;
        if (c->f64) TOPK_SCAN(double, any_above_f64);
        else TOPK_SCAN(float, any_above_f32);
        if (m > c->k) {
            cut_to_k(b, m, c->k, sc);
            m = c->k;
        }
        c->count[r] = m;
        continue;
    nan:
        atomic_store(&c->nan, 1);
        return;
    }
}

static PyObject *py_top_k(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *oo;
    long long k;
    if (!PyArg_ParseTuple(args, "OLO:top_k", &xo, &k, &oo)) return NULL;
    const char *fn = "top_k";
    arr x = {0}, out = {0};
    PyObject *ret = NULL;
    ranked *bufs = NULL;
    double *scratch = NULL;
    int64_t *count = NULL;
    if (get_arr(xo, fn, "x", K_F32_OR_F64, 1, 1, 0, &x) || unit_last(fn, "x", &x) ||
        get_arr(oo, fn, "out", K_I64, 1, 1, 1, &out) || unit_last(fn, "out", &out) ||
        check_apart(fn, "out", &out.b.v, "x", &x.b.v, 0))
        goto done;
    const int64_t n = x.n[0];
    if (k < 1 || k > n || out.n[0] != k) {
        PyErr_Format(PyExc_ValueError, "top_k: k must be 1..%lld (x's size) and out must hold k ids, got k = %lld, "
                     "out of %lld", (long long)n, k, (long long)out.n[0]);
        goto done;
    }
    int64_t ranges = n / TOPK_RANGE < pool_threads() ? n / TOPK_RANGE : pool_threads();
    ranges = ranges < 1 ? 1 : ranges;
    /* a range's buffer: its k kept and the newcomers since the last cut (a cut costs ~cap: 4 k + 64 makes them rare),
     * no more than the range's values */
    const int64_t most = (n + ranges - 1) / ranges + 1, cap = 4 * k + 64 < most ? 4 * k + 64 : most;
    bufs = malloc((size_t)(ranges * cap) * sizeof *bufs);
    scratch = malloc((size_t)(ranges * cap) * sizeof *scratch);
    count = malloc((size_t)ranges * sizeof *count);
    if (!bufs || !scratch || !count) { PyErr_NoMemory(); goto done; }
    topk_ctx c = {x.b.v.buf, x.b.v.itemsize == 8, n, k, cap, ranges, bufs, scratch, count, 0};
    int64_t *ids = (int64_t *)out.b.v.buf;
    Py_BEGIN_ALLOW_THREADS
    if (ranges == 1) topk_tasks(&c, 0, 1);
    else pool_run(topk_tasks, &c, ranges, 1);
    if (!atomic_load(&c.nan)) {
        int64_t m = 0;   /* the ranges' survivors side by side (so in id order), then cut to k */
        for (int64_t r = 0; r < ranges; r++)
            for (int64_t j = 0; j < count[r]; j++) bufs[m++] = bufs[r * cap + j];
        if (m > k) cut_to_k(bufs, m, k, scratch);
        for (int64_t j = 0; j < k; j++) ids[j] = bufs[j].i;
    }
    Py_END_ALLOW_THREADS
    if (atomic_load(&c.nan)) {
        PyErr_SetString(PyExc_ValueError, "top_k: x holds NaN (a NaN has no rank)");
        goto done;
    }
    Py_INCREF(oo);
    ret = oo;
done:
    free(bufs); free(scratch); free(count);
    release(&x.b); release(&out.b);
    return ret;
}

/* ======================================================================================================
 * top_p: top-p sampling's set. p_i = e_i / total in float64 (e: a softmax's float32 numerators); the set is the
 * shortest prefix of the order by descending p (ties: lower index first) whose cumulative sum -- float64, one add
 * after another in that order, np.cumsum's -- reaches top_p; every index when it never does (rounding). Only that
 * prefix needs sorting, and {e >= t} is a prefix of the order for any t: a histogram of e's top bits with each
 * bucket's mass names the bucket where the mass reaches top_p; the values from that bucket up are sorted (a stable
 * radix sort of e's bits, descending, so ties keep index order) and summed in order. Should that exact sum fall short
 * of top_p (the histogram sums in another order), every value is sorted. e's bits are its order (e >= 0; -0 is
 * taken as 0), so the set is the full sort's on every path.
 * ==================================================================================================== */
#define TOPP_BITS 11
#define TOPP_DIGITS (1 << TOPP_BITS)

static inline uint32_t topp_key(const float *e, int64_t i) {
    uint32_t b;
    memcpy(&b, e + i, sizeof b);
    return b & 0x7fffffffu;   /* e >= 0: its bits ascend with it */
}

/* a candidate as one word: its rank (0x7fffffff - key: the largest e first) above its index, so ascending words are
 * the order itself, ties by index */
static inline uint64_t topp_word(uint32_t key, int64_t i) { return (uint64_t)(0x7fffffffu - key) << 32 | (uint64_t)i; }

static inline double topp_p(uint64_t w, double total) {
    const uint32_t key = 0x7fffffffu - (uint32_t)(w >> 32);
    float e;
    memcpy(&e, &key, sizeof e);
    return (double)e / total;
}

/* w[0..m) sorted ascending by rank: three passes of 11 bits (the words come in index order and each pass is stable,
 * so ties keep it), a pass skipped where every word has the same digit; tmp holds m words. The result ends in w. */
static void topp_sort(uint64_t *w, uint64_t *tmp, int64_t m) {
    int64_t count[TOPP_DIGITS];
    for (int shift = 32; shift < 63 && m > 1; shift += TOPP_BITS) {
        memset(count, 0, sizeof count);
        for (int64_t j = 0; j < m; j++) count[(w[j] >> shift) & (TOPP_DIGITS - 1)]++;
        if (count[(w[0] >> shift) & (TOPP_DIGITS - 1)] == m) continue;
        for (int64_t d = 0, at = 0; d < TOPP_DIGITS; d++) {
            const int64_t c = count[d];
            count[d] = at;
            at += c;
        }
        for (int64_t j = 0; j < m; j++) tmp[count[(w[j] >> shift) & (TOPP_DIGITS - 1)]++] = w[j];
        memcpy(w, tmp, (size_t)m * sizeof *w);
    }
}

/* the set's size and its indices, ascending, in out[0..size); w, tmp: n words each, mark: n bytes */
static int64_t topp_set(const float *e, int64_t n, double total, double top_p, uint64_t *w, uint64_t *tmp,
                        unsigned char *mark, int64_t *out) {
    double mass[TOPP_DIGITS] = {0};   /* bucket key >> 20: e's exponent and top 3 mantissa bits */
    for (int64_t i = 0; i < n; i++) mass[topp_key(e, i) >> 20] += e[i];
    uint32_t from = 0;   /* the lowest bucket sorted */
    double acc = 0;
    for (int b = TOPP_DIGITS - 1; b >= 0; b--) {
        acc += mass[b];
        if (acc / total >= top_p) { from = (uint32_t)b; break; }
    }
    int64_t size = n;   /* every index, unless a prefix reaches top_p */
    for (;;) {
        int64_t m = 0;
        for (int64_t i = 0; i < n; i++) {
            const uint32_t key = topp_key(e, i);
            if (key >> 20 >= from) w[m++] = topp_word(key, i);
        }
        topp_sort(w, tmp, m);
        double sum = 0;
        int64_t j = 0;
        while (j < m && (sum += topp_p(w[j], total)) < top_p) j++;
        if (j < m) { size = j + 1; break; }
        if (from == 0) break;
        from = 0;   /* the histogram's sum reached top_p, the exact one did not: sort them all */
    }
    if (size == n) {
        for (int64_t i = 0; i < n; i++) out[i] = i;
        return n;
    }
    memset(mark, 0, (size_t)n);
    for (int64_t j = 0; j < size; j++) mark[(uint32_t)w[j]] = 1;
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++)
        if (mark[i]) out[k++] = i;
    return size;
}

static PyObject *py_top_p(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *eo, *oo;
    double total, top_p;
    if (!PyArg_ParseTuple(args, "OddO:top_p", &eo, &total, &top_p, &oo)) return NULL;
    const char *fn = "top_p";
    arr e = {0}, out = {0};
    PyObject *ret = NULL;
    uint64_t *w = NULL, *tmp = NULL;
    unsigned char *mark = NULL;
    if (get_arr(eo, fn, "e", K_F32, 1, 1, 0, &e) || unit_last(fn, "e", &e) ||
        get_arr(oo, fn, "out", K_I64, 1, 1, 1, &out) || unit_last(fn, "out", &out) ||
        check_apart(fn, "out", &out.b.v, "e", &e.b.v, 0))
        goto done;
    const int64_t n = e.n[0];
    if (out.n[0] != n || n > UINT32_MAX) {
        PyErr_Format(PyExc_ValueError, "top_p: out must hold %lld ids (e's size, at most 2^32), got %lld",
                     (long long)n, (long long)out.n[0]);
        goto done;
    }
    if (!(top_p > 0 && top_p <= 1) || !(total > 0 && total <= DBL_MAX)) {
        PyErr_Format(PyExc_ValueError, "top_p: top_p must be in (0, 1] and total finite and > 0, got top_p = %R, "
                     "total = %R", PyTuple_GET_ITEM(args, 2), PyTuple_GET_ITEM(args, 1));
        goto done;
    }
    const float *ev = (const float *)e.b.v.buf;
    for (int64_t i = 0; i < n; i++)
        if (!(ev[i] >= 0 && ev[i] <= FLT_MAX)) {
            char v[32];
            snprintf(v, sizeof v, "%g", (double)ev[i]);
            PyErr_Format(PyExc_ValueError, "top_p: e must be finite and >= 0, got %s at index %lld", v, (long long)i);
            goto done;
        }
    w = malloc((size_t)(n ? n : 1) * sizeof *w);
    tmp = malloc((size_t)(n ? n : 1) * sizeof *tmp);
    mark = malloc((size_t)(n ? n : 1));
    if (!w || !tmp || !mark) { PyErr_NoMemory(); goto done; }
    int64_t size;
    Py_BEGIN_ALLOW_THREADS
    size = topp_set(ev, n, total, top_p, w, tmp, mark, (int64_t *)out.b.v.buf);
    Py_END_ALLOW_THREADS
    ret = PyLong_FromLongLong(size);
done:
    free(w); free(tmp); free(mark);
    release(&e.b); release(&out.b);
    return ret;
}

PyMethodDef layer_methods[] = {
    {"rms_norm", py_rms_norm, METH_VARARGS, "rms_norm(x, w, eps, out): out = (x * inv) * w per row"},
    {"exp_sum", py_exp_sum, METH_VARARGS, "exp_sum(x, shift): sum of e^(x - shift) in float64, one fixed order"},
    {"all_finite", py_all_finite, METH_VARARGS, "all_finite(x): no value NaN or infinite (1-D or 2-D float32/64)"},
    {"top_k", py_top_k, METH_VARARGS, "top_k(x, k, out): ids (ascending) of the k largest values, lowest ids first at "
     "ties"},
    {"mask_logits", py_mask_logits, METH_VARARGS, "mask_logits(logits, mask) -> allowed: -inf where the packed mask's "
     "bit is clear"},
    {"top_p", py_top_p, METH_VARARGS, "top_p(e, total, top_p, out) -> size: top-p's set of p = e / total, ascending "
     "indices in out[:size]"},
    {"rms_norm_add", py_rms_norm_add, METH_VARARGS,
     "rms_norm_add(x, w, eps, residual, out): out = (x * inv) * w + residual per row"},
    {"rope", py_rope, METH_VARARGS, "rope(x, cos, sin, mode, out): rotary embedding, mode 0 adjacent, 1 neox"},
    {"attend", py_attend, METH_VARARGS, "attend(q, keys, values, spans, scale, out): softmax(q k^T scale) v per span"},
    {"attend_parts", py_attend_parts, METH_VARARGS,
     "attend_parts(parts, scale): attend for several sequences in one job, each part (q, keys, values, spans, out"
     "[, k_new, v_new]); k_new, v_new stored at the last T positions of keys, values first"},
    {"attend_layer", py_attend_layer, METH_VARARGS,
     "attend_layer(parts, layer, windows, scale): attend_parts over one layer of the Cache's arrays, a part (q, keys, "
     "values, end, out, k_new, v_new) per sequence for the whole pass, windows[p] = (lo, spans)"},
    {"attend_phases", py_attend_phases, METH_VARARGS,
     "attend_phases(mode) -> the previous mode: attend in phases -1 when they pay, 0 never, 1 always (same bits)"},
    {"q8_0_blocks", py_q8_0_blocks, METH_VARARGS, "q8_0_blocks(x, out): rows of x as q8_0 blocks (kv_cache q8_0)"},
    {"silu_mul", py_silu_mul, METH_VARARGS, "silu_mul(gate_up, n_ff, out): silu(gate) * up"},
    {"gelu_tanh_mul", py_gelu_tanh_mul, METH_VARARGS, "gelu_tanh_mul(gate_up, n_ff, out): gelu_tanh(gate) * up"},
    {"exp", py_exp, METH_VARARGS, "exp(x, out): the kernels' own e^x, value by value (1-D float32)"},
    {"tanh", py_tanh, METH_VARARGS, "tanh(x, out): the kernels' own tanh, value by value (1-D float32)"},
    {NULL, NULL, 0, NULL},
};
