/* tracelm.kernels._core: the Python face of the kernels, argument checks, and one persistent thread pool.
 *
 * Pool: workers wait for a job generation number (odd = a job is open). They spin briefly on it, then
 * sleep on a condition variable. A job is a range of task indices taken in chunks from an atomic counter (at
 * most the job's chunk, less as the range runs out); the calling thread works too. Results never depend on which
 * thread ran a task.
 *
 * Idle work: one serial job at a time (the trace's lines) that a waiting worker advances a short step at a time
 * between jobs, on a core that would otherwise spin; whoever needs it done finishes it (pool_idle_finish).
 */
#include "pyglue.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* ======================================================================================================
 * thread pool
 * ==================================================================================================== */
#define MAX_THREADS 256
static pthread_mutex_t run_mx = PTHREAD_MUTEX_INITIALIZER;    /* one job at a time (else run serially) */
static pthread_mutex_t sleep_mx = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t sleep_cv = PTHREAD_COND_INITIALIZER;   /* idle workers sleep here */
static pthread_cond_t done_cv = PTHREAD_COND_INITIALIZER;    /* the caller waits here for a slow worker */
/* Each hot word on a cache line of its own (the statics would otherwise share one or two lines): idle workers spin
 * reading gen while every thread's fetch_add takes next_task's line and then done_tasks', so on one line each task
 * taken would also evict every spinner's copy of gen and every reader's of job -- false sharing that grows with the
 * threads (issue 32). */
#define LINE 64
static _Alignas(LINE) atomic_uint gen;                /* odd while a job is open */
static _Alignas(LINE) atomic_llong next_task;         /* the next task to take */
static _Alignas(LINE) atomic_llong done_tasks;        /* tasks finished */
static _Alignas(LINE) atomic_int busy, sleepers, caller_sleeps, stop_flag;
static _Alignas(LINE) struct { task_fn fn; void *ctx; int64_t ntasks, chunk; } job;   /* read-only while open */
static pthread_t workers[MAX_THREADS];
static int n_workers;
static double spin_seconds = 200e-6;   /* TRACELM_SPIN_US */
static pthread_mutex_t idle_mx = PTHREAD_MUTEX_INITIALIZER;   /* held by whoever steps the idle job */
static struct { idle_fn step; void *ctx; } idle;
static atomic_int idle_open;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static double now(void) {   /* monotonic seconds */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The pool's accounting (kernels.pool_counting): off unless asked, so a job reads no clock. When on, each job run
 * on the pool adds its wall time (opened to its last task done) times the pool's threads to `offered` and the time
 * its threads spent inside its tasks to `busy`; offered - busy is what waking the workers, taking tasks and waiting
 * for the slowest one cost (issue 32: what stops decode from scaling). A job run serially is not counted. */
static _Alignas(LINE) atomic_int counting;
static _Alignas(LINE) atomic_llong counted_jobs, offered_ns, busy_ns;
static void run_tasks(void) {
    const int64_t n = job.ntasks, most = job.chunk, share = 2 * (int64_t)(n_workers + 1);
    const int timed = atomic_load(&counting);
    double busy = 0;
    for (;;) {
        /* guided: `most` tasks a take while many remain, then a share of what remains, down to one task, so that
         * the threads run out of work together instead of waiting for one still on a whole chunk */
        int64_t c = (n - atomic_load_explicit(&next_task, memory_order_relaxed)) / share;
        c = c > most ? most : c < 1 ? 1 : c;
        int64_t t = atomic_fetch_add(&next_task, c);
        if (t >= n) break;
        int64_t e = t + c < n ? t + c : n;
        const double t0 = timed ? now() : 0;
        job.fn(job.ctx, t, e);
        if (timed) busy += now() - t0;
        if (atomic_fetch_add(&done_tasks, e - t) + (e - t) == n && atomic_load(&caller_sleeps)) {
            pthread_mutex_lock(&sleep_mx);   /* the last task: wake the caller if it gave up spinning */
            pthread_cond_broadcast(&done_cv);
            pthread_mutex_unlock(&sleep_mx);
        }
    }
    if (busy > 0) atomic_fetch_add(&busy_ns, (long long)(1e9 * busy));   /* before this thread leaves the job */
}

/* one step of the idle job, unless there is none or another thread is stepping it: 1 if a step ran */
static int idle_try(void) {
    if (!atomic_load(&idle_open) || pthread_mutex_trylock(&idle_mx) != 0) return 0;
    const int ran = atomic_load(&idle_open);
    if (ran && idle.step(idle.ctx)) atomic_store(&idle_open, 0);
    pthread_mutex_unlock(&idle_mx);
    return ran;
}

/* wait until gen differs from `seen` (or stop): spin (stepping any idle job), then sleep until a job or idle work */
static unsigned wait_change(unsigned seen) {
    unsigned g;
    for (;;) {
        double t0 = 0;
        for (int i = 0;; i++) {
            g = atomic_load(&gen);
            if (g != seen || atomic_load(&stop_flag)) return g;
            if (idle_try()) { t0 = 0; continue; }
            if ((i & 255) == 255) {
                double t = now();
                if (t0 == 0) t0 = t;
                else if (t - t0 > spin_seconds) break;
            }
            cpu_relax();
        }
        pthread_mutex_lock(&sleep_mx);
        atomic_fetch_add(&sleepers, 1);
        while ((g = atomic_load(&gen)) == seen && !atomic_load(&stop_flag) && !atomic_load(&idle_open))
            pthread_cond_wait(&sleep_cv, &sleep_mx);
        atomic_fetch_sub(&sleepers, 1);
        pthread_mutex_unlock(&sleep_mx);
    }
}

static void *worker_main(void *arg) {
    (void)arg;
    unsigned seen = atomic_load(&gen);
    for (;;) {
        unsigned g = wait_change(seen);
        if (atomic_load(&stop_flag)) break;
        seen = g;
        if (!(g & 1)) continue;
        atomic_fetch_add(&busy, 1);
        if (atomic_load(&gen) == g) run_tasks();   /* else the job closed before we registered */
        atomic_fetch_sub(&busy, 1);
    }
    return NULL;
}

static void wake_all(void) {
    pthread_mutex_lock(&sleep_mx);
    pthread_cond_broadcast(&sleep_cv);
    pthread_mutex_unlock(&sleep_mx);
}

/* the caller: wait until all n tasks are done -- spin a little, then sleep (a worker holding a task may have
 * been descheduled; sleeping frees this core for it) */
static void wait_done(int64_t n) {
    double t0 = 0;
    for (int i = 0; atomic_load(&done_tasks) < n; i++) {
        if ((i & 255) == 255) {
            double t = now();
            if (t0 == 0) t0 = t;
            else if (t - t0 > 50e-6) break;
        }
        cpu_relax();
    }
    if (atomic_load(&done_tasks) >= n) return;
    pthread_mutex_lock(&sleep_mx);
    atomic_store(&caller_sleeps, 1);
    while (atomic_load(&done_tasks) < n) pthread_cond_wait(&done_cv, &sleep_mx);
    atomic_store(&caller_sleeps, 0);
    pthread_mutex_unlock(&sleep_mx);
}

/* the caller: wait until no worker is inside the job any more (they leave as soon as the tasks run out) */
static void wait_idle(void) {
    for (long i = 0; atomic_load(&busy) != 0; i++) {
        if (i > 2000) sched_yield();
        else cpu_relax();
    }
}

/* Run fn over tasks [0, ntasks) on the pool (serially on this thread if the pool is busy or empty). */
void pool_run(task_fn fn, void *ctx, int64_t ntasks, int64_t chunk) {
    if (ntasks <= 0) return;
    if (chunk < 1) chunk = 1;
    if (n_workers == 0 || ntasks <= chunk || pthread_mutex_trylock(&run_mx) != 0) {
        fn(ctx, 0, ntasks);
        return;
    }
    const int timed = atomic_load(&counting);
    const double t0 = timed ? now() : 0;
    job.fn = fn; job.ctx = ctx; job.ntasks = ntasks; job.chunk = chunk;
    atomic_store(&next_task, 0);
    atomic_store(&done_tasks, 0);
    unsigned g = atomic_load(&gen) + 1;          /* odd: open */
    atomic_store(&gen, g);
    if (atomic_load(&sleepers) > 0) wake_all();
    run_tasks();
    wait_done(ntasks);
    if (timed) {
        atomic_fetch_add(&offered_ns, (long long)(1e9 * (now() - t0) * (n_workers + 1)));
        atomic_fetch_add(&counted_jobs, 1);
    }
    atomic_store(&gen, g + 1);                   /* closed: late workers back off */
    wait_idle();                                 /* nobody still reads `job` */
    pthread_mutex_unlock(&run_mx);
}

/* Post `ctx` as the idle job (an earlier one is finished first, on this thread), stepped by step(ctx) until it
 * returns 1. */
void pool_idle_post(idle_fn step, void *ctx) {
    pthread_mutex_lock(&idle_mx);
    if (atomic_load(&idle_open))
        while (!idle.step(idle.ctx)) {}
    idle.step = step; idle.ctx = ctx;
    atomic_store(&idle_open, 1);
    pthread_mutex_unlock(&idle_mx);
    if (atomic_load(&sleepers) > 0) wake_all();
}

/* Make sure the idle job `ctx` (if it is the one posted) is complete: its remaining steps on this thread. */
void pool_idle_finish(void *ctx) {
    pthread_mutex_lock(&idle_mx);
    if (atomic_load(&idle_open) && idle.ctx == ctx) {
        while (!idle.step(ctx)) {}
        atomic_store(&idle_open, 0);
    }
    pthread_mutex_unlock(&idle_mx);
}

static void pool_stop(void) {
    pthread_mutex_lock(&run_mx);
    if (n_workers) {
        atomic_store(&stop_flag, 1);
        wake_all();
        for (int i = 0; i < n_workers; i++) pthread_join(workers[i], NULL);
        n_workers = 0;
        atomic_store(&stop_flag, 0);
    }
    pthread_mutex_unlock(&run_mx);
}

static int pool_start(int n) {   /* n threads in all, the caller included */
    pool_stop();
    pthread_mutex_lock(&run_mx);
    int err = 0;
    for (int i = 0; i < n - 1; i++) {
        if (pthread_create(&workers[i], NULL, worker_main, NULL) != 0) { err = 1; break; }
        n_workers++;
    }
    pthread_mutex_unlock(&run_mx);
    return err;
}

static void atfork_child(void) {   /* the workers did not come along */
    n_workers = 0;
    atomic_store(&busy, 0);
    atomic_store(&sleepers, 0);
    pthread_mutex_init(&run_mx, NULL);
    pthread_mutex_init(&sleep_mx, NULL);
    pthread_mutex_init(&idle_mx, NULL);
    pthread_cond_init(&sleep_cv, NULL);
    pthread_cond_init(&done_cv, NULL);
    atomic_store(&caller_sleeps, 0);
}

/* ======================================================================================================
 * paths
 * ==================================================================================================== */
static const kernel_path *path = &portable_path;

const kernel_path *current_path(void) { return path; }

/* The paths, best first. A path runs only where it was compiled (mm_task set), the CPU has its instructions, and
 * it passed its self-test (selftest.c) against the portable path; the test runs once, at its first use. */
enum { N_PATHS = 5 };
static const kernel_path *const all_paths[N_PATHS] = {&amx_path, &avx512vnni_path, &avxvnni_path, &avx2_path,
                                                      &portable_path};
static struct { int tested, passed, cases; double ms; char msg[200]; } checks[N_PATHS];

#if defined(__x86_64__)
/* AMX: the CPU has AMX-TILE and AMX-INT8 (CPUID leaf 7: EDX bits 24, 25), and Linux lets this process use the tile
 * registers (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: asked once, for the whole process) */
static int amx_usable(void) {
    static int usable = -1;
    if (usable < 0) {
        unsigned a, b, c, d;
        usable = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 25 & 1) &&
                 syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    }
    return usable;
}
#endif

static int cpu_has(int i) {
    if (all_paths[i] == &portable_path) return 1;
    if (!all_paths[i]->mm_task) return 0;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    if (all_paths[i] == &avx2_path) return avx2;
    if (all_paths[i] == &avxvnni_path) return avx2 && __builtin_cpu_supports("avxvnni");
    const int avx512vnni = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#if defined(__x86_64__)
    if (all_paths[i] == &amx_path) return avx512vnni && amx_usable();
#endif
    return avx512vnni;
#else
    return 0;
#endif
}

/* whether path i may run here: the CPU has it and its self-test passed (run now if it has not run) */
static int path_ok(int i) {
    if (!cpu_has(i)) return 0;
    if (all_paths[i] == &portable_path) return 1;
    if (!checks[i].tested) {
        const char *flip = getenv("TRACELM_SELFTEST_FAULT");   /* tests: a path named here is made to fail */
        const double t0 = now();
        checks[i].passed = path_selftest(all_paths[i], flip && strcmp(flip, all_paths[i]->name) == 0, checks[i].msg,
                                         sizeof checks[i].msg, &checks[i].cases) == 0;
        checks[i].ms = 1e3 * (now() - t0);
        checks[i].tested = 1;
    }
    return checks[i].passed;
}

static int path_index(const char *name) {
    for (int i = 0; i < N_PATHS; i++)
        if (strcmp(all_paths[i]->name, name) == 0 && (all_paths[i]->mm_task || all_paths[i] == &portable_path))
            return i;
    return -1;
}

/* ======================================================================================================
 * jobs
 * ==================================================================================================== */
typedef struct {
    const kernel_path *p; int qtype; const float *x; int64_t K; char *xq; int64_t xrb; int halves;
    char *xu;   /* the half-rows again, unsigned (mm_job's xu), or NULL */
} quant_job;

static void quant_tasks(void *ctx, int64_t t0, int64_t t1) {   /* x row m -> quantized rows hv m (hi) (, 2m + 1: lo) */
    quant_job *q = (quant_job *)ctx;
    for (int64_t m = t0; m < t1; m++) {
        q->p->quantize_row(q->qtype, q->x + m * q->K, q->K, q->xq + q->halves * m * q->xrb, q->halves);
        if (q->xu) made_unsigned(q->xq, q->xrb, q->K, q->halves, q->xu, m, m + 1);
    }
}

static int check_halves(const char *fn, int halves) {
    if (halves == 1 || halves == 2) return 0;
    PyErr_Format(PyExc_ValueError, "%s: halves must be 1 (x as one int8 block) or 2 (hi and lo), got %d", fn, halves);
    return -1;
}

typedef struct { const kernel_path *p; mm_job j; int64_t n_mtiles, n_gtasks; } mm_ctx;

static void mm_tasks(void *ctx, int64_t t0, int64_t t1) {
    mm_ctx *c = (mm_ctx *)ctx;
    for (int64_t t = t0; t < t1; t++) {   /* tile-major: tasks next to each other share x rows */
        int64_t tile = t / c->n_gtasks, group = t % c->n_gtasks * c->j.gstep;
        int64_t m0 = tile * c->j.mtile, m1 = m0 + c->j.mtile < c->j.M ? m0 + c->j.mtile : c->j.M;
        c->p->mm_task(&c->j, group, m0, m1);
    }
}

typedef struct { int qtype; const uint8_t *w; int64_t rb, K; float *out; } dq_ctx;

static void dq_tasks(void *ctx, int64_t t0, int64_t t1) {
    dq_ctx *c = (dq_ctx *)ctx;
    dequantize_rows(c->qtype, c->w, c->rb, c->K, c->out, t0, t1);
}

int pool_threads(void) { return n_workers + 1; }

int k_ahead = 4;
int prefetch_nta = 0;   /* set_prefetch_hint: t0 (0) or nta (1), kernels.h */
static int64_t tasks_per_thread = 8;   /* TRACELM_TASKS_PER_THREAD: chunks a thread takes of a job, about */

/* tasks taken at a time: about tasks_per_thread chunks a thread (each take is an atomic add on a line every thread
 * wants; more chunks balance late threads better) */
int64_t chunk_for(int64_t ntasks) {
    int64_t c = ntasks / (tasks_per_thread * (int64_t)(n_workers + 1));
    return c < 1 ? 1 : c;
}

/* ======================================================================================================
 * argument checks
 * ==================================================================================================== */
void release(buf *b) { if (b->held) PyBuffer_Release(&b->v); b->held = 0; }

const char *fmt_name(const Py_buffer *v) { return v->format ? v->format : "B"; }

int fmt_is(const Py_buffer *v, char c) {
    const char *f = fmt_name(v);
    if (*f == '<' || *f == '=' || *f == '@') f++;
    return f[0] == c && f[1] == 0;
}

void shape_str(const Py_buffer *v, char *s, size_t n) {
    size_t o = (size_t)snprintf(s, n, "[");
    for (int i = 0; i < v->ndim && o < n; i++)
        o += (size_t)snprintf(s + o, n - o, i ? ", %zd" : "%zd", v->shape[i]);
    if (o < n) snprintf(s + o, n - o, "]");
}

static Py_ssize_t stride_of(const Py_buffer *v, int i) {   /* in bytes; a buffer without strides is C-contiguous */
    if (v->strides) return v->strides[i];
    Py_ssize_t st = v->itemsize;
    for (int k = i + 1; k < v->ndim; k++) st *= v->shape[k];
    return st;
}

/* the bytes a buffer's items lie in: [*lo, *hi), empty when it has no items */
void span_of(const Py_buffer *v, uintptr_t *lo, uintptr_t *hi) {
    uintptr_t b = (uintptr_t)v->buf;
    Py_ssize_t below = 0, above = 0;
    for (int i = 0; i < v->ndim; i++) {
        if (v->shape[i] == 0) {
            *lo = *hi = b;
            return;
        }
        Py_ssize_t d = (v->shape[i] - 1) * stride_of(v, i);
        if (d < 0) below += d;
        else above += d;
    }
    *lo = b + below;   /* below <= 0 */
    *hi = b + above + v->itemsize;
}

static int same_view(const Py_buffer *a, const Py_buffer *b) {
    if (a->buf != b->buf || a->ndim != b->ndim || a->itemsize != b->itemsize) return 0;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i] || (a->shape[i] > 1 && stride_of(a, i) != stride_of(b, i))) return 0;
    return 1;
}

/* a buffer as *R runs of *W contiguous bytes, *S bytes apart (S >= W): 1 when it is one (C-contiguous; or 2-D with
 * unit-strided rows at a positive stride), else 0 */
static int runs_of(const Py_buffer *v, Py_ssize_t *R, Py_ssize_t *S, Py_ssize_t *W) {
    if (PyBuffer_IsContiguous(v, 'C')) {
        *R = 1, *S = *W = v->len;
        return 1;
    }
    if (v->ndim != 2 || (v->shape[1] > 1 && stride_of(v, 1) != v->itemsize)) return 0;
    *R = v->shape[0], *S = stride_of(v, 0), *W = v->shape[1] * v->itemsize;
    return *R <= 1 || *S >= *W;
}

static Py_ssize_t floor_div(Py_ssize_t a, Py_ssize_t b) { return a / b - (a % b != 0 && (a < 0) != (b < 0)); }

/* whether two buffers share a byte: exactly when both are runs (runs_of) at one stride (or one is a single run),
 * else whether their spans meet (which may refuse views that interleave without touching) */
static int share_bytes(const Py_buffer *a, const Py_buffer *b) {
    uintptr_t a0, a1, b0, b1;
    span_of(a, &a0, &a1);
    span_of(b, &b0, &b1);
    if (a0 == a1 || b0 == b1 || a1 <= b0 || b1 <= a0) return 0;
    Py_ssize_t ra, sa, wa, rb, sb, wb;
    if (!runs_of(a, &ra, &sa, &wa) || !runs_of(b, &rb, &sb, &wb)) return 1;
    const Py_ssize_t s = ra > 1 ? sa : sb;
    if (ra > 1 && rb > 1 && sa != sb) return 1;
    if (ra <= 1 && rb <= 1) return 1;   /* two runs whose spans meet */
    /* run i of a, k of b: a0 + i s + x == b0 + k s + y (x < wa, y < wb) for some q = i - k in [-(rb-1), ra-1]:
     * q s in [d - wa + 1, d + wb - 1], d = b0 - a0 */
    const Py_ssize_t d = (Py_ssize_t)(b0 - a0);
    Py_ssize_t qlo = -floor_div(-(d - wa + 1), s), qhi = floor_div(d + wb - 1, s);
    if (qlo < -(rb - 1)) qlo = -(rb - 1);
    if (qhi > ra - 1) qhi = ra - 1;
    return qlo <= qhi;
}

int check_apart(const char *fn, const char *out_name, const Py_buffer *out, const char *in_name, const Py_buffer *in,
                int same_ok) {
    if (!share_bytes(out, in) || (same_ok && same_view(out, in))) return 0;
    if (same_ok)
        PyErr_Format(PyExc_ValueError, "%s: %s shares memory with %s: it may be %s itself (the same array), not "
                     "overlap it otherwise", fn, out_name, in_name, in_name);
    else
        PyErr_Format(PyExc_ValueError, "%s: %s shares memory with %s: an array the call writes must not overlap one "
                     "it reads (or another it writes)", fn, out_name, in_name);
    return -1;
}

/* get a 2-D buffer of item type `fmt` ('f' float32, 'B' uint8): C-contiguous, or (row_stride) with unit column
 * stride and rows at a positive stride of at least a row apart (*ld: the row stride in items) */
static int get2d_ld(PyObject *o, const char *fn, const char *name, char fmt, int writable, int row_stride, buf *b,
                    int64_t *ld) {
    int flags = PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(o, &b->v, flags) != 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: %s must be a%s numpy array (buffer), got %s", fn, name,
                     writable ? " writable" : "", Py_TYPE(o)->tp_name);
        return -1;
    }
    b->held = 1;
    char shp[96];   /* the shape as text, made only for an error (every array of every call passes here) */
    const char *dt = fmt == 'f' ? "float32" : "uint8";
    if (!fmt_is(&b->v, fmt) || b->v.itemsize != (fmt == 'f' ? 4 : 1)) {
        shape_str(&b->v, shp, sizeof shp);
        PyErr_Format(PyExc_ValueError, "%s: %s must be %s, got format '%s' (itemsize %zd), shape %s", fn, name, dt,
                     fmt_name(&b->v), b->v.itemsize, shp);
        return -1;
    }
    if (b->v.ndim != 2) {
        shape_str(&b->v, shp, sizeof shp);
        PyErr_Format(PyExc_ValueError, "%s: %s must be 2-D, got shape %s", fn, name, shp);
        return -1;
    }
    if (ld) *ld = b->v.shape[1];
    if (PyBuffer_IsContiguous(&b->v, 'C')) return 0;
    if (row_stride) {
        Py_ssize_t R = b->v.shape[0], C = b->v.shape[1], is = b->v.itemsize;
        Py_ssize_t s0 = b->v.strides ? b->v.strides[0] : C * is, s1 = b->v.strides ? b->v.strides[1] : is;
        if ((C <= 1 || s1 == is) && (R <= 1 || (s0 > 0 && s0 % is == 0 && s0 / is >= C))) {
            if (ld) *ld = R <= 1 ? C : s0 / is;
            return 0;
        }
        shape_str(&b->v, shp, sizeof shp);
        PyErr_Format(PyExc_ValueError, "%s: %s (shape %s, strides [%zd, %zd] bytes) must have unit column stride and "
                     "rows at least a row apart (e.g. a column slice of a wider C-contiguous array)", fn, name, shp,
                     s0, s1);
        return -1;
    }
    shape_str(&b->v, shp, sizeof shp);
    PyErr_Format(PyExc_ValueError, "%s: %s (shape %s) must be C-contiguous", fn, name, shp);
    return -1;
}

static int get2d(PyObject *o, const char *fn, const char *name, char fmt, int writable, buf *b) {
    return get2d_ld(o, fn, name, fmt, writable, 0, b, NULL);
}

static int check_qtype(const char *fn, int qtype) {
    if (type_block(qtype) == 0) {
        PyErr_Format(PyExc_ValueError, "%s: qtype %d is not supported (F32=0 F16=1 Q4_0=2 Q4_1=3 Q5_0=6 Q5_1=7 "
                     "Q8_0=8 Q4_K=12 Q5_K=13 Q6_K=14 BF16=30)", fn, qtype);
        return -1;
    }
    return 0;
}

/* K from row_bytes */
static int values_per_row(const char *fn, int qtype, Py_ssize_t row_bytes, int64_t *K) {
    int bs = type_block(qtype), tb = type_bytes(qtype);
    if (row_bytes % tb != 0) {
        PyErr_Format(PyExc_ValueError, "%s: w rows hold %zd bytes, not a whole number of qtype %d blocks "
                     "(%d bytes per %d values)", fn, row_bytes, qtype, tb, bs);
        return -1;
    }
    *K = (int64_t)(row_bytes / tb) * bs;
    return 0;
}

static int get_scratch(PyObject *o, const char *fn, int64_t need, buf *b) {
    if (PyObject_GetBuffer(o, &b->v, PyBUF_WRITABLE | PyBUF_STRIDES) != 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: scratch must be a writable buffer of at least %lld bytes, got %s", fn,
                     (long long)need, Py_TYPE(o)->tp_name);
        return -1;
    }
    b->held = 1;
    if (!PyBuffer_IsContiguous(&b->v, 'C') || b->v.len < need || ((uintptr_t)b->v.buf & 3)) {
        PyErr_Format(PyExc_ValueError, "%s: scratch must be contiguous, 4-byte aligned and hold at least %lld "
                     "bytes (scratch_bytes(M, K, qtype)), got %zd bytes", fn, (long long)need, b->v.len);
        return -1;
    }
    return 0;
}

/* packed weights (kernels.h): a quantized type, whole groups of 8 rows (w: the buffer itself, 2-D) */
static int check_packable(const char *fn, int qtype, const buf *w) {
    if (!packable(qtype)) {
        PyErr_Format(PyExc_ValueError, "%s: qtype %d cannot be packed (Q4_0=2 Q4_1=3 Q5_0=6 Q5_1=7 Q8_0=8 "
                     "Q4_K=12 Q5_K=13 Q6_K=14 can)", fn,
                     qtype);
        return -1;
    }
    Py_ssize_t rows = w->v.shape[0];
    if (rows % GROUP) {
        PyErr_Format(PyExc_ValueError, "%s: packed weights come in groups of %d rows, got %zd rows", fn, GROUP, rows);
        return -1;
    }
    return 0;
}

/* ======================================================================================================
 * Python functions
 * ==================================================================================================== */
static PyObject *py_matmul(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *wo, *oo, *so = Py_None;
    int qtype, halves = 2, packed = 0;
    if (!PyArg_ParseTuple(args, "OOiO|Oip:matmul", &xo, &wo, &qtype, &oo, &so, &halves, &packed)) return NULL;
    buf x = {0}, w = {0}, out = {0}, sc = {0};
    PyObject *ret = NULL;
    int64_t ldo = 0;
    if (check_qtype("matmul", qtype) || check_halves("matmul", halves)) goto done;
    if (get2d(xo, "matmul", "x", 'f', 0, &x) || get2d(wo, "matmul", "w", 'B', 0, &w) ||
        get2d_ld(oo, "matmul", "out", 'f', 1, 1, &out, &ldo) || (packed && check_packable("matmul", qtype, &w)) ||
        check_apart("matmul", "out", &out.v, "x", &x.v, 0) || check_apart("matmul", "out", &out.v, "w", &w.v, 0))
        goto done;
    int64_t M = x.v.shape[0], Kx = x.v.shape[1], N = w.v.shape[0], K;
    if (values_per_row("matmul", qtype, w.v.shape[1], &K)) goto done;
    if (K != Kx) {
        PyErr_Format(PyExc_ValueError, "matmul: x has %lld values per row, w rows (%zd bytes of qtype %d) hold %lld",
                     (long long)Kx, w.v.shape[1], qtype, (long long)K);
        goto done;
    }
    if (out.v.shape[0] != M || out.v.shape[1] != N) {
        PyErr_Format(PyExc_ValueError, "matmul: out must have shape [%lld, %lld] (M, N), got [%zd, %zd]",
                     (long long)M, (long long)N, out.v.shape[0], out.v.shape[1]);
        goto done;
    }
    int64_t xrb = xq_row_bytes(qtype, K), xub = xu_row_bytes(qtype, K);
    if (xrb && (get_scratch(so, "matmul", halves * M * (xrb + xub) + XQ_ALIGN, &sc) ||
                check_apart("matmul", "scratch", &sc.v, "x", &x.v, 0)
                || check_apart("matmul", "scratch", &sc.v, "w", &w.v, 0) ||
                check_apart("matmul", "scratch", &sc.v, "out", &out.v, 0)))
        goto done;
    if (M > 0 && N > 0) {
        mm_ctx c;
        c.p = path;
        c.j.qtype = qtype; c.j.M = M; c.j.N = N; c.j.K = K;
        c.j.x = (const float *)x.v.buf; c.j.w = (const uint8_t *)w.v.buf; c.j.row_bytes = w.v.shape[1];
        c.j.out = (float *)out.v.buf; c.j.ldo = ldo; c.j.xq = xrb ? xq_start(sc.v.buf) : NULL; c.j.xq_row_bytes = xrb;
        c.j.xu = wants_unsigned(path, qtype, M) ? (const char *)c.j.xq + halves * M * xrb : NULL;
        c.j.halves = halves;
        c.j.packed = packed;
        mm_job_plan(path, &c.j);
        c.n_mtiles = (M + c.j.mtile - 1) / c.j.mtile;
        c.n_gtasks = (c.j.n_groups + c.j.gstep - 1) / c.j.gstep;
        Py_BEGIN_ALLOW_THREADS
        if (xrb) {
            quant_job q = {path, qtype, c.j.x, K, (char *)c.j.xq, xrb, halves, (char *)c.j.xu};
            if (M * K < (1 << 15)) quant_tasks(&q, 0, M);
            else pool_run(quant_tasks, &q, M, chunk_for(M));
        }
        int64_t ntasks = c.n_mtiles * c.n_gtasks;
        pool_run(mm_tasks, &c, ntasks, chunk_for(ntasks));
        Py_END_ALLOW_THREADS
    }
    Py_INCREF(oo);
    ret = oo;
done:
    release(&x); release(&w); release(&out); release(&sc);
    return ret;
}

static PyObject *py_quantize_rows(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *so;
    int qtype, halves = 2;
    if (!PyArg_ParseTuple(args, "OiO|i:quantize_rows", &xo, &qtype, &so, &halves)) return NULL;
    buf x = {0}, sc = {0};
    PyObject *ret = NULL;
    if (check_qtype("quantize_rows", qtype) || check_halves("quantize_rows", halves)) goto done;
    if (is_float_type(qtype)) {
        PyErr_Format(PyExc_ValueError, "quantize_rows: qtype %d takes float activations, nothing to quantize", qtype);
        goto done;
    }
    if (get2d(xo, "quantize_rows", "x", 'f', 0, &x)) goto done;
    int64_t M = x.v.shape[0], K = x.v.shape[1];
    if (K % type_block(qtype)) {
        PyErr_Format(PyExc_ValueError, "quantize_rows: x rows hold %lld values, not a multiple of %d", (long long)K,
                     type_block(qtype));
        goto done;
    }
    int64_t xrb = xq_row_bytes(qtype, K);
    if (get_scratch(so, "quantize_rows", halves * M * xrb + (xrb ? XQ_ALIGN : 0), &sc) ||
        check_apart("quantize_rows", "scratch", &sc.v, "x", &x.v, 0))
        goto done;
    Py_BEGIN_ALLOW_THREADS
    quant_job q = {path, qtype, (const float *)x.v.buf, K, xq_start(sc.v.buf), xrb, halves, NULL};
    pool_run(quant_tasks, &q, M, chunk_for(M));
    Py_END_ALLOW_THREADS
    ret = Py_None;
    Py_INCREF(ret);
done:
    release(&x); release(&sc);
    return ret;
}

static PyObject *py_dequantize(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *wo, *oo;
    int qtype;
    if (!PyArg_ParseTuple(args, "OiO:dequantize", &wo, &qtype, &oo)) return NULL;
    buf w = {0}, out = {0};
    PyObject *ret = NULL;
    int64_t K;
    if (check_qtype("dequantize", qtype) || get2d(wo, "dequantize", "w", 'B', 0, &w) ||
        get2d(oo, "dequantize", "out", 'f', 1, &out) || values_per_row("dequantize", qtype, w.v.shape[1], &K) ||
        check_apart("dequantize", "out", &out.v, "w", &w.v, 0))
        goto done;
    if (out.v.shape[0] != w.v.shape[0] || out.v.shape[1] != K) {
        PyErr_Format(PyExc_ValueError, "dequantize: out must have shape [%zd, %lld], got [%zd, %zd]", w.v.shape[0],
                     (long long)K, out.v.shape[0], out.v.shape[1]);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    dq_ctx c = {qtype, (const uint8_t *)w.v.buf, w.v.shape[1], K, (float *)out.v.buf};
    int64_t R = w.v.shape[0];
    if (R * K < (1 << 16)) dq_tasks(&c, 0, R);
    else pool_run(dq_tasks, &c, R, chunk_for(R));
    Py_END_ALLOW_THREADS
    Py_INCREF(oo);
    ret = oo;
done:
    release(&w); release(&out);
    return ret;
}

typedef struct { int qtype; const uint8_t *w; uint8_t *out; int64_t rb, nb; atomic_int no_memory; } pack_ctx;

static void pack_tasks(void *ctx, int64_t g0, int64_t g1) {   /* groups g0..g1-1; out may be w (a group at a time) */
    pack_ctx *c = (pack_ctx *)ctx;
    uint8_t *tmp = malloc((size_t)(GROUP * c->rb));
    if (!tmp) {   /* these groups stay as they were; the call raises MemoryError */
        atomic_store(&c->no_memory, 1);
        return;
    }
    for (int64_t g = g0; g < g1; g++) {
        memcpy(tmp, c->w + g * GROUP * c->rb, (size_t)(GROUP * c->rb));
        const uint8_t *rows[GROUP];
        for (int r = 0; r < GROUP; r++) rows[r] = tmp + r * c->rb;
        pack_group(c->qtype, rows, c->nb, c->out + g * GROUP * c->rb);
    }
    free(tmp);
}

static PyObject *py_pack(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *wo, *oo;
    int qtype;
    if (!PyArg_ParseTuple(args, "OiO:pack", &wo, &qtype, &oo)) return NULL;
    buf w = {0}, out = {0};
    PyObject *ret = NULL;
    int64_t K;
    if (check_qtype("pack", qtype) || get2d(wo, "pack", "w", 'B', 0, &w) || check_packable("pack", qtype, &w) ||
        get2d(oo, "pack", "out", 'B', 1, &out) || values_per_row("pack", qtype, w.v.shape[1], &K) ||
        check_apart("pack", "out", &out.v, "w", &w.v, 1))
        goto done;
    if (out.v.shape[0] != w.v.shape[0] || out.v.shape[1] != w.v.shape[1]) {
        PyErr_Format(PyExc_ValueError, "pack: out must have w's shape [%zd, %zd], got [%zd, %zd]", w.v.shape[0],
                     w.v.shape[1], out.v.shape[0], out.v.shape[1]);
        goto done;
    }
    pack_ctx c = {qtype, (const uint8_t *)w.v.buf, (uint8_t *)out.v.buf, w.v.shape[1], K / type_block(qtype), 0};
    int64_t G = w.v.shape[0] / GROUP;
    Py_BEGIN_ALLOW_THREADS
    pool_run(pack_tasks, &c, G, chunk_for(G));
    Py_END_ALLOW_THREADS
    if (atomic_load(&c.no_memory)) {
        PyErr_Format(PyExc_MemoryError, "pack: no memory for a group of %d rows of %lld bytes (out is partly packed)",
                     GROUP, (long long)c.rb);
        goto done;
    }
    Py_INCREF(oo);
    ret = oo;
done:
    release(&w); release(&out);
    return ret;
}

static PyObject *py_unpack_rows(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *wo, *io, *oo;
    int qtype;
    if (!PyArg_ParseTuple(args, "OiOO:unpack_rows", &wo, &qtype, &io, &oo)) return NULL;
    buf w = {0}, ids = {0}, out = {0};
    PyObject *ret = NULL;
    int64_t K;
    if (check_qtype("unpack_rows", qtype) || get2d(wo, "unpack_rows", "w", 'B', 0, &w) ||
        check_packable("unpack_rows", qtype, &w) || get2d(oo, "unpack_rows", "out", 'B', 1, &out) ||
        values_per_row("unpack_rows", qtype, w.v.shape[1], &K) || check_apart("unpack_rows", "out", &out.v, "w", &w.v, 0))
        goto done;
    if (PyObject_GetBuffer(io, &ids.v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0 || ids.v.itemsize != 8 ||
        !(fmt_is(&ids.v, 'q') || fmt_is(&ids.v, 'l'))) {
        if (!PyErr_Occurred()) ids.held = 1;
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "unpack_rows: ids must be a contiguous int64 array");
        goto done;
    }
    ids.held = 1;
    if (check_apart("unpack_rows", "out", &out.v, "ids", &ids.v, 0)) goto done;
    int64_t n = ids.v.len / 8, R = w.v.shape[0], rb = w.v.shape[1];
    if (out.v.shape[0] != n || out.v.shape[1] != rb) {
        PyErr_Format(PyExc_ValueError, "unpack_rows: out must have shape [%lld, %lld], got [%zd, %zd]", (long long)n,
                     (long long)rb, out.v.shape[0], out.v.shape[1]);
        goto done;
    }
    const int64_t *id = (const int64_t *)ids.v.buf;
    for (int64_t i = 0; i < n; i++)
        if (id[i] < 0 || id[i] >= R) {
            PyErr_Format(PyExc_IndexError, "unpack_rows: row %lld is out of range for %lld rows", (long long)id[i],
                         (long long)R);
            goto done;
        }
    uint8_t *tmp = malloc((size_t)(GROUP * rb));
    if (!tmp) { PyErr_NoMemory(); goto done; }
    for (int64_t i = 0; i < n; i++) {   /* a row's group back to the file's layout, then its row */
        uint8_t *rows[GROUP];
        for (int r = 0; r < GROUP; r++) rows[r] = tmp + r * rb;
        unpack_group(qtype, (const uint8_t *)w.v.buf + id[i] / GROUP * GROUP * rb, K / type_block(qtype), rows);
        memcpy((uint8_t *)out.v.buf + i * rb, rows[id[i] % GROUP], (size_t)rb);
    }
    free(tmp);
    Py_INCREF(oo);
    ret = oo;
done:
    release(&w); release(&ids); release(&out);
    return ret;
}

static PyObject *py_scratch_bytes(PyObject *self, PyObject *args) {
    (void)self;
    long long M, K;
    int qtype, halves = 2;
    if (!PyArg_ParseTuple(args, "LLi|i:scratch_bytes", &M, &K, &qtype, &halves)) return NULL;
    if (check_qtype("scratch_bytes", qtype) || check_halves("scratch_bytes", halves)) return NULL;
    if (M < 0 || K < 0 || K % type_block(qtype) || K > (1LL << 40)) {
        PyErr_Format(PyExc_ValueError, "scratch_bytes: need M >= 0 and K a multiple of %d up to 2^40, got M=%lld "
                     "K=%lld", type_block(qtype), M, K);
        return NULL;
    }
    const long long xrb = (long long)xq_row_bytes(qtype, K) + (long long)xu_row_bytes(qtype, K);
    if (xrb && M > (LLONG_MAX - XQ_ALIGN) / halves / xrb) {
        PyErr_Format(PyExc_ValueError, "scratch_bytes: M=%lld rows of K=%lld values need more bytes than fit in 64 "
                     "bits", M, K);
        return NULL;
    }
    return PyLong_FromLongLong(xrb ? halves * M * xrb + XQ_ALIGN : 0);   /* hi (and lo) of each row (Q4_0/Q5_0: twice),
                                                                          * aligned */
}

static PyObject *py_set_threads(PyObject *self, PyObject *args) {
    (void)self;
    int n;
    if (!PyArg_ParseTuple(args, "i:set_threads", &n)) return NULL;
    if (n < 1 || n > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "set_threads: n must be 1..%d, got %d", MAX_THREADS, n);
        return NULL;
    }
    if (n == n_workers + 1) Py_RETURN_NONE;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = pool_start(n);
    Py_END_ALLOW_THREADS
    if (err) {
        PyErr_Format(PyExc_RuntimeError, "set_threads: could only start %d of %d threads", n_workers + 1, n);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *py_threads(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    return PyLong_FromLong(n_workers + 1);
}

static PyObject *py_set_k_ahead(PyObject *self, PyObject *args) {
    (void)self;
    int n;
    if (!PyArg_ParseTuple(args, "i:set_k_ahead", &n)) return NULL;
    if (n < 0 || n > MAX_K_AHEAD) {
        PyErr_Format(PyExc_ValueError, "set_k_ahead: n must be 0..%d super-blocks, got %d", MAX_K_AHEAD, n);
        return NULL;
    }
    k_ahead = n;   /* read by each product as it starts: none runs while the GIL is held here */
    Py_RETURN_NONE;
}

static PyObject *py_k_ahead(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    return PyLong_FromLong(k_ahead);
}

static const char *const HINTS[2] = {"t0", "nta"};

static int hint_index(const char *hint) {   /* HINTS' index of hint (0 t0, 1 nta), -1 if neither */
    for (int i = 0; i < 2; i++)
        if (!strcmp(hint, HINTS[i])) return i;
    return -1;
}

static PyObject *py_set_prefetch_hint(PyObject *self, PyObject *args) {
    (void)self;
    const char *hint;
    if (!PyArg_ParseTuple(args, "s:set_prefetch_hint", &hint)) return NULL;
    const int i = hint_index(hint);
    if (i >= 0) {
        prefetch_nta = i;   /* read by each prefetch: no product runs while the GIL is held here */
        Py_RETURN_NONE;
    }
    PyErr_Format(PyExc_ValueError, "set_prefetch_hint: hint must be '%s' or '%s', got '%s'", HINTS[0], HINTS[1], hint);
    return NULL;
}

static PyObject *py_prefetch_hint(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    return PyUnicode_FromString(HINTS[prefetch_nta]);
}

static PyObject *py_pool_counting(PyObject *self, PyObject *args) {
    (void)self;
    int on;
    if (!PyArg_ParseTuple(args, "p:pool_counting", &on)) return NULL;
    if (on) { atomic_store(&counted_jobs, 0); atomic_store(&offered_ns, 0); atomic_store(&busy_ns, 0); }
    atomic_store(&counting, on);   /* read as each job opens: none runs while the GIL is held here */
    Py_RETURN_NONE;
}

static PyObject *py_pool_counts(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    return Py_BuildValue("(Ldd)", (long long)atomic_load(&counted_jobs), 1e-9 * (double)atomic_load(&offered_ns),
                         1e-9 * (double)atomic_load(&busy_ns));
}

static PyObject *py_path(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    return PyUnicode_FromString(path->name);
}

/* dot_peak(rounds): the path's integer dot at its peak on every thread of the pool (8 tasks a thread of `rounds`
 * rounds each, so that a thread woken late takes fewer): (int8 products done, the instruction); (0, None) on the
 * portable path, which has no vector dot to time */
typedef struct { const kernel_path *p; int64_t rounds; atomic_llong products; } peak_ctx;

static void peak_tasks(void *ctx, int64_t t0, int64_t t1) {
    peak_ctx *c = (peak_ctx *)ctx;
    for (int64_t t = t0; t < t1; t++) atomic_fetch_add(&c->products, (long long)c->p->dot_peak(c->rounds));
}

static PyObject *py_dot_peak(PyObject *self, PyObject *args) {
    (void)self;
    long long rounds;
    if (!PyArg_ParseTuple(args, "L:dot_peak", &rounds)) return NULL;
    if (rounds < 1) return PyErr_Format(PyExc_ValueError, "dot_peak: rounds must be >= 1, not %lld", rounds);
    if (!path->dot_peak) return Py_BuildValue("(Ls)", 0LL, NULL);
    peak_ctx c = {path, rounds, 0};
    Py_BEGIN_ALLOW_THREADS
    pool_run(peak_tasks, &c, 8 * (int64_t)(n_workers + 1), 1);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(Ls)", (long long)atomic_load(&c.products), path->dot_insn);
}

static PyObject *py_paths(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    PyObject *t = PyTuple_New(0);
    for (int i = 0; t && i < N_PATHS; i++) {
        if (!path_ok(i)) continue;
        PyObject *name = PyUnicode_FromString(all_paths[i]->name);
        const Py_ssize_t n = PyTuple_GET_SIZE(t);
        if (!name || _PyTuple_Resize(&t, n + 1) < 0) { Py_XDECREF(name); Py_XDECREF(t); return NULL; }
        PyTuple_SET_ITEM(t, n, name);
    }
    return t;
}

static PyObject *py_use_path(PyObject *self, PyObject *args) {
    (void)self;
    const char *name;
    if (!PyArg_ParseTuple(args, "s:use_path", &name)) return NULL;
    const int i = path_index(name);
    if (i < 0 || !path_ok(i)) {
        PyObject *ok = py_paths(NULL, NULL);
        const int refused = i >= 0 && cpu_has(i);
        PyErr_Format(PyExc_ValueError, "use_path: '%s' is not available here (%s%s; available: %S)", name,
                     refused ? "its self-test failed: " : "",
                     i < 0 ? "no such path" : refused ? checks[i].msg : "this CPU lacks its instructions", ok);
        Py_XDECREF(ok);
        return NULL;
    }
    path = all_paths[i];
    Py_RETURN_NONE;
}

/* {name: (status, detail)} for every path compiled in: status 'passed' / 'refused' (detail: the first case that
 * differs) / 'untested' (not used yet) / 'unsupported' (this CPU lacks it); detail of a pass: cases and ms */
static PyObject *py_selftest(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    PyObject *d = PyDict_New();
    for (int i = 0; d && i < N_PATHS; i++) {
        if (!all_paths[i]->mm_task && all_paths[i] != &portable_path) continue;
        PyObject *v;
        if (all_paths[i] == &portable_path) v = Py_BuildValue("(ss)", "passed", "the reference");
        else if (!cpu_has(i)) v = Py_BuildValue("(ss)", "unsupported", "this CPU lacks its instructions");
        else if (!checks[i].tested) v = Py_BuildValue("(ss)", "untested", "not used yet");
        else if (checks[i].passed)
            v = PyUnicode_FromFormat("%d cases in %d.%d ms", checks[i].cases, (int)checks[i].ms,
                                     (int)(10 * checks[i].ms) % 10),
            v = v ? Py_BuildValue("(sN)", "passed", v) : NULL;
        else v = Py_BuildValue("(ss)", "refused", checks[i].msg);
        if (!v || PyDict_SetItemString(d, all_paths[i]->name, v) < 0) { Py_XDECREF(v); Py_DECREF(d); return NULL; }
        Py_DECREF(v);
    }
    return d;
}

static PyObject *py_shutdown(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    Py_BEGIN_ALLOW_THREADS
    pool_stop();
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"matmul", py_matmul, METH_VARARGS,
     "matmul(x, w, qtype, out, scratch=None, halves=2, packed=False): out = x w^T on GGUF blocks"},
    {"quantize_rows", py_quantize_rows, METH_VARARGS,
     "quantize_rows(x, qtype, scratch, halves=2): x rows -> int8 blocks, a hi (and a lo) row of blocks for each"},
    {"dequantize", py_dequantize, METH_VARARGS, "dequantize(w, qtype, out): GGUF block rows -> f32 rows"},
    {"pack", py_pack, METH_VARARGS, "pack(w, qtype, out): GGUF rows -> packed groups of 8 rows (out may be w)"},
    {"unpack_rows", py_unpack_rows, METH_VARARGS, "unpack_rows(w, qtype, ids, out): rows ids of packed w as GGUF rows"},
    {"scratch_bytes", py_scratch_bytes, METH_VARARGS,
     "scratch_bytes(M, K, qtype, halves=2): bytes of quantized x"},
    {"set_threads", py_set_threads, METH_VARARGS, "set_threads(n): n threads in all (the caller included)"},
    {"threads", py_threads, METH_NOARGS, "threads(): threads in all"},
    {"set_k_ahead", py_set_k_ahead, METH_VARARGS,
     "set_k_ahead(n): the K-quants' packed decode kernels prefetch n super-blocks ahead (0: none; the same bits)"},
    {"k_ahead", py_k_ahead, METH_NOARGS, "k_ahead(): the K-quants' decode prefetch distance in super-blocks"},
    {"set_prefetch_hint", py_set_prefetch_hint, METH_VARARGS,
     "set_prefetch_hint(hint): the weights' software prefetch, 't0' (every cache level) or 'nta' (non-temporal)"},
    {"prefetch_hint", py_prefetch_hint, METH_NOARGS, "prefetch_hint(): 't0' or 'nta'"},
    {"pool_counting", py_pool_counting, METH_VARARGS,
     "pool_counting(on): count the pool's jobs from now (the counts reset), or stop counting"},
    {"pool_counts", py_pool_counts, METH_NOARGS,
     "pool_counts() -> (jobs, offered seconds: each job's wall time x the threads, busy seconds: inside its tasks)"},
    {"path", py_path, METH_NOARGS, "path(): the path in use ('amx', 'avx512vnni', 'avxvnni', 'avx2' or 'portable')"},
    {"use_path", py_use_path, METH_VARARGS, "use_path(name): switch path (self-tested at its first use)"},
    {"paths", py_paths, METH_NOARGS, "paths(): the paths this CPU can run that passed their self-test, best first"},
    {"selftest", py_selftest, METH_NOARGS, "selftest(): {path: (status, detail)} of every compiled path"},
    {"dot_peak", py_dot_peak, METH_VARARGS,
     "dot_peak(rounds): the path's integer dot at its peak on every thread: (int8 products, instruction)"},
    {"shutdown", py_shutdown, METH_NOARGS, "shutdown(): stop the worker threads"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_core", "tracelm compiled kernels", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__core(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddFunctions(m, layer_methods) < 0) { Py_DECREF(m); return NULL; }
    if (PyModule_AddFunctions(m, trace_methods) < 0 || add_trace_types(m) < 0) { Py_DECREF(m); return NULL; }
    /* the best path that may run here; TRACELM_KERNELS=NAME: that one (if it may run; else the best) */
    const char *env = getenv("TRACELM_KERNELS");
    const int want = env && *env ? path_index(env) : -1;
    path = &portable_path;
    if (want >= 0 && path_ok(want)) path = all_paths[want];
    else
        for (int i = 0; i < N_PATHS; i++)
            if (path_ok(i)) { path = all_paths[i]; break; }
    const char *spin = getenv("TRACELM_SPIN_US"), *per = getenv("TRACELM_TASKS_PER_THREAD");
    if (spin && *spin) spin_seconds = atof(spin) * 1e-6;
    if (per && atoi(per) >= 1) tasks_per_thread = atoi(per);
    /* the weights' prefetch hint: TRACELM_PREFETCH_HINT (t0 or nta), else nta on AMD's CPUs -- measured on a Zen 5
     * EPYC, 2 threads, `tracelm bench paths --prefetch-hints t0,nta`: decode 1.05-1.14x on the three registry
     * models, prefill 1.01-1.03x, a 7B neither way -- and t0 on the others until measured there (docs/performance.md) */
    const char *hint = getenv("TRACELM_PREFETCH_HINT");
    if (hint && hint_index(hint) >= 0) prefetch_nta = hint_index(hint);
#if defined(__x86_64__) || defined(__i386__)
    else {
        __builtin_cpu_init();
        prefetch_nta = __builtin_cpu_is("amd");
    }
#endif
    const char *ahead = getenv("TRACELM_K_AHEAD");
    if (ahead && *ahead >= '0' && *ahead <= '9') {   /* digits, 0..64, or left at 4 (the Python side warns) */
        char *end;
        const long v = strtol(ahead, &end, 10);
        if (!*end && v <= MAX_K_AHEAD) k_ahead = (int)v;
    }
    static int forked_hook = 0;
    if (!forked_hook) { pthread_atfork(NULL, NULL, atfork_child); forked_hook = 1; }
    PyObject *sup = Py_BuildValue("(iiiiiiiiiii)", T_F32, T_F16, T_Q4_0, T_Q4_1, T_Q5_0, T_Q5_1, T_Q8_0, T_Q4_K,
                                  T_Q5_K, T_Q6_K, T_BF16);
    if (!sup || PyModule_AddObject(m, "SUPPORTED", sup) < 0) { Py_XDECREF(sup); Py_DECREF(m); return NULL; }
    if (PyModule_AddIntConstant(m, "MAX_K_AHEAD", MAX_K_AHEAD) < 0) { Py_DECREF(m); return NULL; }
    PyObject *hints = Py_BuildValue("(ss)", HINTS[0], HINTS[1]);
    if (!hints || PyModule_AddObject(m, "PREFETCH_HINTS", hints) < 0) { Py_XDECREF(hints); Py_DECREF(m); return NULL; }
    return m;
}
