// Native CPU Adam/AdamW over raw buffers (fp32 weights; fp32, bf16 or 8-bit moments), plus the
// streaming kernel that bounds it.
//
// Python passes data pointers as integers and element counts; nothing here knows torch. The
// caller has validated tensors (dtype, device, contiguity, lengths, overlap); this file validates
// the scalars again, refuses an instruction set the CPU lacks, releases the GIL, and splits the
// range over OpenMP threads in contiguous static chunks (whole 8-bit blocks each).
#include <omp.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "adam_kernels.h"

namespace py = pybind11;
using namespace infinity_adam;

namespace {

// Below this many elements per thread the fork/join costs more than the work it shares.
constexpr int64_t kMinElemsPerThread = 1 << 15;
// Chunk boundaries on 64-element multiples keep every thread's vector stores whole cache lines,
// for the fp32 arrays and the 16-bit copy alike; 8-bit moments need whole blocks per thread.
constexpr int64_t kChunkAlignElems = 64;
static_assert(kQ8BlockElems % kChunkAlignElems == 0, "an 8-bit block is whole cache lines of every array");
constexpr unsigned kFtzDaz = 0x8040;  // MXCSR flush-to-zero | denormals-are-zero

Isa parse_isa(const std::string& name) {
    if (name == "avx512") return Isa::avx512;
    if (name == "avx2") return Isa::avx2;
    if (name == "scalar") return Isa::scalar;
    throw py::value_error("simd must be 'avx512', 'avx2' or 'scalar', got '" + name + "'");
}

bool cpu_supports(Isa isa) {
    __builtin_cpu_init();
    switch (isa) {
        case Isa::avx512:
            return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") &&
                   __builtin_cpu_supports("fma");
        case Isa::avx2:
            return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
        default:
            return true;
    }
}

// Last line of defence against SIGILL: the Python side chose the path from py-cpuinfo.
Isa checked_isa(const std::string& name) {
    Isa isa = parse_isa(name);
    if (!cpu_supports(isa)) throw py::value_error("simd='" + name + "' is not supported by this CPU");
    return isa;
}

template <typename Kind>
Kind parse_kind(const std::string& name, const char* arg, bool allow_none) {
    if (name == "float32" && !allow_none) return Kind(0);
    if (name == "none" && allow_none) return Kind(0);
    if (name == "bfloat16") return Kind(1);
    if (name == "float16") return Kind(2);
    throw py::value_error(std::string(arg) + ": unsupported dtype '" + name + "'");
}

MomentKind parse_moments(const std::string& name) {
    if (name == "fp32") return MomentKind::f32;
    if (name == "bf16") return MomentKind::bf16;
    if (name == "8bit") return MomentKind::q8;
    throw py::value_error("moments must be 'fp32', 'bf16' or '8bit', got '" + name + "'");
}

// Runs fn(begin, end) over [0, n) on up to `threads` OpenMP threads, each thread taking one
// contiguous chunk (the same split every call, so first-touch pages stay local). Workers adopt
// the caller's FTZ/DAZ bits, so torch.set_flush_denormal(True) reaches them too.
template <typename Fn>
void parallel_chunks(int64_t n, int threads, Fn fn, int64_t align = kChunkAlignElems) {
    int64_t useful = std::max<int64_t>(1, n / kMinElemsPerThread);
    int nt = int(std::min<int64_t>(threads, useful));
    if (nt <= 1) {
        fn(int64_t(0), n);
        return;
    }
    const unsigned caller_csr = _mm_getcsr();
#pragma omp parallel num_threads(nt)
    {
        const int64_t team = omp_get_num_threads(), t = omp_get_thread_num();
        int64_t chunk = (n + team - 1) / team;
        chunk = (chunk + align - 1) / align * align;
        const int64_t begin = std::min(n, t * chunk), end = std::min(n, begin + chunk);
        const unsigned own_csr = _mm_getcsr();
        _mm_setcsr((own_csr & ~kFtzDaz) | (caller_csr & kFtzDaz));
        if (begin < end) fn(begin, end);
        _mm_setcsr(own_csr);
    }
}

void require(bool ok, const std::string& message) {
    if (!ok) throw py::value_error(message);
}

// Validates the hyper-parameters and rounds them as torch does: Python doubles -> float.
StepConsts make_consts(int64_t step, double lr, double beta1, double beta2, double eps, double wd,
                       bool adamw, double grad_scale) {
    require(step >= 1, "step must be >= 1, got " + std::to_string(step));
    require(std::isfinite(lr) && lr >= 0.0, "lr must be finite and >= 0, got " + std::to_string(lr));
    require(beta1 >= 0.0 && beta1 < 1.0, "beta1 must be in [0, 1), got " + std::to_string(beta1));
    require(beta2 >= 0.0 && beta2 < 1.0, "beta2 must be in [0, 1), got " + std::to_string(beta2));
    require(std::isfinite(eps) && eps > 0.0, "eps must be finite and > 0, got " + std::to_string(eps));
    require(std::isfinite(wd) && wd >= 0.0, "weight_decay must be finite and >= 0, got " + std::to_string(wd));
    require(std::isfinite(grad_scale) && grad_scale > 0.0,
            "grad_scale must be finite and > 0, got " + std::to_string(grad_scale));
    StepConsts c{};
    c.grad_scale = float(grad_scale);
    c.decay = (adamw && wd != 0.0) ? float(1.0 - lr * wd) : 1.0f;
    c.l2 = adamw ? 0.0f : float(wd);
    const float w = float(1.0 - beta1);
    c.lerp_from_m = std::fabs(w) < 0.5f;
    c.lerp_coeff = c.lerp_from_m ? w : w - 1.0f;
    c.beta2 = float(beta2);
    c.one_minus_beta2 = float(1.0 - beta2);
    const double steps = double(step);
    c.bc2_sqrt = float(std::sqrt(1.0 - std::pow(beta2, steps)));
    c.eps = float(eps);
    c.neg_step_size = float(-(lr / (1.0 - std::pow(beta1, steps))));
    c.step_mix = mix32(uint32_t(uint64_t(step)));
    return c;
}

void adam_step(uintptr_t p, uintptr_t g, uintptr_t m, uintptr_t v, uintptr_t copy, int64_t n,
               const std::string& grad_dtype, const std::string& copy_dtype, int64_t step, double lr,
               double beta1, double beta2, double eps, double weight_decay, bool adamw_mode,
               double grad_scale, const std::string& simd, int num_threads, const std::string& moments,
               uintptr_t m_scale, uintptr_t v_scale) {
    require(n >= 0, "n must be >= 0");
    require(num_threads >= 1, "num_threads must be >= 1, got " + std::to_string(num_threads));
    const Isa isa = checked_isa(simd);
    const auto gk = parse_kind<GradKind>(grad_dtype, "grad", false);
    const auto ck = parse_kind<CopyKind>(copy_dtype, "out_copy", true);
    const MomentKind mk = parse_moments(moments);
    const StepConsts c = make_consts(step, lr, beta1, beta2, eps, weight_decay, adamw_mode, grad_scale);
    if (n == 0) return;
    require(p && g && m && v, "null data pointer");
    require(ck == CopyKind::none || copy, "out_copy: null data pointer");
    require(mk != MomentKind::q8 || (m_scale && v_scale), "moments='8bit' needs both scale pointers");
    Buffers b{reinterpret_cast<float*>(p), reinterpret_cast<const void*>(g), reinterpret_cast<void*>(m),
              reinterpret_cast<void*>(v), reinterpret_cast<float*>(m_scale), reinterpret_cast<float*>(v_scale),
              reinterpret_cast<void*>(copy), false};
    // Non-temporal stores only for the write-only copy, and only where every full-vector store
    // is aligned (chunk starts are 64-element multiples).
    b.stream_copy = ck != CopyKind::none && isa != Isa::scalar && copy % 32 == 0;
    const RangeFn fn = pick_range_fn(isa, gk, ck, !adamw_mode && weight_decay != 0.0, mk);
    const int64_t align = mk == MomentKind::q8 ? kQ8BlockElems : kChunkAlignElems;
    py::gil_scoped_release release;
    parallel_chunks(n, num_threads, [&](int64_t begin, int64_t end) { fn(c, b, begin, end); }, align);
}

// ---------------------------------------------------------------- bandwidth reference

INF_AVX512 void stream_rw_avx512(float* p, const float* g, float* m, float* v, int64_t b, int64_t e) {
    int64_t i = b;
    for (; i + 16 <= e; i += 16) {
        __m512 gg = _mm512_loadu_ps(g + i);
        _mm512_storeu_ps(p + i, _mm512_add_ps(_mm512_loadu_ps(p + i), gg));
        _mm512_storeu_ps(m + i, _mm512_add_ps(_mm512_loadu_ps(m + i), gg));
        _mm512_storeu_ps(v + i, _mm512_add_ps(_mm512_loadu_ps(v + i), gg));
    }
    for (; i < e; ++i) p[i] += g[i], m[i] += g[i], v[i] += g[i];
}

INF_AVX2 void stream_rw_avx2(float* p, const float* g, float* m, float* v, int64_t b, int64_t e) {
    int64_t i = b;
    for (; i + 8 <= e; i += 8) {
        __m256 gg = _mm256_loadu_ps(g + i);
        _mm256_storeu_ps(p + i, _mm256_add_ps(_mm256_loadu_ps(p + i), gg));
        _mm256_storeu_ps(m + i, _mm256_add_ps(_mm256_loadu_ps(m + i), gg));
        _mm256_storeu_ps(v + i, _mm256_add_ps(_mm256_loadu_ps(v + i), gg));
    }
    for (; i < e; ++i) p[i] += g[i], m[i] += g[i], v[i] += g[i];
}

void stream_rw_scalar(float* p, const float* g, float* m, float* v, int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) p[i] += g[i], m[i] += g[i], v[i] += g[i];
}

// Adam's memory traffic with trivial arithmetic: reads p, g, m, v and writes p, m, v in place.
void stream_rw_kernel(uintptr_t p, uintptr_t g, uintptr_t m, uintptr_t v, int64_t n,
                      const std::string& simd, int num_threads) {
    require(n >= 0, "n must be >= 0");
    require(num_threads >= 1, "num_threads must be >= 1");
    const Isa isa = checked_isa(simd);
    if (n == 0) return;
    require(p && g && m && v, "null data pointer");
    auto fn = isa == Isa::avx512 ? stream_rw_avx512 : isa == Isa::avx2 ? stream_rw_avx2 : stream_rw_scalar;
    auto* pp = reinterpret_cast<float*>(p);
    auto* gp = reinterpret_cast<const float*>(g);
    auto* mp = reinterpret_cast<float*>(m);
    auto* vp = reinterpret_cast<float*>(v);
    py::gil_scoped_release release;
    parallel_chunks(n, num_threads, [&](int64_t b, int64_t e) { fn(pp, gp, mp, vp, b, e); });
}

}  // namespace

void register_adam(py::module_& m) {
    auto sub = m.def_submodule("adam", "SIMD Adam/AdamW over raw buffers (pointers as integers)");
    sub.def("step", &adam_step,
            "One Adam/AdamW step over n elements in place: p fp32; g float32|bfloat16|float16; m, v in "
            "the moments format (fp32|bf16|8bit, see infinity/shards/moments.py; 8bit also updates the "
            "per-block scales m_scale, v_scale); copy receives p as bfloat16|float16 unless copy_dtype is 'none'.",
            py::arg("p"), py::arg("g"), py::arg("m"), py::arg("v"), py::arg("copy"), py::arg("n"),
            py::arg("grad_dtype"), py::arg("copy_dtype"), py::arg("step"), py::arg("lr"), py::arg("beta1"),
            py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("adamw_mode"),
            py::arg("grad_scale"), py::arg("simd"), py::arg("num_threads"), py::arg("moments") = "fp32",
            py::arg("m_scale") = 0, py::arg("v_scale") = 0);
    sub.def("stream_rw_kernel", &stream_rw_kernel,
            "Bandwidth reference with Adam's access pattern: p += g, m += g, v += g (28 bytes/element).",
            py::arg("p"), py::arg("g"), py::arg("m"), py::arg("v"), py::arg("n"), py::arg("simd"),
            py::arg("num_threads"));
    sub.def("cpu_supports", [](const std::string& simd) { return cpu_supports(parse_isa(simd)); },
            "Whether this CPU can run the given path (compiler's cpuid check).", py::arg("simd"));
}
