"""Collectives over flat buffers (all-gather, reduce-scatter, all-reduce) and process-group set-up."""

from infinity.comm.collectives import CommError, CommGroup
from infinity.comm.process_group import init_distributed

__all__ = ["CommError", "CommGroup", "init_distributed"]
