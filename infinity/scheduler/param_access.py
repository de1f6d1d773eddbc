"""Parameters read outside their block: seen as they are read, so a model needs no change.

A block's parameters are empty tensors while the block is sharded. A model may still read one from
elsewhere: the parent's `F.linear(h, self.embed.weight)` with `embed` inside a block, a weight handed
to a functional call in another block, a block's submodule called directly by the parent. Every
module that owns block parameters gets a `_parameters` mapping that reports each read to the
scheduler (`nn.Module.__getattr__` reads parameters through `_parameters[name]`; `parameters()`,
`state_dict()` and the like iterate it and report nothing). The scheduler decides what a read means.

`ExternalReads` is the scheduler's record of such reads: per reader (a running block, or the root),
the blocks it read in its current call and over the whole forward pass (its backward needs them
again), and the blocks read by the root with autograd on, which stay gathered for the step.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from infinity.partition.sharded_block import ShardedBlock


class ParamAccessDict(dict):
    """A module's `_parameters` that calls `on_read(block)` when a parameter of a block is read by name, and
    counts the reads of each name (`reads`)."""

    __slots__ = ("_block_of", "_on_read", "reads")

    def __init__(self, params: dict, block_of: dict[str, ShardedBlock], on_read: Callable[[ShardedBlock], None]):
        super().__init__(params)
        self._block_of = block_of
        self._on_read = on_read
        self.reads: dict[str, int] = {}

    def __getitem__(self, name: str):
        value = dict.__getitem__(self, name)
        block = self._block_of.get(name)
        if block is not None:
            self.reads[name] = self.reads.get(name, 0) + 1
            self._on_read(block)
        return value


def install_param_access(blocks: list[ShardedBlock], on_read: Callable[[ShardedBlock], None]) -> Callable[[], None]:
    """Give every module owning parameters of `blocks` a reporting `_parameters`; returns the undo."""
    block_of: dict[nn.Module, dict[str, ShardedBlock]] = {}
    for block in blocks:
        for flat in block.flats:
            for slot in flat.slots:
                for module, attr in slot.uses:
                    block_of.setdefault(module, {})[attr] = block
    for module, names in block_of.items():
        module._parameters = ParamAccessDict(module._parameters, names, on_read)

    def remove() -> None:
        for module in block_of:
            if isinstance(module._parameters, ParamAccessDict):
                module._parameters = dict(module._parameters)

    return remove


class ExternalReads:
    """Blocks read from outside themselves, by reader; see the module docstring."""

    def __init__(self) -> None:
        self._this_call: dict[ShardedBlock, list[ShardedBlock]] = {}  # reader -> blocks read in its running call
        self._this_pass: dict[ShardedBlock, list[ShardedBlock]] = {}  # reader -> blocks read since the last backward
        self.held_for_step: set[ShardedBlock] = set()  # read by the root with autograd on
        self.root_readers: set[ShardedBlock] = set()  # blocks whose forward read a root parameter this pass

    def begin_call(self, reader: ShardedBlock) -> None:
        self._this_call[reader] = []

    def note(self, reader: ShardedBlock, block: ShardedBlock) -> bool:
        """Record that `reader` read `block`; True at the first read in the reader's running call."""
        read = self._this_call.setdefault(reader, [])
        if block in read:
            return False
        read.append(block)
        seen = self._this_pass.setdefault(reader, [])
        if block not in seen:
            seen.append(block)
        return True

    def was_read(self, block: ShardedBlock) -> bool:
        """Some reader other than `block` itself read `block` in this pass (or the root holds it for the step)."""
        return block in self.held_for_step or any(block in read for read in self._this_pass.values())

    def end_call(self, reader: ShardedBlock) -> list[ShardedBlock]:
        """The blocks `reader` read in the call that ends now."""
        return self._this_call.pop(reader, [])

    def read_by(self, reader: ShardedBlock) -> list[ShardedBlock]:
        """The blocks `reader` read in this pass's forward (its backward needs their weights again)."""
        return self._this_pass.get(reader, [])

    def clear(self) -> None:
        self._this_call.clear()
        self._this_pass.clear()
        self.held_for_step.clear()
        self.root_readers.clear()
