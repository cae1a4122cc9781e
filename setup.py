"""Build of tracelm's compiled kernels (tracelm.kernels._core); everything else is in pyproject.toml.

Flags: -O2, no fast-math, no FMA contraction (the fixed float order is the kernels' contract), and never
-march=native: the AVX2 and VNNI functions carry their own target attributes and are chosen at run time by CPUID
(and a self-test against the portable path: kernels/selftest.c).
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

FLAGS = ["-O2", "-ffp-contract=off", "-fno-fast-math", "-pthread", "-std=gnu11", "-Wall"]


class BuildExt(build_ext):
    """build_ext that says plainly what is missing when the C compiler or Python headers are."""

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:  # CompileError, LinkError, missing compiler executable...
            raise SystemExit(
                "tracelm: building tracelm/kernels needs a C compiler (gcc or cc) and Python headers "
                f"(python3-dev): {type(e).__name__}: {e}"
            ) from e


setup(
    ext_modules=[
        Extension(
            "tracelm.kernels._core",
            sources=["tracelm/kernels/core.c", "tracelm/kernels/portable.c", "tracelm/kernels/avx2.c",
                     "tracelm/kernels/avxvnni.c", "tracelm/kernels/avx512vnni.c", "tracelm/kernels/amx.c",
                     "tracelm/kernels/selftest.c",
                     "tracelm/kernels/layer.c", "tracelm/kernels/layer_portable.c", "tracelm/kernels/layer_avx2.c",
                     "tracelm/kernels/layer_avx512.c",
                     "tracelm/kernels/trace_stats.c", "tracelm/kernels/sha256.c"],
            depends=["tracelm/kernels/kernels.h", "tracelm/kernels/layer_math.h", "tracelm/kernels/pyglue.h",
                     "tracelm/kernels/sha256.h"],
            extra_compile_args=FLAGS,
            extra_link_args=["-pthread"],
            libraries=["m"],
        )
    ],
    cmdclass={"build_ext": BuildExt},
)
