// One direct-I/O request of the async engine (aio.cpp) and the chunks it is split into: each chunk's
// outcome, its CRC32C of the checksummed prefix, and the failure a request reports (the first one).
#pragma once

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "crc32c.h"

namespace infinity_aio {

// One submitted read or write; done when all of its chunks are.
struct Request {
    Request(std::string p, bool w, int64_t off, int64_t n, int64_t block, int64_t crc_n)
        : path(std::move(p)), write(w), offset(off), nbytes(n), crc_bytes(crc_n), remaining((n + block - 1) / block) {
        if (crc_bytes > 0) {
            for (int64_t start = 0; start < nbytes; start += block) crc_lengths.push_back(crc_part(start, block));
            chunk_crcs.assign(crc_lengths.size(), 0);
        }
    }

    const std::string path;
    const bool write;
    const int64_t offset;
    const int64_t nbytes;
    const int64_t crc_bytes;  // the checksummed prefix; 0: none

    std::mutex mu;
    std::condition_variable cv;
    int64_t remaining;
    bool done = false;
    bool failed = false;  // the first failure wins; later ones add nothing a user can act on
    int err = 0;
    int64_t fail_offset = 0, fail_length = 0, fail_got = 0;
    std::vector<int64_t> crc_lengths;  // per chunk, in file order: its bytes inside the prefix
    std::vector<uint32_t> chunk_crcs;  // per chunk: CRC32C of those bytes
    uint32_t crc = 0;                  // of the whole prefix, once done without failure

    // Bytes of the chunk at `start` (into the request, `len` long) inside the checksummed prefix.
    int64_t crc_part(int64_t start, int64_t len) const {
        return std::max<int64_t>(0, std::min({len, nbytes - start, crc_bytes - start}));
    }

    void finish_chunk(int e, int64_t off, int64_t len, int64_t got, size_t index, uint32_t chunk_crc) {
        std::lock_guard<std::mutex> g(mu);
        if ((e != 0 || got != len) && !failed) {
            failed = true;
            err = e != 0 ? e : EIO;
            fail_offset = off;
            fail_length = len;
            fail_got = e != 0 ? -1 : got;
        }
        if (index < chunk_crcs.size()) chunk_crcs[index] = chunk_crc;
        if (--remaining == 0) {
            if (!failed) {
                for (size_t i = 0; i < chunk_crcs.size(); ++i)
                    if (crc_lengths[i] > 0) crc = infinity_crc::combine(crc, chunk_crcs[i], crc_lengths[i]);
            }
            done = true;
            cv.notify_all();
        }
    }

    std::string describe_failure() const {
        std::string what = write ? "write" : "read";
        std::string msg;
        if (fail_got >= 0) {
            msg = "short " + what + ": got " + std::to_string(fail_got) + " of " + std::to_string(fail_length) +
                  " bytes at offset " + std::to_string(fail_offset) + " (file shorter than expected: truncated?)";
        } else {
            msg = what + " failed: " + std::strerror(err) + " at offset " + std::to_string(fail_offset) +
                  ", length " + std::to_string(fail_length);
        }
        return msg + "; request offset " + std::to_string(offset) + ", length " + std::to_string(nbytes);
    }
};

struct Chunk {
    std::shared_ptr<Request> req;
    int fd = -1;
    char* buf = nullptr;
    int64_t offset = 0;
    int64_t length = 0;
    size_t index = 0;  // in the request, in file order

    // Reports the transfer's outcome, with the CRC32C of this chunk's part of the prefix when it succeeded.
    void finish(infinity_crc::Path path, int err, int64_t got) const {
        uint32_t crc = 0;
        if (err == 0 && got == length && index < req->crc_lengths.size() && req->crc_lengths[index] > 0)
            crc = infinity_crc::crc32c(path, 0, buf, static_cast<size_t>(req->crc_lengths[index]));
        req->finish_chunk(err, offset, length, got, index, crc);
    }
};

}  // namespace infinity_aio
