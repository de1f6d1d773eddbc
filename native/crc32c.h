// CRC32C (Castagnoli, the iSCSI/ext4 checksum) of byte ranges, for verifying what the swap file gives back.
//
// Two paths give the same values: the CPU's SSE4.2 crc32 instruction over three interleaved streams
// (one stream waits on the instruction's 3-cycle latency; three keep it busy every cycle), and a
// slicing-by-8 table for CPUs without it. The path is chosen at run time (`best_path`); the
// instruction lives in a function with its own target attribute, so the baseline x86-64 build
// holds both. Values are the standard CRC32C (inverted in and out): crc32c(0, "123456789") is
// 0xE3069283, crc32c(crc32c(0, A), B) == crc32c(0, A || B), and
// combine(crc32c(0, A), crc32c(0, B), |B|) == crc32c(0, A || B), so chunks checksummed on different
// threads in any order give the checksum of the whole request.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace infinity_crc {

enum class Path : int { none = 0, table = 1, sse42 = 2 };

constexpr uint32_t kPoly = 0x82F63B78u;  // x^32 + ... bit-reflected: bit 31 is x^0, bit 0 is x^31
constexpr size_t kLaneBig = 8192;        // three lanes per round: 24 KiB, two table look-ups to join them
constexpr size_t kLaneSmall = 256;       // the rest of a chunk, still three streams

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

struct Tables {
    uint32_t slice[8][256];  // slice[k][v]: the register after byte v and then k zero bytes
    uint32_t x_pow2[64];     // x^(2^k) mod P
    MulTable zeros_big, zeros_big2, zeros_small, zeros_small2;  // appending L or 2L zero bytes

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

inline bool supported(Path path) {
    if (path != Path::sse42) return true;
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2");
}

inline Path best_path() { return supported(Path::sse42) ? Path::sse42 : Path::table; }

// The CRC32C of `crc`'s data followed by the `n` bytes at `p` (crc 0: of those bytes alone).
inline uint32_t crc32c(Path path, uint32_t crc, const void* data, size_t n) {
    const auto* p = static_cast<const uint8_t*>(data);
    uint32_t r = ~crc;
    r = path == Path::sse42 ? update_sse42(r, p, n) : update_table(r, p, n);
    return ~r;
}

// The CRC32C of A || B from crc32c(0, A), crc32c(0, B) and |B|.
inline uint32_t combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
    return gf_mul(crc_a, tables().x_pow_bytes(len_b)) ^ crc_b;
}

}  // namespace infinity_crc
