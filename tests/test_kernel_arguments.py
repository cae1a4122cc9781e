"""Issue 29, item 7: the kernels' C entry points check their arguments against the buffers themselves and raise a
Python error: attend with 0 heads (a division by zero: SIGFPE), an out that shares memory with an input (garbage,
silently), the packing check reading a `shape` attribute that may lie about the buffer (reads past it), pack out of
memory (abort). A crash is checked in a child process."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from tests.test_kernels import weights
from tracelm import kernels

c = kernels._core
pytestmark = pytest.mark.usefixtures("kernels_restored")


def in_child(code: str) -> subprocess.CompletedProcess:
    src = "import numpy as np\nfrom tracelm import kernels\nc = kernels._core\n" + code
    return subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("call", [
    "c.attend(q, k, k, spans, 1.0, np.zeros((1, 0), np.float32))",
    "c.attend_parts([(q, k, k, spans, np.zeros((1, 0), np.float32))], 1.0)",
])
def test_attend_with_no_heads_is_a_value_error_not_sigfpe(call):
    r = in_child("q = np.zeros((1, 0, 8), np.float32); k = np.zeros((1, 4, 8), np.float32)\n"
                 "spans = np.array([[0, 4]], np.int64)\n"
                 f"try:\n    {call}\nexcept ValueError as e:\n    print(e)\n")
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "q must be [T, H, hd] with H >= 1 heads of hd >= 1 dims, got shape [1, 0, 8]" in r.stdout


def test_an_out_that_shares_memory_with_an_input_is_refused():
    x = np.ones((4, 64), np.float32)
    w = weights(Q.Q8_0, 64, 64)
    scratch = np.empty(kernels.scratch_bytes(4, 64, Q.Q8_0), np.uint8)
    buf = np.zeros((4, 128), np.float32)
    refused = [
        (lambda: c.matmul(x, w, Q.Q8_0, x, scratch), "matmul: out shares memory with x"),
        (lambda: c.matmul(buf.reshape(-1)[:256].reshape(4, 64), w, Q.Q8_0, buf[:, 64:], scratch),
         "matmul: out shares memory with x"),
        (lambda: c.matmul(x, w, Q.Q8_0, w.view(np.float32)[:4, :64], scratch), "out shares memory with w"),
        (lambda: c.matmul(x, w, Q.Q8_0, np.zeros((4, 64), np.float32), x.view(np.uint8).reshape(-1)),
         "scratch shares memory with x"),
        (lambda: c.dequantize(w[:2], Q.Q8_0, w.view(np.float32)[:2, :64]), "out shares memory with w"),
        (lambda: c.pack(w[:8], Q.Q8_0, w[1:9]), "out shares memory with w: it may be w itself"),
        (lambda: c.exp(x.ravel()[1:], x.ravel()[:-1]), "out shares memory with x: it may be x itself"),
        (lambda: c.rms_norm(x, x[0], 1e-5, x), "out shares memory with w"),
        (lambda: c.silu_mul(buf, 32, buf[:, :32]), "out shares memory with gate_up"),
        (lambda: c.q8_0_blocks(x, x.view(np.uint8)[:, :68]), "out shares memory with x"),
    ]
    q = np.ones((2, 4, 8), np.float32)
    kv = np.ones((2, 6, 8), np.float32)
    spans = np.array([[0, 6], [0, 6]], np.int64)
    refused += [
        (lambda: c.attend(q, kv, kv, spans, 1.0, q.reshape(2, 32)), "attend: out shares memory with q"),
        (lambda: c.attend(q, kv, kv, spans, 1.0, kv.reshape(-1)[:64].reshape(2, 32)), "out shares memory with keys"),
        (lambda: c.attend_parts([(q, kv, kv, spans, np.zeros((2, 32), np.float32), q[:, :2], q[:, 2:])], 1.0),
         r"attend_parts: parts\[0\] keys shares memory with parts\[0\] values"),  # both written: the new keys
        (lambda: c.attend_parts([(q, kv, kv.copy(), spans, buf[:2, :32]), (q, kv, kv.copy(), spans, buf[:2, 16:48])],
                                1.0), "parts\\[0\\] out shares memory with parts\\[1\\] out"),
    ]
    for call, message in refused:
        with pytest.raises(ValueError, match=message):
            call()
    # views that do not touch, and the in-place calls the graph makes, still run
    buf[:, :64] = np.arange(256, dtype=np.float32).reshape(4, 64) / 256
    c.silu_mul(buf[:, :64], 32, buf[:, 64:96])  # columns of one array, interleaved row by row
    assert np.array_equal(buf[:, 64:96], kernels.silu_mul(buf[:, :64].copy(), 32))
    kernels.exp(x.ravel(), out=x.ravel())
    kernels.rms_norm(x, np.ones(64, np.float32), 1e-5, out=x)
    kernels.pack(w, Q.Q8_0, out=w)


class Lying(np.ndarray):
    """An array whose `shape` attribute says 8 rows whatever its buffer holds."""

    @property
    def shape(self):
        return (8, super().shape[1])


def test_the_packing_check_reads_the_buffers_own_shape():
    w9 = weights(Q.Q8_0, 9, 64).view(Lying)
    assert w9.shape == (8, 68)  # what the old check believed: a whole group
    scratch = np.empty(kernels.scratch_bytes(1, 64, Q.Q8_0), np.uint8)
    for call in (lambda: c.matmul(np.ones((1, 64), np.float32), w9, Q.Q8_0, np.zeros((1, 9), np.float32), scratch, 2,
                                  True),  # would read 7 rows past the buffer
                 lambda: c.pack(w9, Q.Q8_0, np.zeros((9, 68), np.uint8)),
                 lambda: c.unpack_rows(w9, Q.Q8_0, np.array([8]), np.zeros((1, 68), np.uint8))):
        with pytest.raises(ValueError, match="groups of 8 rows, got 9 rows"):
            call()


def test_pack_out_of_memory_is_a_memory_error_not_abort():
    """Under an address-space limit just above what the arrays take, pack's group buffer cannot be had."""
    r = in_child("import resource\n"
                 "rb = 34 * 1_000_000\n"
                 "w = np.zeros((8, rb), np.uint8); w[:] = 0\n"
                 "size = int(next(x for x in open('/proc/self/status') if x.startswith('VmSize')).split()[1]) << 10\n"
                 "resource.setrlimit(resource.RLIMIT_AS, (size + (48 << 20), resource.RLIM_INFINITY))\n"
                 "try:\n    c.pack(w, 8, w)\nexcept MemoryError as e:\n    print('MemoryError:', e)\n")
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "MemoryError: pack: no memory for a group of 8 rows" in r.stdout


def test_scratch_bytes_and_n_ff_too_large_are_refused():
    with pytest.raises(ValueError, match="need more bytes than fit in 64 bits"):
        kernels.scratch_bytes(1 << 62, 1 << 20, Q.Q8_0)
    with pytest.raises(ValueError, match=r"gate_up must be \[T, 2 \* n_ff\]"):
        c.silu_mul(np.zeros((1, 2), np.float32), 1 << 62, np.zeros((1, 1), np.float32))
