"""Choosing blocks (the unit of gathering and swapping) and which parameters each one owns."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from infinity.config import ConfigError

# (fqn, parameter, every (module, attribute) that uses it)
ParamUse = tuple[str, nn.Parameter, tuple[tuple[nn.Module, str], ...]]


@dataclass
class BlockPlan:
    """The blocks in module order, each with its parameters; the root owns the rest."""

    blocks: list[tuple[str, nn.Module, list[ParamUse]]] = field(default_factory=list)
    root: list[ParamUse] = field(default_factory=list)
    persistent: list[ParamUse] = field(default_factory=list)


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _choose_block_modules(
    model: nn.Module, block_classes: tuple[str, ...], block_size_elems: int
) -> list[tuple[str, nn.Module]]:
    if block_classes:
        chosen: list[tuple[str, nn.Module]] = []
        seen_classes: set[str] = set()
        for name, module in model.named_modules():
            cls = type(module).__name__
            if cls in block_classes and module is not model:
                seen_classes.add(cls)  # present, even where a block of another listed class holds it
                if not any(name.startswith(n + ".") for n, _ in chosen):
                    chosen.append((name, module))
        missing = [c for c in block_classes if c not in seen_classes]
        if missing:
            present = sorted({type(m).__name__ for m in model.modules()})
            raise ConfigError(
                f"'zero_optimization.block_classes' names {missing}, which the model does not contain; "
                f"module classes in this model: {', '.join(present)}"
            )
        return chosen

    def walk(prefix: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
        out = []
        for child_name, child in module.named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            size = _numel(child)
            if size == 0:
                continue
            if size <= block_size_elems or not any(True for _ in child.children()):
                out.append((name, child))
            else:
                out.extend(walk(name, child))
        return out

    return walk("", model)


def plan_blocks(
    model: nn.Module, block_classes: tuple[str, ...], block_size_elems: int, persistence_threshold: int
) -> BlockPlan:
    """Assign every parameter to one block, the root (shared across blocks), or the persistent set."""
    block_modules = _choose_block_modules(model, block_classes, block_size_elems)
    blocks_of_module: dict[int, set[int]] = {}  # a module shared by two blocks belongs to both
    for index, (_, block) in enumerate(block_modules):
        for m in block.modules():
            blocks_of_module.setdefault(id(m), set()).add(index)

    uses: dict[int, list[tuple[str, nn.Module, str]]] = {}
    params: dict[int, nn.Parameter] = {}
    modules = dict(model.named_modules(remove_duplicate=False))
    for fqn, p in model.named_parameters(remove_duplicate=False):
        module_name, _, attr = fqn.rpartition(".")
        uses.setdefault(id(p), []).append((fqn, modules[module_name], attr))
        params[id(p)] = p

    plan = BlockPlan(blocks=[(name, module, []) for name, module in block_modules])
    for pid, p in params.items():
        entries = uses[pid]
        use = (entries[0][0], p, tuple((m, a) for _, m, a in entries))
        owners: set[int | None] = set()
        for _, m, _ in entries:
            owners |= blocks_of_module.get(id(m), {None})
        if p.numel() < persistence_threshold:
            plan.persistent.append(use)
        elif len(owners) == 1 and None not in owners:
            plan.blocks[owners.pop()][2].append(use)
        else:
            plan.root.append(use)  # used outside any block, or by several blocks (tied weights)
    plan.blocks = [b for b in plan.blocks if b[2]]
    return plan


def flat_groups(
    uses: list[ParamUse], group_of: dict[int, int], max_elems: int
) -> list[tuple[str, int | None, list[ParamUse]]]:
    """How one block's parameters form flats: one per param group (frozen ones, group None, first), each
    split at parameter boundaries into runs of at most `max_elems` elements (`sub_group_size`; a larger
    parameter is a run of its own). Returns (tag, group, parameters) per flat; the tag names the group, and
    the run when a group is split ("0", "0.1", "frozen")."""
    by_group: dict[int | None, list[ParamUse]] = {}
    for use in uses:
        by_group.setdefault(group_of.get(id(use[1])), []).append(use)
    out = []
    for group, members in sorted(by_group.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
        runs: list[list[ParamUse]] = [[]]
        size = 0
        for use in members:
            if runs[-1] and size + use[1].numel() > max_elems:
                runs.append([])
                size = 0
            runs[-1].append(use)
            size += use[1].numel()
        tag = "frozen" if group is None else str(group)
        for k, run in enumerate(runs):
            out.append((tag if k == 0 else f"{tag}.{k}", group, run))
    return out
