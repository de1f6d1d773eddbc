// Adam/AdamW kernels, the shared part: types, scalar conversions, the 8-bit moment codec, and the
// portable scalar path that the vector paths also use for their tails.
//
// The arithmetic reproduces torch's single-tensor Adam on CPU operation by operation, including
// which products torch fuses (lerp, addcmul and add-with-alpha are FMAs in its AVX-512 kernels;
// addcdiv is not), so every path gives the same bits as every other, and as torch's formula
// evaluated with a correctly rounded sqrt. The moment formats are specified in
// infinity/shards/moments.py; their codecs here are integer arithmetic on float bits plus IEEE
// multiplies and divides, so they too are bit-identical on every path.
#pragma once

#include <immintrin.h>

#include <algorithm>
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
enum class MomentKind : int { f32 = 0, bf16 = 1, q8 = 2 };

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
    uint32_t step_mix;      // mix32(low 32 bits of step): keys the stochastic rounding (bf16, 8bit)
};

struct Buffers {
    float* p;
    const void* g;
    void* m;         // float, bfloat16 or 8-bit codes, as the MomentKind says
    void* v;
    float* m_scale;  // 8-bit only: one scale per kQ8BlockElems elements
    float* v_scale;
    void* copy;      // bf16/fp16 destination, or null
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

// ---------------------------------------------------------------- the 8-bit moment codec

constexpr int64_t kQ8BlockElems = 256;
constexpr uint32_t kSmallestNormalBits = 0x00800000u;  // magnitudes below are stored as zero
constexpr uint32_t kInfBits = 0x7F800000u;
constexpr uint32_t kQuietNanBits = 0x7FC00000u;
constexpr uint32_t kSubnormalBase = 1040u;  // bits(8.0f) >> 20: where y * 2^k + 8 puts code 0

// lowbias32 (C. Wellons): a cheap 32-bit mixer with good avalanche, the rounding's random source.
inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    x ^= x >> 16;
    return x;
}

// The key of the block starting at element `first`: r(i) = mix32(lo32(i) ^ key). Blocks never
// straddle a multiple of 2^32 elements, so one key serves a whole block.
inline uint32_t q8_block_key(const StepConsts& c, int64_t first) {
    return mix32(uint32_t(uint64_t(first) >> 32) ^ c.step_mix);
}

// The 32 random bits of element i at this step: the stochastic rounding of both compressed formats
// (8bit codes and bf16 moments) reads them; exp_avg takes the high half, exp_avg_sq the low.
inline uint32_t element_random_bits(const StepConsts& c, int64_t i) {
    return mix32(uint32_t(i) ^ q8_block_key(c, i));
}

// The end of the run of [begin, end) that shares begin's upper 32 index bits (one key).
inline int64_t segment_end(int64_t begin, int64_t end) {
    return std::min(end, int64_t(((uint64_t(begin) >> 32) + 1) << 32));
}

// Rounds x to bf16 stochastically: away from zero with probability (its 16 dropped bits) / 2^16,
// resolved by the 16 random bits r16; exact values stay exact. NaN becomes 0xFFFF, as in f32_to_bf16.
inline uint16_t f32_to_bf16_stochastic(float x, uint32_t r16) {
    if (std::isnan(x)) return 0xFFFF;
    return uint16_t((f32_bits(x) + r16) >> 16);
}

// exp_avg codes are sign + E4M3 (bias 15), exp_avg_sq codes E5M3 (bias 31); the top binade is [1, 2).
template <bool Signed>
struct Q8Map {
    static constexpr int kBias = Signed ? 15 : 31;
    static constexpr uint32_t kMagMask = Signed ? 0x7Fu : 0xFFu;
    static constexpr uint32_t kMinNormalBits = uint32_t(127 + 1 - kBias) << 23;  // smallest normal point
    static constexpr uint32_t kNormalOffset = uint32_t(127 - kBias) << 3;        // (bits >> 20) - code
    static constexpr float kSubnormalStep = Signed ? 0x1p-17f : 0x1p-33f;       // 2^(-2 - bias)
    static constexpr float kInvSubnormalStep = Signed ? 0x1p17f : 0x1p33f;
};

// The value of a code before scaling (exact).
template <bool Signed>
inline float q8_point(uint32_t code) {
    using M = Q8Map<Signed>;
    const uint32_t mag = code & M::kMagMask;
    const float a = mag >= 8 ? bits_f32((mag << 20) + (M::kNormalOffset << 20)) : float(mag) * M::kSubnormalStep;
    return Signed && (code & 0x80u) ? -a : a;
}

// Rounds y in [0, 1] to a magnitude code, up with probability (distance to the lower point / gap),
// the probability resolved by the 16 random bits r16. Normal points are 2^20 fp32 units apart; below
// the smallest normal point, y * 2^k + 8 puts the evenly spaced points at the same bit position.
template <bool Signed>
inline uint32_t q8_round(float y, uint32_t r16) {
    using M = Q8Map<Signed>;
    const uint32_t u = f32_bits(y), dither = r16 << 4;
    if (u >= M::kMinNormalBits) return ((u + dither) >> 20) - M::kNormalOffset;
    const float shifted = y * M::kInvSubnormalStep + 8.0f;
    return ((f32_bits(shifted) + dither) >> 20) - kSubnormalBase;
}

// |x| as bits, zero for magnitudes below the smallest normal float.
inline uint32_t q8_magnitude_bits(float x) {
    const uint32_t a = f32_bits(x) & 0x7FFFFFFFu;
    return a < kSmallestNormalBits ? 0u : a;
}

// Stores a block's new scale from its absmax bits. Returns whether codes must be computed from it;
// if not (a zero block: scale 0; a NaN or infinity in it: scale NaN) its codes are already zeroed.
inline bool q8_store_scale(uint32_t absmax_bits, float* scale_slot, uint8_t* codes, int64_t len) {
    if (absmax_bits != 0 && absmax_bits < kInfBits) {
        *scale_slot = bits_f32(absmax_bits);
        return true;
    }
    *scale_slot = absmax_bits ? bits_f32(kQuietNanBits) : 0.0f;
    std::memset(codes, 0, size_t(len));
    return false;
}

// Codes for x[j] (element first + j), j in [from, len), against a finite positive scale.
template <bool Signed>
inline void q8_encode_scalar(const float* x, uint8_t* codes, int64_t first, int64_t from, int64_t len,
                             float scale, uint32_t key) {
    for (int64_t j = from; j < len; ++j) {
        const uint32_t a = q8_magnitude_bits(x[j]);
        const uint32_t r = mix32(uint32_t(first + j) ^ key);
        uint32_t code = q8_round<Signed>(bits_f32(a) / scale, Signed ? r >> 16 : r & 0xFFFFu);
        if constexpr (Signed) {
            if (a) code |= (f32_bits(x[j]) >> 24) & 0x80u;
        } else if (a && code == 0) {
            code = 1;  // a positive exp_avg_sq never decodes to 0: the step would be exp_avg / eps
        }
        codes[j] = uint8_t(code);
    }
}

// ---------------------------------------------------------------- scalar element step

template <GradKind G>
inline float load_grad_scalar(const void* g, int64_t i) {
    if constexpr (G == GradKind::f32) return static_cast<const float*>(g)[i];
    if constexpr (G == GradKind::bf16) return bf16_to_f32(static_cast<const uint16_t*>(g)[i]);
    if constexpr (G == GradKind::f16) return f16_to_f32(static_cast<const uint16_t*>(g)[i]);
}

template <MomentKind M>
inline float load_moment_scalar(const void* base, int64_t i) {
    if constexpr (M == MomentKind::f32) return static_cast<const float*>(base)[i];
    else return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
}

// bf16 moments round stochastically (r16: the element's random bits for this moment).
template <MomentKind M>
inline void store_moment_scalar(void* base, int64_t i, float x, uint32_t r16) {
    if constexpr (M == MomentKind::f32) static_cast<float*>(base)[i] = x;
    else static_cast<uint16_t*>(base)[i] = f32_to_bf16_stochastic(x, r16);
}

template <CopyKind C>
inline void store_copy_scalar(void* copy, int64_t i, float p) {
    if constexpr (C == CopyKind::bf16) static_cast<uint16_t*>(copy)[i] = f32_to_bf16(p);
    if constexpr (C == CopyKind::f16) static_cast<uint16_t*>(copy)[i] = f32_to_f16(p);
}

// torch's Adam on one element: returns the new p; m and v (float values) are updated in place.
template <GradKind G, bool L2>
inline float adam_elem(const StepConsts& c, const void* grad, float p_old, int64_t i, float& m, float& v) {
    float g = load_grad_scalar<G>(grad, i) * c.grad_scale;
    float p = p_old * c.decay;
    if constexpr (L2) g = std::fma(p, c.l2, g);
    float diff = g - m;
    m = std::fma(c.lerp_coeff, diff, c.lerp_from_m ? m : g);
    v = std::fma(c.one_minus_beta2 * g, g, v * c.beta2);
    float denom = std::sqrt(v) / c.bc2_sqrt + c.eps;
    return p + (c.neg_step_size * m) / denom;
}

// One element with fp32 or bf16 moments.
template <GradKind G, CopyKind C, bool L2, MomentKind M>
inline void step_scalar_elem(const StepConsts& c, const Buffers& b, int64_t i) {
    float m = load_moment_scalar<M>(b.m, i), v = load_moment_scalar<M>(b.v, i);
    const float p = adam_elem<G, L2>(c, b.g, b.p[i], i, m, v);
    b.p[i] = p;
    const uint32_t r = M == MomentKind::bf16 ? element_random_bits(c, i) : 0u;
    store_moment_scalar<M>(b.m, i, m, r >> 16);
    store_moment_scalar<M>(b.v, i, v, r & 0xFFFFu);
    store_copy_scalar<C>(b.copy, i, p);
}

// One element with 8-bit moments: decoded with the block's old scales, new values left in m_new, v_new.
template <GradKind G, CopyKind C, bool L2>
inline void step_q8_scalar_elem(const StepConsts& c, const Buffers& b, int64_t i, float m_scale, float v_scale,
                                float& m_new, float& v_new) {
    float m = q8_point<true>(static_cast<const uint8_t*>(b.m)[i]) * m_scale;
    float v = q8_point<false>(static_cast<const uint8_t*>(b.v)[i]) * v_scale;
    const float p = adam_elem<G, L2>(c, b.g, b.p[i], i, m, v);
    b.p[i] = p;
    store_copy_scalar<C>(b.copy, i, p);
    m_new = m;
    v_new = v;
}

// The 8-bit path, block by block: step every element (new moments kept in a block-sized buffer that
// stays in cache while the absmax is found), then the new scales, then the codes. [begin, end) starts
// at a block boundary, so blocks never straddle two calls.
template <GradKind G, CopyKind C, bool L2>
void range_q8_scalar(const StepConsts& c, const Buffers& b, int64_t begin, int64_t end) {
    alignas(64) float m_new[kQ8BlockElems], v_new[kQ8BlockElems];
    auto* m_codes = static_cast<uint8_t*>(b.m);
    auto* v_codes = static_cast<uint8_t*>(b.v);
    for (int64_t first = begin; first < end; first += kQ8BlockElems) {
        const int64_t len = std::min(kQ8BlockElems, end - first), block = first / kQ8BlockElems;
        const float m_scale = b.m_scale[block], v_scale = b.v_scale[block];
        uint32_t m_max = 0, v_max = 0;
        for (int64_t j = 0; j < len; ++j) {
            step_q8_scalar_elem<G, C, L2>(c, b, first + j, m_scale, v_scale, m_new[j], v_new[j]);
            m_max = std::max(m_max, q8_magnitude_bits(m_new[j]));
            v_max = std::max(v_max, q8_magnitude_bits(v_new[j]));
        }
        const uint32_t key = q8_block_key(c, first);
        if (q8_store_scale(m_max, b.m_scale + block, m_codes + first, len))
            q8_encode_scalar<true>(m_new, m_codes + first, first, 0, len, b.m_scale[block], key);
        if (q8_store_scale(v_max, b.v_scale + block, v_codes + first, len))
            q8_encode_scalar<false>(v_new, v_codes + first, first, 0, len, b.v_scale[block], key);
    }
}

template <GradKind G, CopyKind C, bool L2, MomentKind M>
void range_scalar(const StepConsts& c, const Buffers& b, int64_t begin, int64_t end) {
    if constexpr (M == MomentKind::q8) {
        range_q8_scalar<G, C, L2>(c, b, begin, end);
    } else {
        for (int64_t i = begin; i < end; ++i) step_scalar_elem<G, C, L2, M>(c, b, i);
    }
}

}  // namespace infinity_adam

#pragma GCC pop_options
