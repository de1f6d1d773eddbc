"""Builds the native module `infinity._native` from native/*.cpp with the system compiler.

All SIMD variants (AVX-512, AVX2, scalar) live in the one module: the wide paths are compiled
with per-function target attributes, and the path is chosen at run time.
"""

import glob

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

native = Pybind11Extension(
    "infinity._native",
    sorted(glob.glob("native/*.cpp")),
    include_dirs=["native"],
    cxx_std=17,
    extra_compile_args=["-O3", "-fopenmp", "-fno-math-errno"],
    extra_link_args=["-fopenmp"],
)

setup(ext_modules=[native], cmdclass={"build_ext": build_ext})
