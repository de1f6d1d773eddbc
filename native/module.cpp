// The one native module: each component registers its functions in its own submodule.
#include <pybind11/pybind11.h>

namespace py = pybind11;

void register_adam(py::module_& m);
void register_aio(py::module_& m);
void register_checksum(py::module_& m);
void register_exit_cleanup(py::module_& m);
void register_norm(py::module_& m);

PYBIND11_MODULE(_native, m) {
    m.doc() = "infinity native kernels: SIMD CPU Adam, gradient norms, the async direct-I/O engine and CRC32C";
    register_adam(m);
    register_aio(m);
    register_checksum(m);
    register_exit_cleanup(m);
    register_norm(m);
}
