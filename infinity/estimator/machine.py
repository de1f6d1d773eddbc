"""What this machine offers, whether a need fits it, and how figures are printed."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from infinity.estimator.layout import MemoryNeed


@dataclass(frozen=True)
class Machine:
    """What this machine offers: device memory per device (None without CUDA: the device is the host),
    devices per node, available host memory and free disk at the NVMe path."""

    device_bytes: int | None
    devices: int
    host_bytes: int
    nvme_bytes: int
    nvme_path: str

    @property
    def device_is_host(self) -> bool:
        return self.device_bytes is None


def shortfall(need: MemoryNeed, machine: Machine, ranks_here: int | None = None) -> str | None:
    """What `need` lacks on `machine` ("host memory: needs 12.00 GB, 8.00 GB available"), None if it fits.
    Without CUDA the device tier is host memory too, `ranks_here` (default: the machine's devices) of them."""
    short = []
    if machine.device_bytes is None:
        ranks = machine.devices if ranks_here is None else ranks_here
        host_need = need.device_bytes * ranks + need.host_bytes
        if host_need > machine.host_bytes:
            short.append(f"host memory: needs {format_bytes(host_need)}, {format_bytes(machine.host_bytes)} available")
    else:
        if need.device_bytes > machine.device_bytes:
            short.append(f"device memory: needs {format_bytes(need.device_bytes)} per device, "
                         f"{format_bytes(machine.device_bytes)} each")  # fmt: skip
        if need.host_bytes > machine.host_bytes:
            short.append(f"host memory: needs {format_bytes(need.host_bytes)}, "
                         f"{format_bytes(machine.host_bytes)} available")  # fmt: skip
    if need.nvme_bytes > machine.nvme_bytes:
        short.append(f"disk: needs {format_bytes(need.nvme_bytes)}, {format_bytes(machine.nvme_bytes)} free at "
                     f"{machine.nvme_path}")  # fmt: skip
    return "; ".join(short) or None


def fits(need: MemoryNeed, machine: Machine, ranks_here: int | None = None) -> bool:
    """Whether `need` fits `machine`; without CUDA the device tier is host memory too (see `shortfall`)."""
    return shortfall(need, machine, ranks_here) is None


def available_host_bytes() -> int:
    """Host memory available to a new process (MemAvailable on Linux, else physical memory)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def probe_machine(nvme_path: str | os.PathLike = ".") -> Machine:
    """This machine's CUDA devices (the smallest one's total memory), available host memory and free disk."""
    import torch

    path = Path(nvme_path)
    while not path.exists() and path != path.parent:
        path = path.parent  # the folder may not exist yet: measure the disk it will be on
    free = shutil.disk_usage(path).free
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        device = min(torch.cuda.get_device_properties(i).total_memory for i in range(count))
        return Machine(device, count, available_host_bytes(), free, str(path))
    return Machine(None, 1, available_host_bytes(), free, str(path))


def describe(machine: Machine) -> str:
    device = (
        f"{machine.devices} GPU(s) of {format_bytes(machine.device_bytes)}"
        if machine.device_bytes is not None
        else "no GPU (the device tier is host memory)"
    )
    return (
        f"{device}, {format_bytes(machine.host_bytes)} host memory available, "
        f"{format_bytes(machine.nvme_bytes)} free disk at {machine.nvme_path}"
    )


def format_bytes(n: float) -> str:
    """Decimal units, as disks and `nvidia-smi` count: 1.50 GB, 320.00 MB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def format_params(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))
