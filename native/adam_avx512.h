// Adam/AdamW kernels, the AVX-512 F/BW/VL path: 16 lanes, masked tails (see adam_scalar.h).
#pragma once

#include "adam_scalar.h"

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

namespace infinity_adam {

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

// f32_to_bf16_stochastic on 16 lanes (r16: 16 random bits per lane).
INF_AVX512 inline __m256i f32_to_bf16_stochastic_avx512(__m512 x, __m512i r16) {
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(x), r16), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0xFFFF));
    return _mm512_cvtepi32_epi16(r);
}

template <MomentKind M>
INF_AVX512 inline __m512 load_moment_avx512(const void* base, int64_t i, __mmask16 k) {
    if constexpr (M == MomentKind::f32) return _mm512_maskz_loadu_ps(k, static_cast<const float*>(base) + i);
    __m256i h = _mm256_maskz_loadu_epi16(k, static_cast<const uint16_t*>(base) + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// bf16 moments round stochastically (r16: the lanes' random bits for this moment; unused for fp32).
template <MomentKind M, bool Full>
INF_AVX512 inline void store_moment_avx512(void* base, int64_t i, __mmask16 k, __m512 x, __m512i r16) {
    if constexpr (M == MomentKind::f32) {
        if constexpr (Full) _mm512_storeu_ps(static_cast<float*>(base) + i, x);
        else _mm512_mask_storeu_ps(static_cast<float*>(base) + i, k, x);
    } else {
        uint16_t* dst = static_cast<uint16_t*>(base) + i;
        const __m256i h = f32_to_bf16_stochastic_avx512(x, r16);
        if constexpr (Full) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), h);
        else _mm256_mask_storeu_epi16(dst, k, h);
    }
}

// Stores the new p and its bf16/fp16 copy; lanes outside mask k are not written.
template <CopyKind C, bool Full>
INF_AVX512 inline void store_p_avx512(const Buffers& b, int64_t i, __mmask16 k, __m512 p) {
    if constexpr (Full) _mm512_storeu_ps(b.p + i, p);
    else _mm512_mask_storeu_ps(b.p + i, k, p);
    if constexpr (C != CopyKind::none) {
        __m256i h = C == CopyKind::bf16 ? f32_to_bf16_avx512(p)
                                        : _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        uint16_t* dst = static_cast<uint16_t*>(b.copy) + i;
        if (!Full) _mm256_mask_storeu_epi16(dst, k, h);
        else if (b.stream_copy) _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), h);
        else _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), h);
    }
}

// torch's Adam on the 16 lanes of mask k: returns the new p; m and v are updated in place.
template <GradKind G, bool L2>
INF_AVX512 inline __m512 adam16_avx512(const StepConsts& c, const Buffers& b, int64_t i, __mmask16 k, __m512& m,
                                       __m512& v) {
    __m512 g = _mm512_mul_ps(load_grad_avx512<G>(b.g, i, k), _mm512_set1_ps(c.grad_scale));
    __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, b.p + i), _mm512_set1_ps(c.decay));
    if constexpr (L2) g = _mm512_fmadd_ps(p, _mm512_set1_ps(c.l2), g);
    const __mmask16 from_m = c.lerp_from_m ? 0xFFFF : 0;
    m = _mm512_fmadd_ps(_mm512_set1_ps(c.lerp_coeff), _mm512_sub_ps(g, m), _mm512_mask_blend_ps(from_m, g, m));
    v = _mm512_mul_ps(v, _mm512_set1_ps(c.beta2));
    v = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(c.one_minus_beta2), g), g, v);
    __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), _mm512_set1_ps(c.bc2_sqrt)),
                                 _mm512_set1_ps(c.eps));
    return _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(c.neg_step_size), m), denom));
}

// ---------------------------------------------------------------- 8-bit moments

INF_AVX512 inline __m512i mix32_avx512(__m512i x) {
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7FEB352D));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(int(0x846CA68Bu)));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

// |x| as bits, zero below the smallest normal float (q8_magnitude_bits on 16 lanes).
INF_AVX512 inline __m512i q8_magnitude_bits_avx512(__m512 x) {
    __m512i a = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF));
    return _mm512_maskz_mov_epi32(_mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(int(kSmallestNormalBits))), a);
}

template <bool Signed>
INF_AVX512 inline __m512 q8_decode_avx512(const uint8_t* codes, __mmask16 k, __m512 scale) {
    using M = Q8Map<Signed>;
    __m512i c = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, codes));
    __m512i mag = Signed ? _mm512_and_si512(c, _mm512_set1_epi32(0x7F)) : c;
    __m512 a = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(mag, 20),
                                                    _mm512_set1_epi32(int(M::kNormalOffset << 20))));
    const __mmask16 is_sub = _mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(8));
    if (is_sub)  // codes 0-7: zero and the evenly spaced points below the smallest normal one
        a = _mm512_mask_mul_ps(a, is_sub, _mm512_cvtepi32_ps(mag), _mm512_set1_ps(M::kSubnormalStep));
    if constexpr (Signed)
        a = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a),
                                                 _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x80)), 24)));
    return _mm512_mul_ps(a, scale);
}

// The codes of 16 values (their float bits) against a finite positive scale, given the random bits r.
template <bool Signed>
INF_AVX512 inline __m128i q8_codes16_avx512(__m512i bits, __m512 scale, __m512i r) {
    using M = Q8Map<Signed>;
    __m512i a = q8_magnitude_bits_avx512(_mm512_castsi512_ps(bits));
    __m512 y = _mm512_div_ps(_mm512_castsi512_ps(a), scale);
    __m512i u = _mm512_castps_si512(y);
    __m512i r16 = Signed ? _mm512_srli_epi32(r, 16) : _mm512_and_si512(r, _mm512_set1_epi32(0xFFFF));
    __m512i dither = _mm512_slli_epi32(r16, 4);
    __m512i code = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_add_epi32(u, dither), 20),
                                    _mm512_set1_epi32(int(M::kNormalOffset)));
    __mmask16 is_normal = _mm512_cmpge_epu32_mask(u, _mm512_set1_epi32(int(M::kMinNormalBits)));
    if (is_normal != 0xFFFF) {  // rare for exp_avg_sq, whose normal points reach down to 2^-30
        __m512 shifted = _mm512_add_ps(_mm512_mul_ps(y, _mm512_set1_ps(M::kInvSubnormalStep)), _mm512_set1_ps(8.0f));
        __m512i sub = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(shifted), dither), 20),
                                       _mm512_set1_epi32(int(kSubnormalBase)));
        code = _mm512_mask_blend_epi32(is_normal, sub, code);
    }
    __mmask16 nonzero = _mm512_test_epi32_mask(a, a);
    if constexpr (Signed) {
        __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80));
        code = _mm512_mask_or_epi32(code, nonzero, code, sign);
    } else {
        code = _mm512_mask_max_epu32(code, nonzero, code, _mm512_set1_epi32(1));
    }
    return _mm512_cvtepi32_epi8(code);
}

// The random bits of elements first + j .. first + j + 15 (lo32 of the index never wraps inside a block or segment).
INF_AVX512 inline __m512i random_bits16_avx512(int64_t first, int64_t j, uint32_t key) {
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i index = _mm512_add_epi32(_mm512_set1_epi32(int(uint32_t(first + j))), lanes);
    return mix32_avx512(_mm512_xor_si512(index, _mm512_set1_epi32(int(key))));
}

// Codes for x[j], j in [0, len), of one moment against a finite positive scale (q8_encode_scalar on 16 lanes).
template <bool Signed>
INF_AVX512 inline void q8_encode_avx512(const float* x, uint8_t* codes, int64_t first, int64_t len, float scale,
                                 uint32_t key) {
    const __m512 scale_v = _mm512_set1_ps(scale);
    for (int64_t j = 0; j < len; j += 16) {
        const __mmask16 k = len - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (len - j)) - 1u);
        __m512i bits = _mm512_castps_si512(_mm512_maskz_load_ps(k, x + j));
        _mm_mask_storeu_epi8(codes + j, k, q8_codes16_avx512<Signed>(bits, scale_v, random_bits16_avx512(first, j, key)));
    }
}

// Both moments' codes in one loop, sharing the random bits (the common case: both scales usable).
INF_AVX512 inline void q8_encode_pair_avx512(const float* m, const float* v, uint8_t* m_codes, uint8_t* v_codes,
                                      int64_t first, int64_t len, float m_scale, float v_scale, uint32_t key) {
    const __m512 m_scale_v = _mm512_set1_ps(m_scale), v_scale_v = _mm512_set1_ps(v_scale);
    int64_t j = 0;
    for (; j + 16 <= len; j += 16) {
        const __m512i r = random_bits16_avx512(first, j, key);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(m_codes + j),
                         q8_codes16_avx512<true>(_mm512_castps_si512(_mm512_load_ps(m + j)), m_scale_v, r));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(v_codes + j),
                         q8_codes16_avx512<false>(_mm512_castps_si512(_mm512_load_ps(v + j)), v_scale_v, r));
    }
    if (j < len) {
        const __mmask16 k = __mmask16((1u << (len - j)) - 1u);
        const __m512i r = random_bits16_avx512(first, j, key);
        _mm_mask_storeu_epi8(m_codes + j, k,
                             q8_codes16_avx512<true>(_mm512_castps_si512(_mm512_maskz_load_ps(k, m + j)), m_scale_v, r));
        _mm_mask_storeu_epi8(v_codes + j, k, q8_codes16_avx512<false>(
                                                 _mm512_castps_si512(_mm512_maskz_load_ps(k, v + j)), v_scale_v, r));
    }
}

template <GradKind G, CopyKind C, bool L2, bool Full>
INF_AVX512 inline void step16_q8_avx512(const StepConsts& c, const Buffers& b, int64_t i, __mmask16 k,
                                        __m512 m_scale, __m512 v_scale, float* m_new, float* v_new,
                                        __m512i& m_max, __m512i& v_max) {
    __m512 m = q8_decode_avx512<true>(static_cast<const uint8_t*>(b.m) + i, k, m_scale);
    __m512 v = q8_decode_avx512<false>(static_cast<const uint8_t*>(b.v) + i, k, v_scale);
    __m512 p = adam16_avx512<G, L2>(c, b, i, k, m, v);
    store_p_avx512<C, Full>(b, i, k, p);
    _mm512_store_ps(m_new, m);
    _mm512_store_ps(v_new, v);
    m_max = _mm512_mask_max_epu32(m_max, k, m_max, q8_magnitude_bits_avx512(m));
    v_max = _mm512_mask_max_epu32(v_max, k, v_max, q8_magnitude_bits_avx512(v));
}

template <GradKind G, CopyKind C, bool L2>
INF_AVX512 void range_q8_avx512(const StepConsts& c, const Buffers& b, int64_t begin, int64_t end) {
    alignas(64) float m_new[kQ8BlockElems], v_new[kQ8BlockElems];
    auto* m_codes = static_cast<uint8_t*>(b.m);
    auto* v_codes = static_cast<uint8_t*>(b.v);
    for (int64_t first = begin; first < end; first += kQ8BlockElems) {
        const int64_t len = std::min(kQ8BlockElems, end - first), block = first / kQ8BlockElems;
        const __m512 m_scale = _mm512_set1_ps(b.m_scale[block]), v_scale = _mm512_set1_ps(b.v_scale[block]);
        __m512i m_max = _mm512_setzero_si512(), v_max = _mm512_setzero_si512();
        int64_t j = 0;
        for (; j + 16 <= len; j += 16)
            step16_q8_avx512<G, C, L2, true>(c, b, first + j, 0xFFFF, m_scale, v_scale, m_new + j, v_new + j,
                                             m_max, v_max);
        if (j < len)
            step16_q8_avx512<G, C, L2, false>(c, b, first + j, __mmask16((1u << (len - j)) - 1u), m_scale, v_scale,
                                              m_new + j, v_new + j, m_max, v_max);
        const uint32_t key = q8_block_key(c, first);
        const bool m_usable = q8_store_scale(uint32_t(_mm512_reduce_max_epu32(m_max)), b.m_scale + block,
                                             m_codes + first, len);
        const bool v_usable = q8_store_scale(uint32_t(_mm512_reduce_max_epu32(v_max)), b.v_scale + block,
                                             v_codes + first, len);
        if (m_usable && v_usable)
            q8_encode_pair_avx512(m_new, v_new, m_codes + first, v_codes + first, first, len, b.m_scale[block],
                                  b.v_scale[block], key);
        else if (m_usable)
            q8_encode_avx512<true>(m_new, m_codes + first, first, len, b.m_scale[block], key);
        else if (v_usable)
            q8_encode_avx512<false>(v_new, v_codes + first, first, len, b.v_scale[block], key);
    }
    if constexpr (C != CopyKind::none) if (b.stream_copy) _mm_sfence();
}

// ---------------------------------------------------------------- fp32 and bf16 moments

// One 16-lane step; lanes outside mask k are neither read nor written. `key`: q8_block_key of i.
template <GradKind G, CopyKind C, bool L2, MomentKind M, bool Full>
INF_AVX512 inline void step16_avx512(const StepConsts& c, const Buffers& b, int64_t i, __mmask16 k, uint32_t key) {
    __m512 m = load_moment_avx512<M>(b.m, i, k), v = load_moment_avx512<M>(b.v, i, k);
    __m512 p = adam16_avx512<G, L2>(c, b, i, k, m, v);
    store_p_avx512<C, Full>(b, i, k, p);
    const __m512i r = M == MomentKind::bf16 ? random_bits16_avx512(i, 0, key) : _mm512_setzero_si512();
    store_moment_avx512<M, Full>(b.m, i, k, m, _mm512_srli_epi32(r, 16));
    store_moment_avx512<M, Full>(b.v, i, k, v, _mm512_and_si512(r, _mm512_set1_epi32(0xFFFF)));
}

template <GradKind G, CopyKind C, bool L2, MomentKind M>
INF_AVX512 void range_avx512(const StepConsts& consts, const Buffers& bufs, int64_t begin, int64_t end) {
    const StepConsts c = consts;  // local copies: the stores below cannot alias them
    const Buffers b = bufs;
    if constexpr (M == MomentKind::q8) {
        range_q8_avx512<G, C, L2>(c, b, begin, end);
    } else {
        for (int64_t seg = begin; seg < end;) {  // lo32 of the index must not wrap inside 16 lanes
            const int64_t seg_end = segment_end(seg, end);
            const uint32_t key = q8_block_key(c, seg);
            int64_t i = seg;
            for (; i + 16 <= seg_end; i += 16) step16_avx512<G, C, L2, M, true>(c, b, i, 0xFFFF, key);
            if (i < seg_end)
                step16_avx512<G, C, L2, M, false>(c, b, i, __mmask16((1u << (seg_end - i)) - 1u), key);
            seg = seg_end;
        }
        if constexpr (C != CopyKind::none) if (b.stream_copy) _mm_sfence();
    }
}

}  // namespace infinity_adam

#pragma GCC pop_options
