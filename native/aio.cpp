// The async direct-I/O engine: reads and writes between 4 KiB-aligned host buffers and files
// opened with O_DIRECT, many requests in flight.
//
// A request is split into `block_size` chunks on one shared queue. `intra_op_parallelism` workers
// each keep up to `queue_depth` chunks in flight through Linux kernel AIO (io_submit/io_getevents,
// raw syscalls: no libaio needed); where the kernel refuses an AIO context, blocking pread/pwrite
// threads (intra_op_parallelism x queue_depth of them) serve the same queue. Python passes
// addresses as integers; nothing here knows torch. Submitting and waiting release the GIL.
// A request fails with its first error (errno, or a short read), reported with file, offset and
// length; the engine itself stays usable.
//
// A request may ask for the CRC32C of its first `crc_bytes` bytes: each worker checksums its chunks
// once they complete (reads after the data landed, writes from the memory just written), after
// refilling its queue so the disk stays busy meanwhile; the last chunk to finish joins them in order.
#include <linux/aio_abi.h>
#include <pybind11/pybind11.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "aio_request.h"
#include "crc32c.h"

namespace py = pybind11;

namespace {

constexpr int64_t kAlign = 4096;
constexpr int64_t kMaxBlockingWorkers = 256;  // threads standing in for kernel AIO's requests in flight

int io_setup_(unsigned nr, aio_context_t* ctx) { return static_cast<int>(syscall(SYS_io_setup, nr, ctx)); }
int io_destroy_(aio_context_t ctx) { return static_cast<int>(syscall(SYS_io_destroy, ctx)); }
int io_submit_(aio_context_t ctx, long n, iocb** cbs) { return static_cast<int>(syscall(SYS_io_submit, ctx, n, cbs)); }
int io_getevents_(aio_context_t ctx, long min_nr, long nr, io_event* events) {
    return static_cast<int>(syscall(SYS_io_getevents, ctx, min_nr, nr, events, nullptr));
}

using infinity_aio::Chunk;
using infinity_aio::Request;

// Blocking transfer of a whole chunk (or its rest); returns bytes done, sets `err` on failure.
int64_t transfer_blocking(const Chunk& c, int64_t done, int& err) {
    err = 0;
    while (done < c.length) {
        ssize_t r = c.req->write ? pwrite(c.fd, c.buf + done, c.length - done, c.offset + done)
                                 : pread(c.fd, c.buf + done, c.length - done, c.offset + done);
        if (r < 0) {
            if (errno == EINTR) continue;
            err = errno;
            break;
        }
        if (r == 0) break;  // end of file on a read; a zero-byte write cannot progress either
        done += r;
    }
    if (err == 0 && done < c.length && c.req->write) err = EIO;
    return done;
}

class Engine {
public:
    Engine(int64_t block_size, int queue_depth, int threads, bool single_submit, bool overlap_events, bool use_kaio,
           int crc_path)
        : block_size_(block_size), queue_depth_(queue_depth), single_submit_(single_submit),
          overlap_events_(overlap_events), crc_path_(static_cast<infinity_crc::Path>(crc_path)) {
        if (block_size <= 0 || block_size % kAlign) throw py::value_error("block_size must be a positive multiple of 4096");
        if (crc_path < 1 || crc_path > 3 || !infinity_crc::supported(crc_path_))
            throw py::value_error("crc_path must be 1 (table), 2 (sse4.2) or 3 (avx512), where the CPU has it");
        if (queue_depth < 1 || threads < 1) throw py::value_error("queue_depth and intra_op_parallelism must be >= 1");
        // Past RLIMIT_FSIZE the kernel sends SIGXFSZ, whose default action kills the process; ignored,
        // the write fails with EFBIG and is reported like any other error. A handler someone
        // installed on purpose is left alone.
        struct sigaction old {};
        if (sigaction(SIGXFSZ, nullptr, &old) == 0 && old.sa_handler == SIG_DFL) signal(SIGXFSZ, SIG_IGN);
        if (use_kaio) {
            for (int i = 0; i < threads; ++i) {
                aio_context_t ctx = 0;
                if (io_setup_(static_cast<unsigned>(queue_depth), &ctx) != 0) {
                    for (auto c : contexts_) io_destroy_(c);
                    contexts_.clear();
                    break;
                }
                contexts_.push_back(ctx);
            }
        }
        // Without kernel AIO (io_setup refused: fs.aio-max-nr reached, or no support), blocking workers stand in
        // for the requests in flight, at most kMaxBlockingWorkers of them. A thread that cannot start stops the
        // ones that did and raises: an exception leaving the constructor with joinable threads would terminate.
        try {
            if (!contexts_.empty()) {
                for (auto ctx : contexts_) workers_.emplace_back([this, ctx] { run_kaio(ctx); });
            } else {
                const int64_t wanted = static_cast<int64_t>(threads) * queue_depth;
                for (int64_t i = 0; i < std::min<int64_t>(wanted, kMaxBlockingWorkers); ++i)
                    workers_.emplace_back([this] { run_blocking(); });
            }
        } catch (const std::exception& e) {  // std::system_error from a thread, std::bad_alloc from the vector
            shutdown();
            throw std::runtime_error(std::string("cannot start the I/O worker threads: ") + e.what() +
                                     "; lower aio.intra_op_parallelism (and aio.queue_depth)");
        }
    }

    ~Engine() { shutdown(); }

    void shutdown() {
        {
            std::lock_guard<std::mutex> g(mu_);
            if (stop_) return;
            stop_ = true;
        }
        cv_.notify_all();
        for (auto& t : workers_) t.join();
        for (auto c : contexts_) io_destroy_(c);
    }

    std::shared_ptr<Request> submit(bool write, int fd, const std::string& path, uintptr_t addr, int64_t offset,
                                     int64_t nbytes, int64_t crc_bytes) {
        if (addr % kAlign || offset % kAlign || nbytes % kAlign || nbytes <= 0 || offset < 0) {
            throw py::value_error("direct I/O needs a 4096-aligned address, offset and length > 0; got address " +
                                  std::to_string(addr) + ", offset " + std::to_string(offset) + ", length " +
                                  std::to_string(nbytes) + " for '" + path + "'");
        }
        if (crc_bytes < 0 || crc_bytes > nbytes) {
            throw py::value_error("crc_bytes must be in [0, " + std::to_string(nbytes) + "], got " +
                                  std::to_string(crc_bytes));
        }
        int64_t chunks = (nbytes + block_size_ - 1) / block_size_;
        auto req = std::make_shared<Request>(path, write, offset, nbytes, block_size_, crc_bytes);
        {
            std::lock_guard<std::mutex> g(mu_);
            if (stop_) throw std::runtime_error("the aio engine is closed");
            for (int64_t i = 0; i < chunks; ++i) {
                int64_t off = i * block_size_;
                queue_.push_back(Chunk{req, fd, reinterpret_cast<char*>(addr) + off, offset + off,
                                       std::min(block_size_, nbytes - off), static_cast<size_t>(i)});
            }
        }
        cv_.notify_all();
        return req;
    }

    std::string submitter() const { return contexts_.empty() ? "pread" : "kaio"; }

private:
    // Waits for work (or stop) when nothing is in flight; takes up to `room` chunks.
    bool take(std::vector<Chunk>& out, size_t room, bool block) {
        std::unique_lock<std::mutex> lk(mu_);
        if (block) cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return !(stop_ && block);
        while (out.size() < room && !queue_.empty()) {
            out.push_back(std::move(queue_.front()));
            queue_.pop_front();
        }
        return true;
    }

    void run_blocking() {
        std::vector<Chunk> one;
        while (true) {
            one.clear();
            if (!take(one, 1, true)) return;
            for (auto& c : one) {
                int err = 0;
                int64_t got = transfer_blocking(c, 0, err);
                c.finish(crc_path_, err, got);
            }
        }
    }

    void run_kaio(aio_context_t ctx) {
        const int qd = queue_depth_;
        std::vector<iocb> cbs(qd);
        std::vector<Chunk> slots(qd);
        std::vector<int> free_slots;
        for (int i = qd - 1; i >= 0; --i) free_slots.push_back(i);
        std::vector<io_event> events(qd);
        std::vector<Chunk> fresh;
        std::vector<iocb*> batch;
        struct Reaped {
            Chunk chunk;
            int err;
            int64_t got;
        };
        std::vector<Reaped> reaped;  // completed, their slots free again; checksummed once new chunks are in flight
        int inflight = 0;
        while (true) {
            fresh.clear();
            // Without overlap_events, a batch is submitted only once the previous one has completed.
            bool may_take = overlap_events_ || inflight == 0;
            bool idle = inflight == 0 && reaped.empty();
            if (may_take && !take(fresh, static_cast<size_t>(qd - inflight), idle)) return;
            batch.clear();
            for (auto& c : fresh) {
                int s = free_slots.back();
                free_slots.pop_back();
                slots[s] = std::move(c);
                iocb& cb = cbs[s];
                std::memset(&cb, 0, sizeof(cb));
                cb.aio_data = static_cast<uint64_t>(s);
                cb.aio_lio_opcode = slots[s].req->write ? IOCB_CMD_PWRITE : IOCB_CMD_PREAD;
                cb.aio_fildes = static_cast<uint32_t>(slots[s].fd);
                cb.aio_buf = reinterpret_cast<uint64_t>(slots[s].buf);
                cb.aio_nbytes = static_cast<uint64_t>(slots[s].length);
                cb.aio_offset = slots[s].offset;
                batch.push_back(&cb);
            }
            size_t next = 0;
            while (next < batch.size()) {
                long n = single_submit_ ? 1 : static_cast<long>(batch.size() - next);
                int r = io_submit_(ctx, n, batch.data() + next);
                if (r > 0) {
                    next += static_cast<size_t>(r);
                    inflight += r;
                    continue;
                }
                int e = r < 0 ? errno : EAGAIN;
                if (e == EINTR) continue;
                if (e == EAGAIN && inflight > 0) break;  // reap below, then retry the rest
                // Refused at submission (EBADF, EINVAL, EFBIG...): that chunk fails, the rest go on.
                int s = static_cast<int>(batch[next]->aio_data);
                slots[s].finish(crc_path_, e, 0);
                slots[s] = Chunk{};
                free_slots.push_back(s);
                ++next;
            }
            for (size_t i = next; i < batch.size(); ++i) {  // not accepted yet: back to the front of the queue
                int s = static_cast<int>(batch[i]->aio_data);
                {
                    std::lock_guard<std::mutex> g(mu_);
                    queue_.push_front(std::move(slots[s]));
                }
                slots[s] = Chunk{};
                free_slots.push_back(s);
            }
            for (auto& r : reaped) r.chunk.finish(crc_path_, r.err, r.got);  // the disk meanwhile serves the new ones
            reaped.clear();
            if (inflight == 0) continue;
            int min_nr = overlap_events_ ? 1 : inflight;
            int got = io_getevents_(ctx, min_nr, qd, events.data());
            if (got < 0) {
                if (errno == EINTR) continue;
                std::abort();  // a broken AIO context cannot report its requests: better loud than a hang
            }
            for (int i = 0; i < got; ++i) {
                int s = static_cast<int>(events[i].data);
                Chunk& c = slots[s];
                int64_t res = static_cast<int64_t>(events[i].res);
                int err = res < 0 ? static_cast<int>(-res) : 0;
                int64_t done = res < 0 ? 0 : res;
                if (err == 0 && done < c.length && done > 0) done = transfer_blocking(c, done, err);  // rare partial
                reaped.push_back(Reaped{std::move(c), err, done});
                c = Chunk{};
                free_slots.push_back(s);
                --inflight;
            }
        }
    }

    const int64_t block_size_;
    const int queue_depth_;
    const bool single_submit_;
    const bool overlap_events_;
    const infinity_crc::Path crc_path_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<Chunk> queue_;
    bool stop_ = false;
    std::vector<aio_context_t> contexts_;
    std::vector<std::thread> workers_;
};

[[noreturn]] void raise_failure(const Request& r) {
    PyObject* exc = PyObject_CallFunction(PyExc_OSError, "iss", r.err, r.describe_failure().c_str(), r.path.c_str());
    if (exc != nullptr) {
        PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc)), exc);
        Py_DECREF(exc);
    }
    throw py::error_already_set();
}

// Waits up to timeout_s (< 0: forever); returns whether the request is done, raising its failure.
bool wait_request(Request& r, double timeout_s) {
    {
        py::gil_scoped_release nogil;
        std::unique_lock<std::mutex> lk(r.mu);
        if (timeout_s < 0) {
            r.cv.wait(lk, [&] { return r.done; });
        } else {
            r.cv.wait_for(lk, std::chrono::duration<double>(timeout_s), [&] { return r.done; });
        }
        if (!r.done) return false;
    }
    if (r.failed) raise_failure(r);
    return true;
}

}  // namespace

void register_aio(py::module_& m) {
    auto aio = m.def_submodule("aio", "async direct-I/O engine (O_DIRECT files, aligned host buffers)");
    // Staging copies run beside the I/O threads; one thread and no GIL beats an OpenMP team
    // fighting them (and everything else) for the cores.
    aio.def(
        "copy",
        [](uintptr_t dst, uintptr_t src, int64_t nbytes) {
            if (nbytes > 0) std::memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), nbytes);
        },
        py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::call_guard<py::gil_scoped_release>(),
        "memcpy of nbytes from address src to address dst (non-overlapping host memory).");
    py::class_<Request, std::shared_ptr<Request>>(aio, "Request")
        .def("wait", &wait_request, py::arg("timeout_s") = -1.0,
             "Block (GIL released) until done or timeout_s passes; True when done. Raises OSError on failure.")
        .def("done", [](Request& r) {
            std::lock_guard<std::mutex> g(r.mu);
            return r.done;
        })
        .def_property_readonly(
            "crc32c",
            [](Request& r) -> py::object {
                std::lock_guard<std::mutex> g(r.mu);
                if (!r.done || r.failed || r.crc_bytes == 0) return py::none();
                return py::int_(r.crc);
            },
            "CRC32C of the first crc_bytes bytes as transferred, once done; None if not asked for, not done or failed.")
        .def_readonly("crc_bytes", &Request::crc_bytes)
        .def_readonly("path", &Request::path)
        .def_readonly("offset", &Request::offset)
        .def_readonly("nbytes", &Request::nbytes)
        .def_readonly("write", &Request::write);
    py::class_<Engine>(aio, "Engine")
        .def(py::init<int64_t, int, int, bool, bool, bool, int>(), py::arg("block_size"), py::arg("queue_depth"),
             py::arg("threads"), py::arg("single_submit"), py::arg("overlap_events"), py::arg("use_kaio") = true,
             py::arg("crc_path") = static_cast<int>(infinity_crc::best_path()))
        .def("submit", &Engine::submit, py::arg("write"), py::arg("fd"), py::arg("path"), py::arg("address"),
             py::arg("offset"), py::arg("nbytes"), py::arg("crc_bytes") = 0, py::call_guard<py::gil_scoped_release>(),
             "Queue a read (write=False) or write of nbytes at address <-> file offset; returns a Request at once.\n"
             "With crc_bytes > 0 the request's crc32c is that of its first crc_bytes bytes as transferred.")
        .def("shutdown", &Engine::shutdown, py::call_guard<py::gil_scoped_release>(),
             "Finish queued and in-flight chunks, then stop the workers.")
        .def_property_readonly("submitter", &Engine::submitter);
}
