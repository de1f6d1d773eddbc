"""When to gather and release blocks: module hooks, the recorded execution order, the prefetch window."""

from infinity.scheduler.block_scheduler import BlockScheduler
from infinity.scheduler.gather_window import Phase
from infinity.scheduler.trace import ExecutionTrace

__all__ = ["BlockScheduler", "ExecutionTrace", "Phase"]
