"""CPU optimizers: the native SIMD Adam/AdamW, per flat shard or as torch optimizers."""

from infinity.optim.cpu_adam import CPUAdam, CPUAdamW, adam_step_flat, check_hyperparameters
from infinity.optim.simd import SIMD_ENV_VAR, SIMD_PATHS, resolve_simd, supported_paths
from infinity.shards.moments import MOMENT_FORMATS, MomentFormat, moment_format

__all__ = [
    "CPUAdam",
    "CPUAdamW",
    "MOMENT_FORMATS",
    "MomentFormat",
    "SIMD_ENV_VAR",
    "SIMD_PATHS",
    "adam_step_flat",
    "check_hyperparameters",
    "moment_format",
    "resolve_simd",
    "supported_paths",
]
