// Adam/AdamW kernels, the AVX2 + FMA + F16C path: 8 lanes, scalar tails (see adam_scalar.h).
#pragma once

#include "adam_scalar.h"

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

namespace infinity_adam {

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

// f32_to_bf16_stochastic on 8 lanes (r16: 16 random bits per lane).
INF_AVX2 inline __m128i f32_to_bf16_stochastic_avx2(__m256 x, __m256i r16) {
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(x), r16), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_or_si256(r, _mm256_and_si256(nan, _mm256_set1_epi32(0xFFFF)));
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    return _mm256_castsi256_si128(packed);
}

template <MomentKind M>
INF_AVX2 inline __m256 load_moment_avx2(const void* base, int64_t i) {
    if constexpr (M == MomentKind::f32) return _mm256_loadu_ps(static_cast<const float*>(base) + i);
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// bf16 moments round stochastically (r16: the lanes' random bits for this moment; unused for fp32).
template <MomentKind M>
INF_AVX2 inline void store_moment_avx2(void* base, int64_t i, __m256 x, __m256i r16) {
    if constexpr (M == MomentKind::f32) _mm256_storeu_ps(static_cast<float*>(base) + i, x);
    else _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i),
                          f32_to_bf16_stochastic_avx2(x, r16));
}

template <CopyKind C>
INF_AVX2 inline void store_copy_avx2(const Buffers& b, int64_t i, __m256 p) {
    if constexpr (C != CopyKind::none) {
        __m128i h = C == CopyKind::bf16 ? f32_to_bf16_avx2(p)
                                        : _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        auto* dst = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(b.copy) + i);
        if (b.stream_copy) _mm_stream_si128(dst, h); else _mm_storeu_si128(dst, h);
    }
}

// The step's scalars broadcast once per range.
struct Avx2Consts {
    __m256 from_m, scale, decay, l2, lerp, b2, omb2, bc2, eps, nss;
    INF_AVX2 explicit Avx2Consts(const StepConsts& c)
        : from_m(_mm256_castsi256_ps(_mm256_set1_epi32(c.lerp_from_m ? -1 : 0))),
          scale(_mm256_set1_ps(c.grad_scale)), decay(_mm256_set1_ps(c.decay)), l2(_mm256_set1_ps(c.l2)),
          lerp(_mm256_set1_ps(c.lerp_coeff)), b2(_mm256_set1_ps(c.beta2)), omb2(_mm256_set1_ps(c.one_minus_beta2)),
          bc2(_mm256_set1_ps(c.bc2_sqrt)), eps(_mm256_set1_ps(c.eps)), nss(_mm256_set1_ps(c.neg_step_size)) {}
};

// torch's Adam on 8 elements: returns the new p; m and v are updated in place.
template <GradKind G, bool L2>
INF_AVX2 inline __m256 adam8_avx2(const Avx2Consts& k, const Buffers& b, int64_t i, __m256& m, __m256& v) {
    __m256 g = _mm256_mul_ps(load_grad_avx2<G>(b.g, i), k.scale);
    __m256 p = _mm256_mul_ps(_mm256_loadu_ps(b.p + i), k.decay);
    if constexpr (L2) g = _mm256_fmadd_ps(p, k.l2, g);
    m = _mm256_fmadd_ps(k.lerp, _mm256_sub_ps(g, m), _mm256_blendv_ps(g, m, k.from_m));
    v = _mm256_fmadd_ps(_mm256_mul_ps(k.omb2, g), g, _mm256_mul_ps(v, k.b2));
    __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), k.bc2), k.eps);
    return _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(k.nss, m), denom));
}

// ---------------------------------------------------------------- 8-bit moments

INF_AVX2 inline __m256i mix32_avx2(__m256i x) {
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7FEB352D));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(int(0x846CA68Bu)));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

INF_AVX2 inline uint32_t max_epu32_avx2(__m256i x) {
    __m128i r = _mm_max_epu32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    r = _mm_max_epu32(r, _mm_shuffle_epi32(r, 0x4E));
    r = _mm_max_epu32(r, _mm_shuffle_epi32(r, 0xB1));
    return uint32_t(_mm_cvtsi128_si32(r));
}

// |x| as bits, zero below the smallest normal float (q8_magnitude_bits on 8 lanes).
INF_AVX2 inline __m256i q8_magnitude_bits_avx2(__m256 x) {
    __m256i a = _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7FFFFFFF));
    return _mm256_and_si256(a, _mm256_cmpgt_epi32(a, _mm256_set1_epi32(int(kSmallestNormalBits - 1))));
}

template <bool Signed>
INF_AVX2 inline __m256 q8_decode_avx2(const uint8_t* codes, __m256 scale) {
    using M = Q8Map<Signed>;
    __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
    __m256i mag = Signed ? _mm256_and_si256(c, _mm256_set1_epi32(0x7F)) : c;
    __m256 a = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20),
                                                    _mm256_set1_epi32(int(M::kNormalOffset << 20))));
    const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag);
    if (!_mm256_testz_si256(is_sub, is_sub)) {  // codes 0-7: zero and the points below the smallest normal one
        __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(M::kSubnormalStep));
        a = _mm256_blendv_ps(a, sub, _mm256_castsi256_ps(is_sub));
    }
    if constexpr (Signed)
        a = _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(a),
                                                 _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24)));
    return _mm256_mul_ps(a, scale);
}

// The codes of 8 values (their float bits, in the low 8 bytes) against a finite positive scale,
// given the random bits r.
template <bool Signed>
INF_AVX2 inline __m128i q8_codes8_avx2(__m256i bits, __m256 scale, __m256i r) {
    using M = Q8Map<Signed>;
    __m256i a = q8_magnitude_bits_avx2(_mm256_castsi256_ps(bits));
    __m256 y = _mm256_div_ps(_mm256_castsi256_ps(a), scale);
    __m256i u = _mm256_castps_si256(y);
    __m256i r16 = Signed ? _mm256_srli_epi32(r, 16) : _mm256_and_si256(r, _mm256_set1_epi32(0xFFFF));
    __m256i dither = _mm256_slli_epi32(r16, 4);
    __m256i code = _mm256_sub_epi32(_mm256_srli_epi32(_mm256_add_epi32(u, dither), 20),
                                    _mm256_set1_epi32(int(M::kNormalOffset)));
    const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(M::kMinNormalBits)), u);
    if (!_mm256_testz_si256(is_sub, is_sub)) {  // rare for exp_avg_sq, whose normal points reach down to 2^-30
        __m256 shifted = _mm256_add_ps(_mm256_mul_ps(y, _mm256_set1_ps(M::kInvSubnormalStep)), _mm256_set1_ps(8.0f));
        __m256i sub = _mm256_sub_epi32(_mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(shifted), dither), 20),
                                       _mm256_set1_epi32(int(kSubnormalBase)));
        code = _mm256_blendv_epi8(code, sub, is_sub);
    }
    __m256i nonzero = _mm256_cmpgt_epi32(a, _mm256_setzero_si256());
    if constexpr (Signed) {
        __m256i sign = _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80));
        code = _mm256_or_si256(code, _mm256_and_si256(sign, nonzero));
    } else {
        code = _mm256_max_epu32(code, _mm256_and_si256(nonzero, _mm256_set1_epi32(1)));
    }
    __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
    return _mm_packus_epi16(words, words);
}

// The random bits of elements first + j .. first + j + 7 (lo32 of the index never wraps inside a block or segment).
INF_AVX2 inline __m256i random_bits8_avx2(int64_t first, int64_t j, uint32_t key) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i index = _mm256_add_epi32(_mm256_set1_epi32(int(uint32_t(first + j))), lanes);
    return mix32_avx2(_mm256_xor_si256(index, _mm256_set1_epi32(int(key))));
}

// Codes for x[j], j in [0, len), of one moment against a finite positive scale (q8_encode_scalar on 8 lanes).
template <bool Signed>
INF_AVX2 inline void q8_encode_avx2(const float* x, uint8_t* codes, int64_t first, int64_t len, float scale, uint32_t key) {
    const __m256 scale_v = _mm256_set1_ps(scale);
    int64_t j = 0;
    for (; j + 8 <= len; j += 8) {
        __m128i c = q8_codes8_avx2<Signed>(_mm256_castps_si256(_mm256_load_ps(x + j)), scale_v,
                                           random_bits8_avx2(first, j, key));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + j), c);
    }
    q8_encode_scalar<Signed>(x, codes, first, j, len, scale, key);
}

// Both moments' codes in one loop, sharing the random bits (the common case: both scales usable).
INF_AVX2 inline void q8_encode_pair_avx2(const float* m, const float* v, uint8_t* m_codes, uint8_t* v_codes, int64_t first,
                                  int64_t len, float m_scale, float v_scale, uint32_t key) {
    const __m256 m_scale_v = _mm256_set1_ps(m_scale), v_scale_v = _mm256_set1_ps(v_scale);
    int64_t j = 0;
    for (; j + 8 <= len; j += 8) {
        const __m256i r = random_bits8_avx2(first, j, key);
        _mm_storel_epi64(reinterpret_cast<__m128i*>(m_codes + j),
                         q8_codes8_avx2<true>(_mm256_castps_si256(_mm256_load_ps(m + j)), m_scale_v, r));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(v_codes + j),
                         q8_codes8_avx2<false>(_mm256_castps_si256(_mm256_load_ps(v + j)), v_scale_v, r));
    }
    q8_encode_scalar<true>(m, m_codes, first, j, len, m_scale, key);
    q8_encode_scalar<false>(v, v_codes, first, j, len, v_scale, key);
}

template <GradKind G, CopyKind C, bool L2>
INF_AVX2 void range_q8_avx2(const StepConsts& c, const Buffers& b, int64_t begin, int64_t end) {
    const Avx2Consts k(c);
    alignas(64) float m_new[kQ8BlockElems], v_new[kQ8BlockElems];
    auto* m_codes = static_cast<uint8_t*>(b.m);
    auto* v_codes = static_cast<uint8_t*>(b.v);
    for (int64_t first = begin; first < end; first += kQ8BlockElems) {
        const int64_t len = std::min(kQ8BlockElems, end - first), block = first / kQ8BlockElems;
        const float m_scale = b.m_scale[block], v_scale = b.v_scale[block];
        const __m256 m_scale_v = _mm256_set1_ps(m_scale), v_scale_v = _mm256_set1_ps(v_scale);
        __m256i m_max = _mm256_setzero_si256(), v_max = _mm256_setzero_si256();
        int64_t j = 0;
        for (; j + 8 <= len; j += 8) {
            const int64_t i = first + j;
            __m256 m = q8_decode_avx2<true>(m_codes + i, m_scale_v);
            __m256 v = q8_decode_avx2<false>(v_codes + i, v_scale_v);
            __m256 p = adam8_avx2<G, L2>(k, b, i, m, v);
            _mm256_storeu_ps(b.p + i, p);
            store_copy_avx2<C>(b, i, p);
            _mm256_store_ps(m_new + j, m);
            _mm256_store_ps(v_new + j, v);
            m_max = _mm256_max_epu32(m_max, q8_magnitude_bits_avx2(m));
            v_max = _mm256_max_epu32(v_max, q8_magnitude_bits_avx2(v));
        }
        uint32_t m_max_bits = max_epu32_avx2(m_max), v_max_bits = max_epu32_avx2(v_max);
        for (; j < len; ++j) {
            step_q8_scalar_elem<G, C, L2>(c, b, first + j, m_scale, v_scale, m_new[j], v_new[j]);
            m_max_bits = std::max(m_max_bits, q8_magnitude_bits(m_new[j]));
            v_max_bits = std::max(v_max_bits, q8_magnitude_bits(v_new[j]));
        }
        const uint32_t key = q8_block_key(c, first);
        const bool m_usable = q8_store_scale(m_max_bits, b.m_scale + block, m_codes + first, len);
        const bool v_usable = q8_store_scale(v_max_bits, b.v_scale + block, v_codes + first, len);
        if (m_usable && v_usable)
            q8_encode_pair_avx2(m_new, v_new, m_codes + first, v_codes + first, first, len, b.m_scale[block],
                                b.v_scale[block], key);
        else if (m_usable)
            q8_encode_avx2<true>(m_new, m_codes + first, first, len, b.m_scale[block], key);
        else if (v_usable)
            q8_encode_avx2<false>(v_new, v_codes + first, first, len, b.v_scale[block], key);
    }
    if constexpr (C != CopyKind::none) if (b.stream_copy) _mm_sfence();
}

// ---------------------------------------------------------------- fp32 and bf16 moments

template <GradKind G, CopyKind C, bool L2, MomentKind M>
INF_AVX2 void range_avx2(const StepConsts& consts, const Buffers& bufs, int64_t begin, int64_t end) {
    const StepConsts c = consts;  // local copies: the stores below cannot alias them
    const Buffers b = bufs;
    if constexpr (M == MomentKind::q8) {
        range_q8_avx2<G, C, L2>(c, b, begin, end);
    } else {
        const Avx2Consts k(c);
        for (int64_t seg = begin; seg < end;) {  // lo32 of the index must not wrap inside 8 lanes
            const int64_t seg_end = segment_end(seg, end);
            const uint32_t key = q8_block_key(c, seg);
            int64_t i = seg;
            for (; i + 8 <= seg_end; i += 8) {
                __m256 m = load_moment_avx2<M>(b.m, i), v = load_moment_avx2<M>(b.v, i);
                __m256 p = adam8_avx2<G, L2>(k, b, i, m, v);
                _mm256_storeu_ps(b.p + i, p);
                const __m256i r = M == MomentKind::bf16 ? random_bits8_avx2(i, 0, key) : _mm256_setzero_si256();
                store_moment_avx2<M>(b.m, i, m, _mm256_srli_epi32(r, 16));
                store_moment_avx2<M>(b.v, i, v, _mm256_and_si256(r, _mm256_set1_epi32(0xFFFF)));
                store_copy_avx2<C>(b, i, p);
            }
            for (; i < seg_end; ++i) step_scalar_elem<G, C, L2, M>(c, b, i);
            seg = seg_end;
        }
        if constexpr (C != CopyKind::none) if (b.stream_copy) _mm_sfence();
    }
}

}  // namespace infinity_adam

#pragma GCC pop_options
