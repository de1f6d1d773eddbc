"""Wiring: initialize(), forward/backward/step, accumulation, clipping, mixed precision."""

from infinity.engine.engine import InfinityEngine
from infinity.engine.gathered import GatheredParameters
from infinity.engine.initialize import initialize

__all__ = ["GatheredParameters", "InfinityEngine", "initialize"]
