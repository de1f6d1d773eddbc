// A caching CPU allocator for torch: keeps freed large blocks for reuse, up to a byte cap.
//
// Under a host budget glibc returns every buffer over its mmap threshold to the OS when it is freed, so
// each large tensor autograd makes (a layer's weight gradients, its activations) is a fresh mapping the
// kernel must fault in and zero again; in a VM that reports free pages to its host, the host must also
// back them again, and touching memory freed a few seconds before cost up to 1 s per 180 MB here. The
// same shapes come back every layer, so keeping freed blocks (exact size first, then the smallest that
// fits within 1/8 slack) turns those faults into reuse. Blocks below `min_bytes` stay with c10's allocator.
//
// This is the one piece of native code that knows torch (c10's Allocator interface); it is its own
// extension so that the kernels and the I/O engine build and load without torch.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <pthread.h>
#include <pybind11/pybind11.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <list>
#include <mutex>
#include <unordered_map>

namespace py = pybind11;

namespace {

constexpr size_t kPage = 4096;
constexpr size_t kHugePage = 2u << 20;

struct Stats {
  uint64_t hits = 0, misses = 0, returned = 0;
  size_t live_bytes = 0, cached_bytes = 0, peak_bytes = 0;  // peak: live + cached, the blocks' share of RSS
};

class CachingHostAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    void* p = n >= min_bytes_ ? take(n) : c10::alloc_cpu(n);
    return {p, p, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, size_t count) const override { default_copy_data(dest, src, count); }

  void configure(size_t cap_bytes, size_t min_bytes, bool huge_pages, bool poison) {
    std::list<Block> dropped;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      cap_bytes_ = cap_bytes;
      min_bytes_ = std::max(min_bytes, kPage);
      huge_pages_ = huge_pages;
      poison_ = poison;
      trim(dropped);
    }
    unmap(dropped);
  }
  Stats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }
  static void release(void* p) { instance().give_back(p); }
  static CachingHostAllocator& instance() {
    static auto* allocator = [] {
      // a fork (a DataLoader worker) while another thread holds the lock would leave the child's locked
      pthread_atfork([] { instance().mutex_.lock(); }, [] { instance().mutex_.unlock(); },
                     [] { instance().mutex_.unlock(); });
      return new CachingHostAllocator();  // never destroyed: live tensors hold its deleter
    }();
    return *allocator;
  }

 private:
  struct Block {
    void* ptr;
    size_t bytes;
  };

  size_t rounded(size_t n) const {
    size_t unit = huge_pages_ && n >= kHugePage ? kHugePage : kPage;
    return (n + unit - 1) / unit * unit;
  }

  void* take(size_t n) {
    void* p = lend(n);
    if (poison_) std::memset(p, 0xFF, n);  // tests: NaN in every float, so code that reads before it writes shows
    return p;
  }

  void* lend(size_t n) {
    size_t want = rounded(n);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto best = free_.end();
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->bytes >= want && it->bytes <= want + want / 8 && (best == free_.end() || it->bytes < best->bytes)) {
          best = it;
          if (it->bytes == want) break;
        }
      }
      if (best != free_.end()) {
        Block b = *best;
        free_.erase(best);
        stats_.cached_bytes -= b.bytes;
        stats_.live_bytes += b.bytes;
        stats_.hits++;
        live_.emplace(b.ptr, b.bytes);
        return b.ptr;
      }
    }
    void* p = map(want);
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.misses++;
    stats_.live_bytes += want;
    stats_.peak_bytes = std::max(stats_.peak_bytes, stats_.live_bytes + stats_.cached_bytes);
    live_.emplace(p, want);
    return p;
  }

  void give_back(void* p) {
    if (p == nullptr) return;
    std::list<Block> dropped;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = live_.find(p);
      if (it == live_.end()) {
        c10::free_cpu(p);  // a small block: c10's own
        return;
      }
      Block b{it->first, it->second};
      live_.erase(it);
      stats_.live_bytes -= b.bytes;
      free_.push_back(b);  // newest at the back; trimming drops the oldest first
      stats_.cached_bytes += b.bytes;
      trim(dropped);
    }
    unmap(dropped);
  }

  void trim(std::list<Block>& dropped) {
    while (stats_.cached_bytes > cap_bytes_ && !free_.empty()) {
      stats_.cached_bytes -= free_.front().bytes;
      stats_.returned++;
      dropped.splice(dropped.end(), free_, free_.begin());
    }
  }

  void* map(size_t bytes) {
    bool huge = huge_pages_ && bytes >= kHugePage;
    size_t extra = huge ? kHugePage : 0;  // over-map, then trim to a 2 MiB boundary so whole pages are huge
    void* raw = mmap(nullptr, bytes + extra, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK(raw != MAP_FAILED, "infinity's host allocator: not enough memory: you tried to map ", bytes, " bytes");
    auto start = reinterpret_cast<uintptr_t>(raw);
    uintptr_t aligned = huge ? (start + kHugePage - 1) & ~(kHugePage - 1) : start;
    if (aligned > start) munmap(raw, aligned - start);
    if (extra > aligned - start) munmap(reinterpret_cast<void*>(aligned + bytes), extra - (aligned - start));
    if (huge) madvise(reinterpret_cast<void*>(aligned), bytes, MADV_HUGEPAGE);
    return reinterpret_cast<void*>(aligned);
  }

  static void unmap(std::list<Block>& blocks) {
    for (auto& b : blocks) munmap(b.ptr, b.bytes);  // outside the lock: munmap of a large block is slow
  }

  std::mutex mutex_;
  std::unordered_map<void*, size_t> live_;
  std::list<Block> free_;
  Stats stats_;
  size_t cap_bytes_ = 0;
  // read outside the lock by every allocation
  std::atomic<size_t> min_bytes_{1u << 20};
  std::atomic<bool> huge_pages_{false};
  std::atomic<bool> poison_{false};
};

c10::Allocator* previous = nullptr;

void install(size_t cap_bytes, size_t min_bytes, bool huge_pages, bool poison) {
  auto& allocator = CachingHostAllocator::instance();
  allocator.configure(cap_bytes, min_bytes, huge_pages, poison);
  if (c10::GetCPUAllocator() != &allocator) {
    previous = c10::GetCPUAllocator();
    c10::SetCPUAllocator(&allocator, /*priority=*/1);
  }
}

void uninstall() {
  auto& allocator = CachingHostAllocator::instance();
  if (c10::GetCPUAllocator() == &allocator && previous != nullptr) c10::SetCPUAllocator(previous, /*priority=*/1);
  allocator.configure(0, 1u << 20, false, false);  // returns what it kept; blocks still live come back to it and go
}

}  // namespace

PYBIND11_MODULE(_host_allocator, m) {
  m.doc() = "A caching CPU allocator for torch: freed blocks of at least min_bytes kept for reuse, up to a cap";
  m.def("install", &install, py::arg("cap_bytes"), py::arg("min_bytes") = 1u << 20, py::arg("huge_pages") = false,
        py::arg("poison") = false,
        "Make torch's CPU allocations go through the cache (again, with new settings); `poison` (tests) fills "
        "every block it lends with 0xFF bytes.");
  m.def("uninstall", &uninstall, "Give torch back its previous CPU allocator and return the cached blocks.");
  m.def("installed", [] { return c10::GetCPUAllocator() == &CachingHostAllocator::instance(); });
  m.def("stats", [] {
    Stats s = CachingHostAllocator::instance().stats();
    py::dict d;
    d["hits"] = s.hits;
    d["misses"] = s.misses;
    d["returned"] = s.returned;
    d["live_bytes"] = s.live_bytes;
    d["cached_bytes"] = s.cached_bytes;
    d["peak_bytes"] = s.peak_bytes;
    return d;
  });
}
