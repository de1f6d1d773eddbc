"""What goes wrong with a checkpoint: the errors every checkpoint module raises."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint is missing, damaged or was written by an incompatible run."""


class RunMismatch(CheckpointError):
    """A whole checkpoint written by a run this one cannot continue (another model, layout or world size):
    no other checkpoint of that run would do either."""
