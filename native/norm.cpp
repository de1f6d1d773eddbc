// Sum of squares of a host buffer (fp32, bf16 or fp16): the gradient norm that clipping and the fp16
// overflow check need, in one read at memory bandwidth.
//
// Each lane sums a block's squares in fp32 and each block's total is added in double, so the error
// does not grow with the buffer's length. Threads take fixed contiguous chunks and their partial sums
// are added in thread order: the same input and thread count give the same bits. inf and nan
// propagate (an overflowed gradient must be seen).
#include <omp.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "adam_scalar.h"  // Isa, GradKind, bits_f32, f16_to_f32

namespace py = pybind11;
using namespace infinity_adam;

namespace {

// Own target attributes, outside adam_*.h's optimize pragma: GCC does not inline across different
// optimize options, and a call per vector halves the read rate.
#define NORM_AVX2 __attribute__((target("avx2,fma,f16c")))
#define NORM_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

constexpr int64_t kBlockElems = 2048;          // squares summed in fp32 before joining the double total
constexpr int kLanes = 8;                      // vector accumulators per block
constexpr int64_t kMinElemsPerThread = 1 << 16;  // below this the fork/join costs more than the read

template <GradKind G>
NORM_AVX2 inline __m256 load8(const void* x, int64_t i) {
    if constexpr (G == GradKind::f32) return _mm256_loadu_ps(static_cast<const float*>(x) + i);
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(x) + i));
    if constexpr (G == GradKind::bf16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    else return _mm256_cvtph_ps(h);
}

template <GradKind G>
NORM_AVX512 inline __m512 load16(const void* x, int64_t i) {
    if constexpr (G == GradKind::f32) return _mm512_loadu_ps(static_cast<const float*>(x) + i);
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(x) + i));
    if constexpr (G == GradKind::bf16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    else return _mm512_cvtph_ps(h);
}

template <GradKind G>
inline float load1(const void* x, int64_t i) {
    if constexpr (G == GradKind::f32) return static_cast<const float*>(x)[i];
    if constexpr (G == GradKind::bf16) return bits_f32(uint32_t(static_cast<const uint16_t*>(x)[i]) << 16);
    return f16_to_f32(static_cast<const uint16_t*>(x)[i]);
}

template <GradKind G>
double sum_squares_scalar(const void* x, int64_t begin, int64_t end) {
    double total = 0.0;
    for (int64_t b = begin; b < end; b += kBlockElems) {
        const int64_t e = std::min(end, b + kBlockElems);
        float block = 0.0f;
        for (int64_t i = b; i < e; ++i) {
            const float v = load1<G>(x, i);
            block += v * v;
        }
        total += block;
    }
    return total;
}

template <GradKind G>
NORM_AVX2 double sum_squares_avx2(const void* x, int64_t begin, int64_t end) {
    double total = 0.0;
    int64_t b = begin;
    for (; b + kBlockElems <= end; b += kBlockElems) {
        __m256 acc[kLanes];
        for (auto& a : acc) a = _mm256_setzero_ps();
        for (int64_t i = b; i < b + kBlockElems; i += 8 * kLanes)
            for (int k = 0; k < kLanes; ++k) {
                const __m256 v = load8<G>(x, i + 8 * k);
                acc[k] = _mm256_fmadd_ps(v, v, acc[k]);
            }
        for (int k = 1; k < kLanes; ++k) acc[0] = _mm256_add_ps(acc[0], acc[k]);
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, acc[0]);
        float block = 0.0f;
        for (float lane : lanes) block += lane;
        total += block;
    }
    return total + sum_squares_scalar<G>(x, b, end);
}

template <GradKind G>
NORM_AVX512 double sum_squares_avx512(const void* x, int64_t begin, int64_t end) {
    double total = 0.0;
    int64_t b = begin;
    for (; b + kBlockElems <= end; b += kBlockElems) {
        __m512 acc[kLanes];  // enough independent sums to keep both FMA ports busy
        for (auto& a : acc) a = _mm512_setzero_ps();
        for (int64_t i = b; i < b + kBlockElems; i += 16 * kLanes)
            for (int k = 0; k < kLanes; ++k) {
                const __m512 v = load16<G>(x, i + 16 * k);
                acc[k] = _mm512_fmadd_ps(v, v, acc[k]);
            }
        for (int k = 1; k < kLanes; ++k) acc[0] = _mm512_add_ps(acc[0], acc[k]);
        total += _mm512_reduce_add_ps(acc[0]);
    }
    return total + sum_squares_scalar<G>(x, b, end);
}

using SumFn = double (*)(const void*, int64_t, int64_t);

template <GradKind G>
SumFn pick_isa(Isa isa) {
    if (isa == Isa::avx512) return &sum_squares_avx512<G>;
    if (isa == Isa::avx2) return &sum_squares_avx2<G>;
    return &sum_squares_scalar<G>;
}

Isa parse_checked_isa(const std::string& name) {
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl");
    if (name == "auto") return avx512 ? Isa::avx512 : avx2 ? Isa::avx2 : Isa::scalar;
    if (name == "scalar") return Isa::scalar;
    if (name == "avx2" || name == "avx512") {
        if (!(name == "avx2" ? avx2 : avx512)) throw py::value_error("simd='" + name + "' is not supported by this CPU");
        return name == "avx2" ? Isa::avx2 : Isa::avx512;
    }
    throw py::value_error("simd must be 'auto', 'avx512', 'avx2' or 'scalar', got '" + name + "'");
}

double sum_squares(uintptr_t address, int64_t n, const std::string& dtype, const std::string& simd,
                   int num_threads) {
    if (n < 0) throw py::value_error("n must be >= 0");
    if (num_threads < 1) throw py::value_error("num_threads must be >= 1, got " + std::to_string(num_threads));
    const Isa isa = parse_checked_isa(simd);
    SumFn fn;
    if (dtype == "float32") fn = pick_isa<GradKind::f32>(isa);
    else if (dtype == "bfloat16") fn = pick_isa<GradKind::bf16>(isa);
    else if (dtype == "float16") fn = pick_isa<GradKind::f16>(isa);
    else throw py::value_error("dtype must be 'float32', 'bfloat16' or 'float16', got '" + dtype + "'");
    if (n == 0) return 0.0;
    if (!address) throw py::value_error("null data pointer");
    const void* x = reinterpret_cast<const void*>(address);
    const int nt = int(std::min<int64_t>(num_threads, std::max<int64_t>(1, n / kMinElemsPerThread)));
    py::gil_scoped_release release;
    if (nt == 1) return fn(x, 0, n);
    std::vector<double> partial(nt, 0.0);
    int64_t chunk = (n + nt - 1) / nt;
    chunk = (chunk + kBlockElems - 1) / kBlockElems * kBlockElems;
#pragma omp parallel for num_threads(nt) schedule(static, 1)
    for (int t = 0; t < nt; ++t) {
        const int64_t begin = std::min(n, t * chunk), end = std::min(n, begin + chunk);
        partial[t] = begin < end ? fn(x, begin, end) : 0.0;
    }
    double total = 0.0;
    for (double p : partial) total += p;
    return total;
}

}  // namespace

void register_norm(py::module_& m) {
    auto sub = m.def_submodule("norm", "Sums of squares of host buffers (gradient norms)");
    sub.def("sum_squares", &sum_squares,
            "Sum of the squares of n float32|bfloat16|float16 elements at address (fp32 within 2048-element "
            "blocks, double across them); simd 'auto' picks the widest path the CPU has. GIL released.",
            py::arg("address"), py::arg("n"), py::arg("dtype"), py::arg("simd") = "auto", py::arg("num_threads") = 1);
}
