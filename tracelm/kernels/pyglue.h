/* What core.c shares with layer.c: the thread pool, the current path and the buffer helpers (Python-facing). */
#ifndef TRACELM_PYGLUE_H
#define TRACELM_PYGLUE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "kernels.h"

#define HIDDEN __attribute__((visibility("hidden")))

typedef void (*task_fn)(void *ctx, int64_t t0, int64_t t1);
HIDDEN void pool_run(task_fn fn, void *ctx, int64_t ntasks, int64_t chunk);   /* tasks [0, ntasks) on the pool */
HIDDEN int64_t chunk_for(int64_t ntasks);
typedef int (*idle_fn)(void *ctx);             /* one short step of serial work: 1 when the work is complete */
HIDDEN void pool_idle_post(idle_fn step, void *ctx);   /* stepped by a waiting worker between jobs */
HIDDEN void pool_idle_finish(void *ctx);               /* complete it (if posted) on this thread */
HIDDEN int pool_threads(void);                 /* threads in all, the caller included */
HIDDEN const kernel_path *current_path(void);

typedef struct { Py_buffer v; int held; } buf;
HIDDEN void release(buf *b);
HIDDEN const char *fmt_name(const Py_buffer *v);
HIDDEN int fmt_is(const Py_buffer *v, char c);
HIDDEN void shape_str(const Py_buffer *v, char *s, size_t n);
/* 0 when writing `out` cannot change what `in` holds (no byte in common; or, with same_ok, `in` itself: the same
 * view); else -1 with a ValueError naming both */
HIDDEN void span_of(const Py_buffer *v, uintptr_t *lo, uintptr_t *hi);   /* the bytes its items lie in, [lo, hi) */
HIDDEN int check_apart(const char *fn, const char *out_name, const Py_buffer *out, const char *in_name,
                       const Py_buffer *in, int same_ok);

extern HIDDEN PyMethodDef layer_methods[];   /* layer.c */
extern HIDDEN PyMethodDef trace_methods[];   /* trace_stats.c */
HIDDEN int add_trace_types(PyObject *m);     /* trace_stats.c: TraceHolder */

#endif
