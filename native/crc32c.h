// CRC32C (Castagnoli, the iSCSI/ext4 checksum) of byte ranges, for verifying what the swap file gives back.
//
// Three paths give the same values: carry-less multiplication (VPCLMULQDQ on 512-bit vectors) that
// folds the data down to 16 bytes for the crc32 instruction to finish (the instruction alone tops out
// near 12 GB/s on data streamed from DRAM; the fold keeps up with the memory); the CPU's SSE4.2 crc32
// instruction over three interleaved streams (one stream waits on the instruction's 3-cycle latency;
// three keep it busy every cycle); and a slicing-by-8 table for CPUs without either. The path is
// chosen at run time (`best_path`); each instruction set lives in functions with their own target
// attribute, so the baseline x86-64 build holds all three. Values are the standard CRC32C (inverted in
// and out): crc32c(0, "123456789") is 0xE3069283, crc32c(crc32c(0, A), B) == crc32c(0, A || B), and
// combine(crc32c(0, A), crc32c(0, B), |B|) == crc32c(0, A || B), so chunks checksummed on different
// threads in any order give the checksum of the whole request.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace infinity_crc {

enum class Path : int { none = 0, table = 1, sse42 = 2, vpclmul = 3 };

constexpr uint32_t kPoly = 0x82F63B78u;  // x^32 + ... bit-reflected: bit 31 is x^0, bit 0 is x^31
constexpr size_t kLaneBig = 8192;        // three lanes per round: 24 KiB, two table look-ups to join them
constexpr size_t kLaneSmall = 256;       // the rest of a chunk, still three streams
constexpr size_t kFoldBlock = 256;       // four 64-byte accumulators: enough in flight to hide the multiply's latency
constexpr size_t kFoldMin = kFoldBlock + 64;  // a block after the unaligned head; shorter: the sse42 path

// a * b modulo P over GF(2), both bit-reflected.
inline uint32_t gf_mul(uint32_t a, uint32_t b) {
    uint32_t product = 0;
    for (int i = 0; i < 32; ++i) {
        if (a & (0x80000000u >> i)) product ^= b;  // a has the term x^i; b holds b * x^i by now
        b = (b & 1u) ? (b >> 1) ^ kPoly : b >> 1;
    }
    return product;
}

// Multiplication by a fixed polynomial as a linear map of the 4 bytes of the operand.
struct MulTable {
    uint32_t by_byte[4][256];

    void init(uint32_t factor) {
        for (int i = 0; i < 4; ++i)
            for (uint32_t v = 0; v < 256; ++v) by_byte[i][v] = gf_mul(v << (8 * i), factor);
    }
    uint32_t apply(uint32_t r) const {
        return by_byte[0][r & 0xFF] ^ by_byte[1][(r >> 8) & 0xFF] ^ by_byte[2][(r >> 16) & 0xFF] ^ by_byte[3][r >> 24];
    }
};

// Moving a 16-byte block of the data `d` bytes further on, as two carry-less multiplications of its
// halves. Bit-reflected, a 16-byte block loaded little-endian is H x^64 + L with H its low 8 bytes, and
// the 127-bit product of two reflected 64-bit operands reads, as a reflected 128-bit value, as the
// product times x. An operand c << 32 is c, so the factors are x^(8d + 64 - 1) for H and x^(8d - 1) for
// L (mod P: congruent is all a CRC needs), and every product stays below degree 96, inside the block.
// Four blocks to a 64-byte vector, each with its own pair (laid out whole: broadcasting or extracting
// lanes trips GCC 12's -Wmaybe-uninitialized).
struct alignas(64) FoldVector {
    uint64_t k[8];  // lane i: k[2i] for its low 8 bytes (H), k[2i + 1] for its high 8 (L)
};

struct Tables {
    uint32_t slice[8][256];  // slice[k][v]: the register after byte v and then k zero bytes
    uint32_t x_pow2[64];     // x^(2^k) mod P
    MulTable zeros_big, zeros_big2, zeros_small, zeros_small2;  // appending L or 2L zero bytes
    FoldVector fold_block, fold_64, fold_16;  // every lane by kFoldBlock, 64 or 16 bytes
    FoldVector fold_join[3];                  // accumulator i of four onto the last: 192, 128, 64 bytes
    FoldVector fold_lanes;                    // lane i onto lane 3: 48, 32, 16 bytes (lane 3: zero)

    Tables() {
        for (uint32_t v = 0; v < 256; ++v) {
            uint32_t r = v;
            for (int bit = 0; bit < 8; ++bit) r = (r & 1u) ? (r >> 1) ^ kPoly : r >> 1;
            slice[0][v] = r;
        }
        for (int k = 1; k < 8; ++k)
            for (uint32_t v = 0; v < 256; ++v) slice[k][v] = (slice[k - 1][v] >> 8) ^ slice[0][slice[k - 1][v] & 0xFF];
        x_pow2[0] = 0x40000000u;  // x^1
        for (int k = 1; k < 64; ++k) x_pow2[k] = gf_mul(x_pow2[k - 1], x_pow2[k - 1]);
        zeros_big.init(x_pow_bytes(kLaneBig));
        zeros_big2.init(x_pow_bytes(2 * kLaneBig));
        zeros_small.init(x_pow_bytes(kLaneSmall));
        zeros_small2.init(x_pow_bytes(2 * kLaneSmall));
        fold_block = fold_by(kFoldBlock, kFoldBlock, kFoldBlock, kFoldBlock);
        fold_64 = fold_by(64, 64, 64, 64);
        fold_16 = fold_by(16, 16, 16, 16);
        for (int i = 0; i < 3; ++i) fold_join[i] = fold_by(64 * (3 - i), 64 * (3 - i), 64 * (3 - i), 64 * (3 - i));
        fold_lanes = fold_by(48, 32, 16, 0);
    }

    // x^n mod P for a count of bits.
    uint32_t x_pow_bits(uint64_t n) const { return gf_mul(x_pow_bytes(n / 8), 0x80000000u >> (n % 8)); }

    // Lane i moved on by d[i] bytes; 0: a lane that is not moved (zero factors).
    FoldVector fold_by(uint64_t d0, uint64_t d1, uint64_t d2, uint64_t d3) const {
        FoldVector v{};
        const uint64_t d[4] = {d0, d1, d2, d3};
        for (int i = 0; i < 4; ++i) {
            if (d[i] == 0) continue;
            v.k[2 * i] = uint64_t{x_pow_bits(8 * d[i] + 63)} << 32;
            v.k[2 * i + 1] = uint64_t{x_pow_bits(8 * d[i] - 1)} << 32;
        }
        return v;
    }

    // x^(8 n) mod P: what appending n zero bytes multiplies the register by.
    uint32_t x_pow_bytes(uint64_t n) const {
        uint32_t result = 0x80000000u;  // x^0
        for (int k = 3; n != 0; n >>= 1, ++k)
            if (n & 1u) result = gf_mul(result, x_pow2[k]);
        return result;
    }
};

inline const Tables& tables() {
    static const Tables t;  // built once, thread-safe (C++11 statics)
    return t;
}

inline uint64_t load64(const uint8_t* p) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    return v;  // little-endian: x86 only, as the instruction is
}

// The raw register (no inversion) after `n` bytes, with the table.
inline uint32_t update_table(uint32_t r, const uint8_t* p, size_t n) {
    const Tables& t = tables();
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t w = load64(p) ^ r;
        r = t.slice[7][w & 0xFF] ^ t.slice[6][(w >> 8) & 0xFF] ^ t.slice[5][(w >> 16) & 0xFF] ^
            t.slice[4][(w >> 24) & 0xFF] ^ t.slice[3][(w >> 32) & 0xFF] ^ t.slice[2][(w >> 40) & 0xFF] ^
            t.slice[1][(w >> 48) & 0xFF] ^ t.slice[0][w >> 56];
    }
    for (; n > 0; --n, ++p) r = t.slice[0][(r ^ *p) & 0xFF] ^ (r >> 8);
    return r;
}

// Three streams of `lane` bytes per round: the first continues `r`, the others start from 0, and
// appending zero bytes (a multiplication) shifts each to where its lane sits before they are joined.
__attribute__((target("sse4.2"))) inline uint32_t rounds_sse42(uint32_t r, const uint8_t*& p, size_t& n, size_t lane,
                                                               const MulTable& by_lane, const MulTable& by_2lane) {
    while (n >= 3 * lane) {
        uint64_t a = r, b = 0, c = 0;
        const uint8_t* pb = p + lane;
        const uint8_t* pc = p + 2 * lane;
        for (size_t i = 0; i < lane; i += 8) {
            a = _mm_crc32_u64(a, load64(p + i));
            b = _mm_crc32_u64(b, load64(pb + i));
            c = _mm_crc32_u64(c, load64(pc + i));
        }
        r = by_2lane.apply(static_cast<uint32_t>(a)) ^ by_lane.apply(static_cast<uint32_t>(b)) ^
            static_cast<uint32_t>(c);
        p += 3 * lane;
        n -= 3 * lane;
    }
    return r;
}

__attribute__((target("sse4.2"))) inline uint32_t update_sse42(uint32_t r, const uint8_t* p, size_t n) {
    const Tables& t = tables();
    for (; n > 0 && (reinterpret_cast<uintptr_t>(p) & 7u); --n, ++p) r = _mm_crc32_u8(r, *p);
    r = rounds_sse42(r, p, n, kLaneBig, t.zeros_big, t.zeros_big2);
    r = rounds_sse42(r, p, n, kLaneSmall, t.zeros_small, t.zeros_small2);
    uint64_t r64 = r;
    for (; n >= 8; n -= 8, p += 8) r64 = _mm_crc32_u64(r64, load64(p));
    r = static_cast<uint32_t>(r64);
    for (; n > 0; --n, ++p) r = _mm_crc32_u8(r, *p);
    return r;
}

#define INFINITY_CRC_FOLD_TARGET "avx512f,avx512vl,vpclmulqdq,pclmul,sse4.2"

__attribute__((target(INFINITY_CRC_FOLD_TARGET), always_inline)) inline __m512i factors(const FoldVector& v) {
    return _mm512_load_si512(v.k);
}

// acc moved on by the constant's distance, plus the data it lands on.
__attribute__((target(INFINITY_CRC_FOLD_TARGET), always_inline)) inline __m512i fold(__m512i acc, __m512i k,
                                                                                      __m512i data) {
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(acc, k, 0x00), _mm512_clmulepi64_epi128(acc, k, 0x11),
                                     data, 0x96);  // three-way xor
}

__attribute__((target(INFINITY_CRC_FOLD_TARGET), always_inline)) inline __m128i fold(__m128i acc, __m128i k,
                                                                                      __m128i data) {
    return _mm_ternarylogic_epi64(_mm_clmulepi64_si128(acc, k, 0x00), _mm_clmulepi64_si128(acc, k, 0x11), data, 0x96);
}

// Folds all but the last 0..15 bytes into one 16-byte block whose CRC (from a zero register) is that of
// the bytes it replaces with `r` as their register; the crc32 instruction then finishes it and the rest.
__attribute__((target(INFINITY_CRC_FOLD_TARGET))) inline uint32_t update_vpclmul(uint32_t r, const uint8_t* p,
                                                                                 size_t n) {
    if (n < kFoldMin) return update_sse42(r, p, n);
    const Tables& t = tables();
    size_t head = -reinterpret_cast<uintptr_t>(p) & 63u;  // aligned loads: none straddles two cache lines
    r = update_sse42(r, p, head);
    p += head;
    n -= head;

    // The register is linear in the data: xored into the first 4 bytes, it starts the fold.
    __m512i a0 = _mm512_xor_si512(_mm512_load_si512(p), _mm512_maskz_set1_epi32(1, static_cast<int>(r)));
    __m512i a1 = _mm512_load_si512(p + 64), a2 = _mm512_load_si512(p + 128), a3 = _mm512_load_si512(p + 192);
    p += kFoldBlock;
    n -= kFoldBlock;
    const __m512i by_block = factors(t.fold_block);
    for (; n >= kFoldBlock; n -= kFoldBlock, p += kFoldBlock) {
        a0 = fold(a0, by_block, _mm512_load_si512(p));
        a1 = fold(a1, by_block, _mm512_load_si512(p + 64));
        a2 = fold(a2, by_block, _mm512_load_si512(p + 128));
        a3 = fold(a3, by_block, _mm512_load_si512(p + 192));
    }
    a3 = fold(a0, factors(t.fold_join[0]), a3);
    a3 = fold(a1, factors(t.fold_join[1]), a3);
    a3 = fold(a2, factors(t.fold_join[2]), a3);
    const __m512i by_64 = factors(t.fold_64);
    for (; n >= 64; n -= 64, p += 64) a3 = fold(a3, by_64, _mm512_load_si512(p));

    // Lanes 0..2 moved onto lane 3 (which keeps its own value), then the four summed.
    alignas(64) __m128i lanes[4];
    __m512i moved = fold(a3, factors(t.fold_lanes), _mm512_setzero_si512());
    _mm512_store_si512(lanes, _mm512_mask_blend_epi64(0xC0, moved, a3));
    __m128i x = _mm_xor_si128(_mm_ternarylogic_epi64(lanes[0], lanes[1], lanes[2], 0x96), lanes[3]);
    const __m128i by_16 = _mm_load_si128(reinterpret_cast<const __m128i*>(t.fold_16.k));
    for (; n >= 16; n -= 16, p += 16) x = fold(x, by_16, _mm_load_si128(reinterpret_cast<const __m128i*>(p)));

    uint64_t r64 = _mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(x)));
    r64 = _mm_crc32_u64(r64, static_cast<uint64_t>(_mm_extract_epi64(x, 1)));
    return update_sse42(static_cast<uint32_t>(r64), p, n);
}

inline bool supported(Path path) {
    __builtin_cpu_init();
    switch (path) {
        case Path::sse42:
            return __builtin_cpu_supports("sse4.2");
        case Path::vpclmul:
            return __builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("pclmul") &&
                   __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                   __builtin_cpu_supports("vpclmulqdq");
        default:
            return true;
    }
}

inline Path best_path() {
    if (supported(Path::vpclmul)) return Path::vpclmul;
    return supported(Path::sse42) ? Path::sse42 : Path::table;
}

// The CRC32C of `crc`'s data followed by the `n` bytes at `p` (crc 0: of those bytes alone).
inline uint32_t crc32c(Path path, uint32_t crc, const void* data, size_t n) {
    const auto* p = static_cast<const uint8_t*>(data);
    uint32_t r = ~crc;
    switch (path) {
        case Path::vpclmul:
            r = update_vpclmul(r, p, n);
            break;
        case Path::sse42:
            r = update_sse42(r, p, n);
            break;
        default:
            r = update_table(r, p, n);
    }
    return ~r;
}

// The CRC32C of A || B from crc32c(0, A), crc32c(0, B) and |B|.
inline uint32_t combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
    return gf_mul(crc_a, tables().x_pow_bytes(len_b)) ^ crc_b;
}

}  // namespace infinity_crc
