"""Turning a module's parameters into sharded flat buffers, block by block."""

from infinity.partition.blocks import BlockPlan, plan_blocks
from infinity.partition.flat_param import FlatParam, ParamSlot

__all__ = ["BlockPlan", "FlatParam", "ParamSlot", "plan_blocks"]
