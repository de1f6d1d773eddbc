"""Collectives over flat buffers (all-gather, reduce-scatter, all-reduce) and process-group set-up."""

from infinity.comm.collectives import CommDeviceError, CommError, CommGroup
from infinity.comm.process_group import bind_compute_device, comm_device, init_distributed

__all__ = ["CommDeviceError", "CommError", "CommGroup", "bind_compute_device", "comm_device", "init_distributed"]
