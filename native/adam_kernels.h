// Adam/AdamW element kernels: one pass over p, g, m, v (and an optional bf16/fp16 copy of p).
//
// The arithmetic reproduces torch's single-tensor Adam on CPU operation by operation, including
// which products torch fuses (lerp, addcmul and add-with-alpha are FMAs in its AVX-512 kernels;
// addcdiv is not), so every path here gives the same bits as every other, and as torch's formula
// evaluated with a correctly rounded sqrt. Each ISA lives in a function with its own GCC target
// attribute, so one translation unit compiled for baseline x86-64 holds all of them.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

// GCC contracts a*b+c into an FMA by default even in ISO C++ mode; torch fuses only some of these
// products, so contraction is off here and every FMA below is written out.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

namespace infinity_adam {

enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2 };
enum class GradKind : int { f32 = 0, bf16 = 1, f16 = 2 };
enum class CopyKind : int { none = 0, bf16 = 1, f16 = 2 };

// Per-step scalars, each computed in double and rounded to float once, as torch rounds the Python
// scalars it hands its kernels.
struct StepConsts {
    float grad_scale;       // multiplies the gradient first (loss-scale unscaling, clipping)
    float decay;            // 1 - lr*wd for AdamW, exactly 1 otherwise
    float l2;               // Adam's L2 coefficient (grad += l2 * p)
    float lerp_coeff;       // torch's lerp: w if |w| < 0.5 (base m), else w - 1 (base g)
    bool lerp_from_m;
    float beta2;
    float one_minus_beta2;
    float bc2_sqrt;         // sqrt(1 - beta2^step)
    float eps;
    float neg_step_size;    // -lr / (1 - beta1^step)
};

struct Buffers {
    float* p;
    const void* g;
    float* m;
    float* v;
    void* copy;  // bf16/fp16 destination, or null
    bool stream_copy;  // non-temporal stores for the copy (its vector stores are aligned)
};

using RangeFn = void (*)(const StepConsts&, const Buffers&, int64_t, int64_t);

// ---------------------------------------------------------------- portable scalar conversions

inline uint32_t f32_bits(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
inline float bits_f32(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }

inline float bf16_to_f32(uint16_t h) { return bits_f32(uint32_t(h) << 16); }

// Round to nearest even; every NaN becomes 0xFFFF, which is what torch's .to(torch.bfloat16) gives.
inline uint16_t f32_to_bf16(float x) {
    if (std::isnan(x)) return 0xFFFF;
    uint32_t u = f32_bits(x);
    return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Matches VCVTPH2PS: signalling NaNs come back quiet, payload kept.
inline float f16_to_f32(uint16_t h) {
    uint32_t sign = uint32_t(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
    if (exp == 0x1F) return bits_f32(sign | 0x7F800000u | (mant << 13) | (mant ? 0x400000u : 0u));
    if (exp == 0) {
        float mag = float(mant) * 0x1p-24f;  // exact: subnormal halves are normal floats
        return bits_f32(sign | f32_bits(mag));
    }
    return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

// Matches VCVTPS2PH with round-to-nearest-even: NaNs quieted, payload truncated.
inline uint16_t f32_to_f16(float x) {
    uint32_t u = f32_bits(x);
    uint16_t sign = uint16_t((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return uint16_t(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
    if (a >= 0x477FF000u) return uint16_t(sign | 0x7C00u);  // >= 65520 rounds to inf
    if (a >= 0x38800000u) {                                  // normal half
        uint32_t r = a - (112u << 23) + 0xFFFu + ((a >> 13) & 1u);
        return uint16_t(sign | (r >> 13));
    }
    // Subnormal half: adding 0.5f puts the half ulp (2^-24) at the float's last place, so the
    // hardware add does the round-to-nearest-even.
    float shifted = bits_f32(a) + 0.5f;
    return uint16_t(sign | (f32_bits(shifted) - 0x3F000000u));
}

// ---------------------------------------------------------------- scalar element step

template <GradKind G>
inline float load_grad_scalar(const void* g, int64_t i) {
    if constexpr (G == GradKind::f32) return static_cast<const float*>(g)[i];
    if constexpr (G == GradKind::bf16) return bf16_to_f32(static_cast<const uint16_t*>(g)[i]);
    if constexpr (G == GradKind::f16) return f16_to_f32(static_cast<const uint16_t*>(g)[i]);
}

template <GradKind G, CopyKind C, bool L2>
inline void step_scalar_elem(const StepConsts& c, const Buffers& b, int64_t i) {
    float g = load_grad_scalar<G>(b.g, i) * c.grad_scale;
    float p = b.p[i] * c.decay;
    if constexpr (L2) g = std::fma(p, c.l2, g);
    float m = b.m[i];
    float diff = g - m;
    m = std::fma(c.lerp_coeff, diff, c.lerp_from_m ? m : g);
    float v = std::fma(c.one_minus_beta2 * g, g, b.v[i] * c.beta2);
    float denom = std::sqrt(v) / c.bc2_sqrt + c.eps;
    p = p + (c.neg_step_size * m) / denom;
    b.p[i] = p;
    b.m[i] = m;
    b.v[i] = v;
    if constexpr (C == CopyKind::bf16) static_cast<uint16_t*>(b.copy)[i] = f32_to_bf16(p);
    if constexpr (C == CopyKind::f16) static_cast<uint16_t*>(b.copy)[i] = f32_to_f16(p);
}

template <GradKind G, CopyKind C, bool L2>
void range_scalar(const StepConsts& c, const Buffers& b, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) step_scalar_elem<G, C, L2>(c, b, i);
}

// ---------------------------------------------------------------- AVX2 + FMA + F16C, 8 lanes

#define INF_AVX2 __attribute__((target("avx2,fma,f16c")))

template <GradKind G>
INF_AVX2 inline __m256 load_grad_avx2(const void* g, int64_t i) {
    if constexpr (G == GradKind::f32) return _mm256_loadu_ps(static_cast<const float*>(g) + i);
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i));
    if constexpr (G == GradKind::bf16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    else
        return _mm256_cvtph_ps(h);
}

INF_AVX2 inline __m128i f32_to_bf16_avx2(__m256 x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_or_si256(r, _mm256_and_si256(nan, _mm256_set1_epi32(0xFFFF)));
    r = _mm256_and_si256(r, _mm256_set1_epi32(0xFFFF));
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    return _mm256_castsi256_si128(packed);
}

template <GradKind G, CopyKind C, bool L2>
INF_AVX2 void range_avx2(const StepConsts& consts, const Buffers& bufs, int64_t begin, int64_t end) {
    const StepConsts c = consts;  // local copies: the stores below cannot alias them
    const Buffers b = bufs;
    const __m256 from_m = _mm256_castsi256_ps(_mm256_set1_epi32(c.lerp_from_m ? -1 : 0));
    const __m256 scale = _mm256_set1_ps(c.grad_scale), decay = _mm256_set1_ps(c.decay);
    const __m256 l2 = _mm256_set1_ps(c.l2), lerp = _mm256_set1_ps(c.lerp_coeff);
    const __m256 b2 = _mm256_set1_ps(c.beta2), omb2 = _mm256_set1_ps(c.one_minus_beta2);
    const __m256 bc2 = _mm256_set1_ps(c.bc2_sqrt), eps = _mm256_set1_ps(c.eps);
    const __m256 nss = _mm256_set1_ps(c.neg_step_size);
    int64_t i = begin;
    for (; i + 8 <= end; i += 8) {
        __m256 g = _mm256_mul_ps(load_grad_avx2<G>(b.g, i), scale);
        __m256 p = _mm256_mul_ps(_mm256_loadu_ps(b.p + i), decay);
        if constexpr (L2) g = _mm256_fmadd_ps(p, l2, g);
        __m256 m = _mm256_loadu_ps(b.m + i);
        m = _mm256_fmadd_ps(lerp, _mm256_sub_ps(g, m), _mm256_blendv_ps(g, m, from_m));
        __m256 v = _mm256_fmadd_ps(_mm256_mul_ps(omb2, g), g, _mm256_mul_ps(_mm256_loadu_ps(b.v + i), b2));
        __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2), eps);
        p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(nss, m), denom));
        _mm256_storeu_ps(b.p + i, p);
        _mm256_storeu_ps(b.m + i, m);
        _mm256_storeu_ps(b.v + i, v);
        if constexpr (C != CopyKind::none) {
            __m128i h = C == CopyKind::bf16 ? f32_to_bf16_avx2(p)
                                            : _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            auto* dst = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(b.copy) + i);
            if (b.stream_copy) _mm_stream_si128(dst, h); else _mm_storeu_si128(dst, h);
        }
    }
    for (; i < end; ++i) step_scalar_elem<G, C, L2>(c, b, i);
    if constexpr (C != CopyKind::none) if (b.stream_copy) _mm_sfence();
}

// ---------------------------------------------------------------- AVX-512 F/BW/VL, 16 lanes

#define INF_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

template <GradKind G>
INF_AVX512 inline __m512 load_grad_avx512(const void* g, int64_t i, __mmask16 k) {
    if constexpr (G == GradKind::f32) return _mm512_maskz_loadu_ps(k, static_cast<const float*>(g) + i);
    __m256i h = _mm256_maskz_loadu_epi16(k, static_cast<const uint16_t*>(g) + i);
    if constexpr (G == GradKind::bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    else
        return _mm512_cvtph_ps(h);
}

INF_AVX512 inline __m256i f32_to_bf16_avx512(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0xFFFF));
    return _mm512_cvtepi32_epi16(r);
}

// One 16-lane step; lanes outside mask k are neither read nor written.
template <GradKind G, CopyKind C, bool L2, bool Full>
INF_AVX512 inline void step16_avx512(const StepConsts& c, const Buffers& b, int64_t i, __mmask16 k) {
    __m512 g = _mm512_mul_ps(load_grad_avx512<G>(b.g, i, k), _mm512_set1_ps(c.grad_scale));
    __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, b.p + i), _mm512_set1_ps(c.decay));
    if constexpr (L2) g = _mm512_fmadd_ps(p, _mm512_set1_ps(c.l2), g);
    __m512 m = _mm512_maskz_loadu_ps(k, b.m + i);
    const __mmask16 from_m = c.lerp_from_m ? 0xFFFF : 0;
    m = _mm512_fmadd_ps(_mm512_set1_ps(c.lerp_coeff), _mm512_sub_ps(g, m), _mm512_mask_blend_ps(from_m, g, m));
    __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, b.v + i), _mm512_set1_ps(c.beta2));
    v = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(c.one_minus_beta2), g), g, v);
    __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), _mm512_set1_ps(c.bc2_sqrt)),
                                 _mm512_set1_ps(c.eps));
    p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(c.neg_step_size), m), denom));
    if constexpr (Full) {
        _mm512_storeu_ps(b.p + i, p);
        _mm512_storeu_ps(b.m + i, m);
        _mm512_storeu_ps(b.v + i, v);
    } else {
        _mm512_mask_storeu_ps(b.p + i, k, p);
        _mm512_mask_storeu_ps(b.m + i, k, m);
        _mm512_mask_storeu_ps(b.v + i, k, v);
    }
    if constexpr (C != CopyKind::none) {
        __m256i h = C == CopyKind::bf16 ? f32_to_bf16_avx512(p)
                                        : _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        uint16_t* dst = static_cast<uint16_t*>(b.copy) + i;
        if (!Full) _mm256_mask_storeu_epi16(dst, k, h);
        else if (b.stream_copy) _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), h);
        else _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), h);
    }
}

template <GradKind G, CopyKind C, bool L2>
INF_AVX512 void range_avx512(const StepConsts& consts, const Buffers& bufs, int64_t begin, int64_t end) {
    const StepConsts c = consts;  // local copies: the stores below cannot alias them
    const Buffers b = bufs;
    int64_t i = begin;
    for (; i + 16 <= end; i += 16) step16_avx512<G, C, L2, true>(c, b, i, 0xFFFF);
    if (i < end) step16_avx512<G, C, L2, false>(c, b, i, __mmask16((1u << (end - i)) - 1u));
    if constexpr (C != CopyKind::none) if (b.stream_copy) _mm_sfence();
}

// ---------------------------------------------------------------- dispatch table

template <Isa I, GradKind G, CopyKind C, bool L2>
constexpr RangeFn range_fn() {
    if constexpr (I == Isa::avx512) return &range_avx512<G, C, L2>;
    else if constexpr (I == Isa::avx2) return &range_avx2<G, C, L2>;
    else return &range_scalar<G, C, L2>;
}

template <Isa I, GradKind G, CopyKind C>
constexpr RangeFn pick_l2(bool l2) { return l2 ? range_fn<I, G, C, true>() : range_fn<I, G, C, false>(); }

template <Isa I, GradKind G>
constexpr RangeFn pick_copy(CopyKind c, bool l2) {
    switch (c) {
        case CopyKind::bf16: return pick_l2<I, G, CopyKind::bf16>(l2);
        case CopyKind::f16: return pick_l2<I, G, CopyKind::f16>(l2);
        default: return pick_l2<I, G, CopyKind::none>(l2);
    }
}

template <Isa I>
constexpr RangeFn pick_grad(GradKind g, CopyKind c, bool l2) {
    switch (g) {
        case GradKind::bf16: return pick_copy<I, GradKind::bf16>(c, l2);
        case GradKind::f16: return pick_copy<I, GradKind::f16>(c, l2);
        default: return pick_copy<I, GradKind::f32>(c, l2);
    }
}

inline RangeFn pick_range_fn(Isa isa, GradKind g, CopyKind c, bool l2) {
    switch (isa) {
        case Isa::avx512: return pick_grad<Isa::avx512>(g, c, l2);
        case Isa::avx2: return pick_grad<Isa::avx2>(g, c, l2);
        default: return pick_grad<Isa::scalar>(g, c, l2);
    }
}

}  // namespace infinity_adam

#pragma GCC pop_options
