"""infinity: train PyTorch models too large for the hardware they run on."""

from infinity.config import ConfigError, InfinityConfig, load_config
from infinity.engine import GatheredParameters, InfinityEngine, initialize
from infinity.partition.init import Init

__version__ = "0.1.0"

__all__ = ["ConfigError", "GatheredParameters", "Init", "InfinityConfig", "InfinityEngine", "initialize", "load_config"]
