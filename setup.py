"""Builds the native modules from native/ with the system compiler.

`infinity._native` (native/*.cpp) holds the kernels, the I/O engine and CRC32C, and needs no torch: all
SIMD variants (AVX-512, AVX2, scalar) live in it, compiled with per-function target attributes and
chosen at run time. `infinity._host_allocator` (native/torch/) is the caching CPU allocator, the one
piece that builds against torch's c10: it must be the torch the package runs with, so it is built
only without build isolation (`make install` installs torch first); an isolated build skips it, and an
engine that needs it says how to build it.
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
extensions = [native]
try:
    from torch.utils.cpp_extension import CppExtension, library_paths
except ImportError:
    print("infinity: torch is not importable in this build; infinity._host_allocator is not built")
else:
    extensions.append(
        CppExtension(
            "infinity._host_allocator",
            ["native/torch/host_allocator.cpp"],
            extra_compile_args=["-O2", "-std=c++17"],
            extra_link_args=[f"-Wl,-rpath,{path}" for path in library_paths()],  # loads without torch imported
        )
    )

setup(ext_modules=extensions, cmdclass={"build_ext": build_ext})
