// Removal of registered files (the live swap files) when a signal ends the process.
//
// A signal whose disposition is the default (SIGTERM from `kill` or a torchrun abort, SIGHUP when
// the terminal goes, SIGINT where no Python handler turns it into KeyboardInterrupt) kills the
// process without running Python's exit handlers, so the swap files would stay behind. The handler
// installed here runs at delivery, whatever the main thread is blocked in (a collective, a disk
// wait): it unlinks each file this process registered, if the path still names the registered
// inode, then restores the default action and re-raises, so the process ends as the signal would
// (same exit status). Only async-signal-safe calls (getpid, stat, unlink, sigaction, raise) run in
// it. A handler someone installed (Python's KeyboardInterrupt, a program's own SIGTERM handler) or
// an ignored signal is left alone: that program decides, and Python's exit handlers remove the files.
// Forked children inherit the handler but never unlink their parent's files (the pid is checked).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int kSlots = 256;
enum SlotState : int { kFree = 0, kFilling = 1, kLive = 2 };

struct Slot {
    std::atomic<int> state{kFree};
    pid_t pid = 0;
    dev_t dev = 0;
    ino_t ino = 0;
    char path[PATH_MAX] = {};
};

Slot g_slots[kSlots];
std::mutex g_install_mu;

void remove_registered_files() {
    const pid_t me = getpid();
    for (auto& slot : g_slots) {
        if (slot.state.load(std::memory_order_acquire) != kLive || slot.pid != me) continue;
        struct stat st {};
        if (stat(slot.path, &st) == 0 && st.st_dev == slot.dev && st.st_ino == slot.ino) unlink(slot.path);
    }
}

void on_terminating_signal(int sig) {
    const int saved_errno = errno;
    remove_registered_files();
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, nullptr);
    raise(sig);  // blocked while this handler runs; delivered with the default action when it returns
    errno = saved_errno;
}

// Installs the handler for each signal still at its default disposition; returns those it took.
std::vector<int> install(const std::vector<int>& signals) {
    std::lock_guard<std::mutex> g(g_install_mu);
    std::vector<int> taken;
    for (int sig : signals) {
        if (sig <= 0 || sig >= NSIG) throw py::value_error("not a signal number: " + std::to_string(sig));
        struct sigaction old {};
        if (sigaction(sig, nullptr, &old) != 0) continue;
        bool ours = !(old.sa_flags & SA_SIGINFO) && old.sa_handler == on_terminating_signal;
        if (ours) {
            taken.push_back(sig);
            continue;
        }
        if ((old.sa_flags & SA_SIGINFO) || old.sa_handler != SIG_DFL) continue;  // someone else's, or ignored
        struct sigaction act {};
        act.sa_handler = on_terminating_signal;
        sigfillset(&act.sa_mask);  // nothing else runs on this thread while the files go
        if (sigaction(sig, &act, nullptr) == 0) taken.push_back(sig);
    }
    return taken;
}

int register_file(const std::string& path, uint64_t dev, uint64_t ino) {
    if (path.size() >= PATH_MAX) throw py::value_error("path too long to register: " + path);
    for (int i = 0; i < kSlots; ++i) {
        int expected = kFree;
        if (!g_slots[i].state.compare_exchange_strong(expected, kFilling, std::memory_order_acq_rel)) continue;
        Slot& slot = g_slots[i];
        slot.pid = getpid();
        slot.dev = static_cast<dev_t>(dev);
        slot.ino = static_cast<ino_t>(ino);
        std::memcpy(slot.path, path.c_str(), path.size() + 1);
        slot.state.store(kLive, std::memory_order_release);
        return i;
    }
    return -1;  // full: the file is still removed at a normal exit and by the next run
}

void unregister_file(int slot) {
    if (slot >= 0 && slot < kSlots) g_slots[slot].state.store(kFree, std::memory_order_release);
}

}  // namespace

void register_exit_cleanup(py::module_& m) {
    auto sub = m.def_submodule("exit_cleanup", "remove registered files when a default-action signal ends the process");
    sub.def("install", &install, py::arg("signals"),
            "Handle each signal still at its default action; returns the signals handled (ours, now or before).");
    sub.def("register_file", &register_file, py::arg("path"), py::arg("dev"), py::arg("ino"),
            "Remove `path` (if it is still inode dev/ino) when such a signal ends this process; a slot id or -1.");
    sub.def("unregister_file", &unregister_file, py::arg("slot"));
}
