"""The engine's state in and out: sharded checkpoints, 16-bit weights and full state dicts.

A mixin of `InfinityEngine` (its `shards`, `module`, `optimizer`, run counters and config): each verb
refuses to run mid-step, then hands the shard store to the checkpoint and state-io modules.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch


class EngineStateIO:
    """Checkpoint and full-weight verbs of the engine; every rank calls each of them."""

    def save_checkpoint(
        self, save_dir: str, tag: str | None = None, client_state: dict | None = None, save_latest: bool = True
    ) -> str:
        """Write a sharded checkpoint (every rank calls this); returns its folder."""
        from infinity.engine.checkpoint import save_checkpoint
        from infinity.engine.checkpoint_tag import agree_on_tag

        self.optimizer.refuse_mid_step("save_checkpoint")
        tag = agree_on_tag(self.comm, tag or f"global_step{self.global_steps}", self.config.checkpoint.tag_validation)
        folder = save_checkpoint(
            save_dir, tag, self.shards, self.module, self._run_state(), client_state or {}, save_latest
        )
        if self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
            self.save_16bit_model(str(folder))  # as HF's Trainer does at each save with this key set
        return str(folder)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's: the consolidated compute-dtype weights in save_dir/save_filename (True); at stage 3 only
        when `stage3_gather_16bit_weights_on_model_save` is set, else nothing (False). Every rank calls it."""
        from infinity.engine.weights16 import save_16bit_model

        self.optimizer.refuse_mid_step("save_16bit_model")
        z = self.config.zero_optimization
        enabled = z.stage3_gather_16bit_weights_on_model_save or z.stage < 3  # stages 1-2: whole on every rank
        return save_16bit_model(self.shards, self.module, enabled, save_dir, save_filename)

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str | None, dict | None]:
        """Restore a checkpoint written by `save_checkpoint`; returns (its folder, the client state), or, as
        DeepSpeed does, (None, None) with a warning where `load_dir` holds nothing yet (missing or empty: a first
        run of a loop that resumes when it can). A folder with checkpoints but no usable `latest` is an error."""
        from infinity.engine.checkpoint import load_checkpoint

        if tag is None and _holds_nothing(load_dir):
            warnings.warn(f"load_checkpoint: '{load_dir}' holds no checkpoint yet; nothing was loaded", stacklevel=2)
            return None, None
        self.optimizer.refuse_mid_step("load_checkpoint")
        optimizer_too = load_optimizer_states and not load_module_only
        folder, client_state, saved = load_checkpoint(
            load_dir,
            tag,
            self.shards,
            self.module,
            optimizer_too,
            restore_rng=not load_module_only,
            elastic=self.config.zero_optimization.elastic_checkpoint,
        )
        if optimizer_too:
            for group, saved_group in zip(self.optimizer.param_groups, saved.param_groups, strict=True):
                group.update(saved_group)
        if not load_module_only:
            self.global_steps, self.micro_steps = saved.global_steps, saved.micro_steps
            self.loss_scaler.load_state_dict(saved.loss_scaler)
        if load_lr_scheduler_states and not load_module_only and self.lr_scheduler is not None:
            if saved.lr_scheduler is not None:
                self.lr_scheduler.load_state_dict(saved.lr_scheduler)
        self.persistent.reshard()  # re-gathered from the restored shards at the next forward
        return str(folder), client_state

    def _run_state(self):
        from infinity.engine.checkpoint import RunState

        return RunState(
            global_steps=self.global_steps,
            micro_steps=self.micro_steps,
            loss_scaler=self.loss_scaler.state_dict(),
            lr_scheduler=self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            param_groups=[{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
        )

    def iter_full_state(self):
        """Yield (name, full fp32 CPU tensor) block by block; every rank must iterate it to the end."""
        from infinity.engine.state_io import iter_full_state

        self.optimizer.refuse_mid_step("reading the optimizer state (a checkpoint, full weights)")
        return iter_full_state(self.shards, self.module)

    def load_full_state(self, source, strict: bool = True) -> list[str]:
        """Load pretrained weights (a state dict, a torch file or a folder of safetensors), block by block."""
        from infinity.engine.state_io import load_full_state

        self.optimizer.refuse_mid_step("load_full_state")
        return load_full_state(self.shards, self.module, source, strict)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        from infinity.engine.state_io import full_state_dict

        self.optimizer.refuse_mid_step("reading the optimizer state (a checkpoint, full weights)")
        return full_state_dict(self.shards, self.module)


def _holds_nothing(load_dir: str | os.PathLike) -> bool:
    """`load_dir` is missing, or a folder with nothing but the staging folder of a first save that never
    finished (`.tag.tmp`, left by a killed process): no checkpoint was ever published there."""
    root = Path(load_dir)
    if not root.exists():
        return True
    return root.is_dir() and all(p.name.startswith(".") and p.name.endswith(".tmp") for p in root.iterdir())
