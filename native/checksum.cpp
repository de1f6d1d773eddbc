// CRC32C of host memory for Python: the same kernels the I/O engine checksums its chunks with.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "crc32c.h"

namespace py = pybind11;
using infinity_crc::Path;

namespace {

Path parse_path(const std::string& name) {
    if (name == "avx512") return Path::vpclmul;
    if (name == "sse4.2") return Path::sse42;
    if (name == "table") return Path::table;
    throw py::value_error("crc32c path must be 'avx512', 'sse4.2' or 'table', got '" + name + "'");
}

Path checked_path(const std::string& name) {
    Path path = parse_path(name);
    if (!infinity_crc::supported(path)) throw py::value_error("crc32c path '" + name + "' is not supported by this CPU");
    return path;
}

}  // namespace

void register_checksum(py::module_& m) {
    auto sub = m.def_submodule("checksum", "CRC32C (Castagnoli): VPCLMULQDQ folding, the SSE4.2 instruction or a table");
    sub.def(
        "crc32c",
        [](uintptr_t address, int64_t nbytes, uint32_t crc, const std::string& path) {
            if (nbytes < 0) throw py::value_error("nbytes must be >= 0");
            Path p = checked_path(path);
            py::gil_scoped_release nogil;
            return infinity_crc::crc32c(p, crc, reinterpret_cast<const void*>(address), static_cast<size_t>(nbytes));
        },
        py::arg("address"), py::arg("nbytes"), py::arg("crc") = 0u, py::arg("path") = "sse4.2",
        "CRC32C of nbytes at address, continuing crc (0 to start). GIL released.");
    sub.def("combine", &infinity_crc::combine, py::arg("crc_a"), py::arg("crc_b"), py::arg("len_b"),
            "CRC32C of A || B from crc32c(A), crc32c(B) and len(B).");
    sub.def("supported", [](const std::string& path) { return infinity_crc::supported(parse_path(path)); },
            py::arg("path"), "Whether this CPU runs the given path ('avx512', 'sse4.2' or 'table').");
    sub.def("path_code", [](const std::string& path) { return static_cast<int>(checked_path(path)); },
            py::arg("path"), "The engine's code for a path (its crc_path argument).");
}
