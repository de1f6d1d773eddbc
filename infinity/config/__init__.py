"""One typed config, loaded from DeepSpeed-style JSON and validated with errors that name the key."""

from infinity.config.auto import AutoValues, resolve_auto, unresolved_auto_keys
from infinity.config.config import InfinityConfig, load_config, resolve_batch_sizes
from infinity.config.deepspeed_only import DEEPSPEED_ONLY
from infinity.config.notices import NO_EFFECT, no_effect_notices
from infinity.config.schema import AUTO, ConfigError
from infinity.config.sections import (
    AioConfig,
    BF16Config,
    FP16Config,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerConfig,
    ProfilerConfig,
    SchedulerConfig,
    ZeroConfig,
)

__all__ = [
    "AUTO",
    "AioConfig",
    "AutoValues",
    "BF16Config",
    "ConfigError",
    "DEEPSPEED_ONLY",
    "FP16Config",
    "InfinityConfig",
    "NO_EFFECT",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "ProfilerConfig",
    "SchedulerConfig",
    "ZeroConfig",
    "load_config",
    "no_effect_notices",
    "resolve_auto",
    "resolve_batch_sizes",
    "unresolved_auto_keys",
]
