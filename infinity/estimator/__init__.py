"""How much device, host and NVMe memory the model states need at each ZeRO stage and offload choice.

In the spirit of DeepSpeed's `estimate_zero3_model_states_mem_needs`, but for infinity's own layout: the
bytes of every slot as the engine lays them out (`engine.memory_plan.home_bytes`), which `estimate` must
match (tests/test_estimator_engine.py builds engines and compares). N = gpus_per_node x nodes ranks, b
bytes per compute-dtype weight (2 for bf16/fp16, 4 for fp32). The model is a list of flats (one per block
and the root, `ModelSize.flat_params`; a bare count is taken as flats of its largest block); a flat of n
elements has on each rank a shard of S = ceil(n / N) elements rounded up to 1024 (SHARD_ALIGN_ELEMS), and
every slot in host memory or on NVMe is rounded up to 4 KiB. Parameters that do not require gradients form
flats of their own (`ModelSize.frozen_flat_params`) that hold the parameter slot alone. Per rank and
trainable flat:

- parameters: b*S on the `offload_param` tier; stages 1-2 (and one rank at stage 3, with the parameters in
  the compute's memory) keep the whole padded flat there, b*S*N: parameters replicated on every device;
- fp32 master 4*S on the `offload_optimizer` tier, except in fp32 with parameters and optimizer on one tier
  (NVMe included): then the parameter slot is the master;
- Adam's moments, `MomentFormat.state_bytes(S)` in the `moments` format: fp32 8*S, bf16 4*S, 8bit ~2.03*S;
- gradient accumulator 4*S beside the optimizer state, except on NVMe where the step runs as each shard's
  final gradient arrives: only where gradients must wait (`clip`: clipping or fp16's overflow check, or
  `accumulation` > 1) do they get an NVMe slot. Stage 2 reduce-scatters each block's gradients into it,
  stage 1 all-reduces the block's whole gradient and keeps its slice: the same slots.

Besides the slots: the device working set, the running block's gradients and their reduction buffer
(2b*L for the largest block of L elements) and, at stage 3 unless resident, the gathered weights of the
running and the prefetched block (2b*L); host staging per rank where a tier is NVMe, as the memory plan
budgets it: parameters b * max(param_buffer_elems, 4*B) (offload_param buffer_count x buffer_size), for
B = ceil(L / N) + 1024; optimizer 4*F for the gradient read-modify-write and (window + 1) x (8*F + the
moments of F) for the shards in flight (offload_optimizer.buffer_count), F the largest flat's shard.

`device_bytes` is per device; `host_bytes` and `nvme_bytes` are per node (gpus_per_node ranks). Without
CUDA the device tier is host memory (`device_is_host`, which also lets an fp32 master share a 'none'
parameter's memory with a 'cpu' optimizer). Activations, the CUDA context and allocator fragmentation
are not included: leave headroom for them. `stages` says which stage and offload fit a machine and what
each moves between ranks.
"""

from infinity.estimator.layout import (
    OFFLOAD_CHOICES,
    OFFLOADS,
    STAGE_CHOICES,
    MemoryNeed,
    estimate,
    home_bytes_per_rank,
    host_resident_bytes,
)
from infinity.estimator.machine import (
    Machine,
    available_host_bytes,
    describe,
    fits,
    format_bytes,
    format_params,
    probe_machine,
    shortfall,
)
from infinity.estimator.sizes import ModelSize, gpt_model_size, module_size, size_from_params
from infinity.estimator.stages import (
    StageAdvice,
    StageRow,
    advise,
    collective_bytes_per_step,
    fit_line,
    largest_fitting_params,
    stage_table,
)

__all__ = [
    "OFFLOADS",
    "OFFLOAD_CHOICES",
    "STAGE_CHOICES",
    "Machine",
    "MemoryNeed",
    "ModelSize",
    "StageAdvice",
    "StageRow",
    "advise",
    "available_host_bytes",
    "collective_bytes_per_step",
    "describe",
    "estimate",
    "fit_line",
    "fits",
    "format_bytes",
    "format_params",
    "gpt_model_size",
    "home_bytes_per_rank",
    "host_resident_bytes",
    "largest_fitting_params",
    "module_size",
    "probe_machine",
    "shortfall",
    "size_from_params",
    "stage_table",
]
