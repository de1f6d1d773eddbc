"""Collectives over flat buffers (all-gather, reduce-scatter, all-reduce), process-group set-up, and the
heartbeat that ends a run whose peer has stopped."""

from infinity.comm.abort import end_process
from infinity.comm.buffers import CollectiveBuffers
from infinity.comm.collectives import CommDeviceError, CommError, CommGroup
from infinity.comm.heartbeat import Heartbeat, PeerSilentError, start_heartbeat
from infinity.comm.process_group import bind_compute_device, comm_device, init_distributed

__all__ = [
    "CollectiveBuffers",
    "CommDeviceError",
    "CommError",
    "CommGroup",
    "Heartbeat",
    "PeerSilentError",
    "bind_compute_device",
    "comm_device",
    "end_process",
    "init_distributed",
    "start_heartbeat",
]
