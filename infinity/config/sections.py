"""The config sections, with DeepSpeed's key names and defaults where DeepSpeed has the key.

Each section is a frozen dataclass; `schema.parse_section` validates it once at the edge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infinity.config.params import optimizer_params, scheduler_params
from infinity.config.schema import ConfigError, option

OFFLOAD_DEVICES = ("none", "cpu", "nvme")
MOMENT_FORMATS = ("fp32", "bf16", "8bit")  # infinity.shards.moments.MOMENT_FORMATS (config imports no shards)


@dataclass(frozen=True)
class AioConfig:
    """The async direct-I/O engine (DeepSpeed's `aio` section)."""

    block_size: int = option(1048576, min_value=4096, doc="bytes per I/O piece; a multiple of 4096")
    queue_depth: int = option(
        16, min_value=1, max_value=8192,
        doc="requests in flight per worker thread (DeepSpeed's default is 8; see README)",
    )
    intra_op_parallelism: int = option(
        1, aliases=("thread_count",), min_value=1, max_value=1024, doc="worker threads splitting each request"
    )
    single_submit: bool = option(False)
    overlap_events: bool = option(True)
    use_gds: bool = option(False, doc="accepted for DeepSpeed compatibility; GPUDirect is not used")

    def __post_init__(self) -> None:
        if self.block_size % 4096:
            raise ConfigError(f"'aio.block_size' is {self.block_size}; it must be a multiple of 4096")


@dataclass(frozen=True)
class OffloadParamConfig:
    """Where each rank's parameter shards live between uses (`zero_optimization.offload_param`)."""

    device: str = option("none", choices=OFFLOAD_DEVICES)
    nvme_path: str | None = option(None)
    pin_memory: bool = option(False)
    buffer_count: int = option(5, min_value=1)
    buffer_size: int = option(100_000_000, min_value=1, doc="elements per host staging buffer")
    max_in_cpu: int = option(1_000_000_000, min_value=0, doc="parameter elements kept in host memory")


@dataclass(frozen=True)
class OffloadOptimizerConfig:
    """Where fp32 master weights and Adam moments live (`zero_optimization.offload_optimizer`)."""

    device: str = option("none", choices=OFFLOAD_DEVICES)
    nvme_path: str | None = option(None)
    pin_memory: bool = option(False)
    buffer_count: int = option(
        4,
        min_value=1,
        doc="shards of optimizer state in host memory at once (on NVMe); a step of more shards keeps half of "
        "them for the next shards' reads while the last ones are written back; a step deferred into the next "
        "forward holds more where no host_budget_bytes is set and memory is spare",
    )
    pipeline_read: bool = option(
        True, doc="read the next shards' optimizer state while one is stepped (false: each when it is stepped)"
    )
    pipeline_write: bool = option(
        True, doc="write a stepped shard's state back while the next is stepped (false: wait for each write)"
    )
    recompute_gradients: bool = option(
        True,
        doc="on NVMe, with a step deferred into the next forward (clipping, fp16, a client optimizer) and its "
        "gradients waiting on NVMe (host_budget_bytes set), one micro-batch per step: recompute each block's "
        "gradient when its step runs (one more forward and backward of the block) instead of writing it in "
        "backward and reading it back",
    )
    fast_init: bool = option(False)
    ratio: float = option(1.0, min_value=0.0, max_value=1.0)
    moments: str = option(
        "fp32",
        choices=MOMENT_FORMATS,
        doc="how Adam's exp_avg and exp_avg_sq are stored: fp32 (exact, 8 bytes/param), bf16 (4 bytes/param) "
        "or 8bit (blockwise-quantized, about 2 bytes/param); bf16 and 8bit need device cpu or nvme",
    )

    def __post_init__(self) -> None:
        if self.moments != "fp32" and self.device == "none":
            raise ConfigError(
                f"'zero_optimization.offload_optimizer.moments' is {self.moments!r} but "
                "'zero_optimization.offload_optimizer.device' is 'none': compressed moments are stepped by the "
                "native CPU Adam only; set the device to 'cpu' or 'nvme', or moments to 'fp32'"
            )


@dataclass(frozen=True)
class ZeroConfig:
    """`zero_optimization`: sharding stage, offload sections and the stage-3 scheduling knobs."""

    stage: int = option(3, choices=(0, 1, 2, 3))
    offload_param: OffloadParamConfig = option(default_factory=OffloadParamConfig)
    offload_optimizer: OffloadOptimizerConfig = option(default_factory=OffloadOptimizerConfig)
    block_classes: tuple[str, ...] = option((), doc="module class names that form one block each")
    block_size_elems: int = option(
        10_000_000, min_value=1, doc="without block_classes: group modules into blocks of about this size"
    )
    stage3_prefetch_bucket_size: int = option(
        50_000_000, min_value=0, allow_auto=True, allow_bytes=True, doc='elements, or bytes with a unit ("64MB")'
    )
    stage3_param_persistence_threshold: int = option(100_000, min_value=0, allow_auto=True)
    stage3_max_live_parameters: int = option(1_000_000_000, min_value=0)
    stage3_max_reuse_distance: int = option(
        1_000_000_000,
        min_value=0,
        doc="elements: a block used again within this many gathered elements is not resharded in between "
        "(within one forward, and from forward into the blocks backward's first prefetch takes)",
    )
    stage3_gather_16bit_weights_on_model_save: bool = option(
        False, aliases=("stage3_gather_fp16_weights_on_model_save",)
    )
    reduce_bucket_size: int = option(500_000_000, min_value=1, allow_auto=True)
    allgather_bucket_size: int = option(500_000_000, min_value=1)
    sub_group_size: int = option(1_000_000_000, min_value=1)
    contiguous_gradients: bool = option(True)
    overlap_comm: bool = option(True)
    reduce_scatter: bool = option(True)
    allgather_partitions: bool = option(True)
    round_robin_gradients: bool = option(False)
    elastic_checkpoint: bool = option(False)
    ignore_unused_parameters: bool = option(True)
    comm_timeout_s: float = option(600.0, min_value=1.0, doc="a collective waiting longer aborts the run")
    heartbeat_timeout_s: float = option(
        60.0,
        min_value=0.0,
        doc="a peer rank whose heartbeat stops this long (stopped, hung, host unreachable) ends the run with a "
        "message naming it, long before comm_timeout_s; 0: no heartbeat",
    )
    host_budget_bytes: int | None = option(
        None,
        min_value=0,
        doc="host memory for shards and staging (set: freed memory returns to the OS at once); "
        "default: derived from the offload buffers",
    )
    device_budget_bytes: int | None = option(
        None, min_value=0, doc="device memory for fetched shards (on a CPU-only machine: a pool apart); default: no cap"
    )


@dataclass(frozen=True)
class FP16Config:
    """`fp16`: half-precision compute with dynamic (loss_scale 0) or static loss scaling."""

    enabled: bool = option(False, allow_auto=True)
    auto_cast: bool = option(False)
    loss_scale: float = option(0.0, min_value=0.0)
    initial_scale_power: int = option(16, min_value=0, max_value=64)
    loss_scale_window: int = option(1000, min_value=1)
    hysteresis: int = option(2, min_value=1)
    consecutive_hysteresis: bool = option(False)
    min_loss_scale: float = option(1.0, min_value=0.0)


@dataclass(frozen=True)
class BF16Config:
    """`bf16`: bfloat16 compute with fp32 master weights."""

    enabled: bool = option(False, allow_auto=True)


@dataclass(frozen=True)
class OptimizerConfig:
    """`optimizer`: type and its params, as DeepSpeed writes them."""

    type: str = option(choices=("Adam", "AdamW", "adam", "adamw"))
    params: dict[str, Any] = option(default_factory=dict)

    def __post_init__(self) -> None:
        optimizer_params(self.type, self.params)  # raises ConfigError naming the bad key


@dataclass(frozen=True)
class SchedulerConfig:
    """`scheduler`: type and its params, as DeepSpeed writes them."""

    type: str = option(choices=("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"))
    params: dict[str, Any] = option(default_factory=dict)

    def __post_init__(self) -> None:
        scheduler_params(self.type, self.params)  # raises ConfigError naming the bad key


@dataclass(frozen=True)
class ProfilerConfig:
    """`profiler`: swap-traffic recording, steps [start_step, end_step] inclusive."""

    enabled: bool = option(False)
    path: str = option("infinity_trace")
    start_step: int = option(0, min_value=0)
    end_step: int = option(1_000_000_000, min_value=0)


@dataclass(frozen=True)
class CheckpointConfig:
    """`checkpoint`: accepted DeepSpeed keys."""

    tag_validation: str = option("Warn", choices=("Ignore", "Warn", "Fail"))
    load_universal: bool = option(False)
    use_node_local_storage: bool = option(False)
