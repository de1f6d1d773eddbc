// Placeholder: the async direct-I/O engine is being written.
#include <pybind11/pybind11.h>
namespace py = pybind11;
void register_aio(py::module_& m) { (void)m; }
