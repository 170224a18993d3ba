"""Finding a model's blocks: the unit adaptmem decides a mode for.

A selection is one of
  - ``"auto"``: the repeated block stacks: the outermost ``ModuleList`` /
    ``Sequential`` whose (two or more) children share one class, or are all of
    the layer classes a Hugging Face model names in ``_no_split_modules`` (a
    hybrid's attention and Mamba layers), outermost first (so a
    mixture-of-experts list inside a layer is not taken for the layer stack).
    Every such stack holding at least half the parameters of the largest is
    taken (an encoder and its decoder; not a vision tower a fifth the size of
    its language model, whose length, the image's, would key the plans).
    Where the stack's children are stages that differ in shape (a ResNet's,
    ConvNeXt's or Swin's), the layers inside each stage are the blocks. A module
    of a block's class outside every such stack (a recurrent-depth model's one
    coda layer) is a block too.
  - a class, or a class name that some submodule has, or a tuple of them. A module
    whose class a wrapper swapped in place (FSDP2's ``fully_shard`` makes a
    ``Qwen2DecoderLayer`` an ``FSDPQwen2DecoderLayer``) goes by its own class's
    name, so a selection finds the same blocks before and after sharding (the
    wrapper's name selects them too, and messages list the names as written);
  - a regex over qualified module names: it selects a module when it matches
    the whole name or the whole of a dotted suffix (``r"layers\\.\\d+"`` selects
    ``model.layers.0``);
  - a ``(module, qualified_name) -> bool`` filter;
  - a list of the modules themselves.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Union

from torch import nn

BlockSelection = Union[
    str,
    type,
    tuple,
    Callable[[nn.Module, str], bool],
    Sequence[nn.Module],
]


def find_blocks(model: nn.Module, blocks: BlockSelection = "auto") -> list[tuple[str, nn.Module]]:
    """The selected blocks as ``(qualified_name, module)`` in module order.

    Raises ValueError when nothing matches (naming the stacks and classes the
    model does have) or when one selected block contains another.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}")
    named = list(model.named_modules())
    chosen = _select(model, named, blocks)
    if not chosen:
        raise ValueError(
            f"no blocks matched blocks={_show(blocks)} in {type(model).__name__}. "
            f"{describe_model(model)} Pass one of these class names, a regex on the "
            "qualified names, a filter function, or a list of modules."
        )
    _reject_nesting(chosen, blocks)
    return chosen


def describe_model(model: nn.Module) -> str:
    """One sentence on the stacks and repeated classes a model has, for error messages."""
    stacks = [
        f"{name or '<root>'} ({len(mod)} x {_child_classes(mod)})"
        for name, mod in model.named_modules()
        if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) > 0
    ]
    counts = Counter(class_name(m) for _, m in model.named_modules())
    repeated = [f"{cls} x{n}" for cls, n in counts.most_common() if n >= 2 and not _is_container_name(cls)]
    return (
        f"Its module stacks: {', '.join(stacks[:8]) or 'none'}"
        f"{' ...' if len(stacks) > 8 else ''}. "
        f"Its repeated classes: {', '.join(repeated[:10]) or 'none'}."
    )


def user_class(module: nn.Module) -> type:
    """The module's class as its author wrote it: under the classes that wrap a module in place by
    making a subclass of it (FSDP2's ``FSDP<Name>`` and ``Replicate<Name>``, ``(wrapper, Name)``
    made in `torch.distributed`), the class it was made from."""
    cls = type(module)
    while (
        len(cls.__bases__) == 2
        and cls.__module__.startswith("torch.distributed")
        and cls.__name__ != cls.__bases__[1].__name__
        and cls.__name__.endswith(cls.__bases__[1].__name__)
    ):
        cls = cls.__bases__[1]
    return cls


def class_name(module: nn.Module) -> str:
    """`user_class(module)`'s name: how messages and the cost model name the module's class."""
    return user_class(module).__name__


def block_kind(module: nn.Module) -> str:
    """What blocks alike share, beyond their class: the classes of the modules inside and the
    weights' size. A hybrid's layers of one class differ there (Bamba's and Qwen3-Next's decoder
    layers hold a Mamba mixer or linear attention in some, attention in others; DeepSeek's first
    layers a dense MLP where the rest hold experts), and so do the activations they save."""
    inner = sorted({class_name(m) for m in module.modules()})
    weights = sum(p.numel() for p in module.parameters())
    return f"{class_name(module)}[{','.join(inner)};{weights}]"


def class_names(module: nn.Module) -> set[str]:
    """The names a selection by class name matches: `class_name(module)`, and the wrapper's own
    name where a wrapper swapped the class (``FSDPQwen2DecoderLayer``, as `type()` prints it)."""
    return {class_name(module), type(module).__name__}


# ---------------------------------------------------------------- selection
def _select(model: nn.Module, named: list[tuple[str, nn.Module]], blocks: BlockSelection):
    if isinstance(blocks, str):
        if blocks == "auto":
            return _auto(model, named)
        if any(blocks in class_names(m) for _, m in named):
            return [(n, m) for n, m in named if blocks in class_names(m)]
        return _by_regex(named, blocks)
    if isinstance(blocks, type):
        _check_module_class(blocks)
        return [(n, m) for n, m in named if n and isinstance(m, blocks)]
    if isinstance(blocks, tuple):
        return _by_classes(named, blocks)
    if isinstance(blocks, nn.Module):
        blocks = [blocks]
    if callable(blocks):
        return [(n, m) for n, m in named if blocks(m, n)]
    if isinstance(blocks, Sequence):
        return _by_modules(model, named, blocks)
    raise TypeError(
        f"blocks must be 'auto', a class or class name, a tuple of them, a regex, "
        f"a (module, name) -> bool filter, or a list of modules; got {type(blocks).__name__}"
    )


#: An outer stack is taken beside the one of most parameters where it holds at least this share of
#: them: an encoder's beside its decoder, not a vision tower beside a language model.
MAJOR_STACK = 0.5


def _auto(model: nn.Module, named: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    layers = set(getattr(model, "_no_split_modules", None) or ())
    stacks = [
        (name, mod)
        for name, mod in named
        if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) >= 2 and _one_kind(mod, layers)
    ]
    outer = [
        (name, mod) for name, mod in stacks if not any(_is_inside(name, other) for other, _ in stacks if other != name)
    ]
    if not outer:
        return []
    # stacks of layers (modules of their own modules), not of bare linear layers, where there are any
    outer = [(n, m) for n, m in outer if all(any(True for _ in c.children()) for c in m)] or outer
    sizes = {name: sum(w.numel() for w in mod.parameters()) for name, mod in outer}
    longest, largest = max(len(mod) for _, mod in outer), max(sizes.values())
    chosen = []
    for name, mod in outer:
        if sizes[name] >= MAJOR_STACK * largest if largest > 0 else len(mod) == longest:
            prefix = f"{name}." if name else ""
            members = _stage_layers(mod) or list(mod.named_children())
            chosen.extend((f"{prefix}{key}", child) for key, child in members)
    chosen.extend(_lone_alike(named, chosen, stacks))
    order = {id(m): i for i, (_, m) in enumerate(named)}
    return sorted(chosen, key=lambda item: order[id(item[1])])


def _lone_alike(
    named: list[tuple[str, nn.Module]], chosen: list[tuple[str, nn.Module]], stacks: list[tuple[str, nn.Module]]
) -> list[tuple[str, nn.Module]]:
    """Modules of a chosen block's class outside every stack of two or more: a recurrent-depth
    model's one coda layer (in a list of one, or an attribute of its own) runs between the blocks as
    they do. Left out, it ran unmanaged, its activations counted with the block before it."""
    classes = {user_class(m) for _, m in chosen}
    taken = [n for n, _ in chosen]  # the blocks so far, chosen and found
    found = []
    for name, mod in named:
        if user_class(mod) not in classes or not any(True for _ in mod.children()):
            continue  # a bare layer (a Linear like the blocks of a stack of Linears) is no layer of blocks
        if any(n == name or _is_inside(name, n) or _is_inside(n, name) for n in taken):
            continue
        if any(_is_inside(name, stack) for stack, _ in stacks):
            continue  # a member of a stack left out on purpose (a tower too small to key the plans)
        found.append((name, mod))
        taken.append(name)
    return found


def _one_kind(stack: nn.Module, layers: set[str]) -> bool:
    """The stack's children share one class, or are all of the layer classes a Hugging Face model
    names as never to be split (`_no_split_modules`): a hybrid's attention and Mamba layers (Jamba's
    `model.layers`)."""
    classes = {user_class(child) for child in stack}
    return len(classes) == 1 or all(c.__name__ in layers for c in classes)


def _stage_layers(stack: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """The layers inside a stack of stages, or None where the stack's children are its layers.

    Stages are children of one class whose parameters differ in shape (a ResNet's, a
    ConvNeXt's or a Swin's stages change width and depth; a transformer's layers are
    alike). Each stage runs a stack of layers of one class holding most of its parameters,
    and those layers are the blocks: checkpointing a whole stage recomputes it all at once
    in backward, holding its every activation again, where a layer at a time holds one
    layer's (on a Hugging Face ResNet-50 at 224 px, checkpointing the 4 stages cut the
    peak by 15%, its 16 residual layers by 24%). A stage without such a stack keeps the
    stack as it is."""
    children = list(stack.named_children())
    if len({tuple(tuple(w.shape) for w in child.parameters()) for _, child in children}) < 2:
        return None
    layers: list[tuple[str, nn.Module]] = []
    for key, stage in children:
        found = _layer_stack(stage)
        if found is None:
            return None
        name, inner = found
        layers.extend((f"{key}.{name}.{k}", child) for k, child in inner.named_children())
    return layers


def _layer_stack(stage: nn.Module) -> tuple[str, nn.Module] | None:
    """The outermost ModuleList / Sequential inside `stage` whose children share one class and
    hold at least half of the stage's parameters, with its name inside the stage."""
    total = sum(w.numel() for w in stage.parameters())
    for name, mod in stage.named_modules():
        if (
            name
            and isinstance(mod, (nn.ModuleList, nn.Sequential))
            and len(mod) >= 1
            and len({user_class(child) for child in mod}) == 1
        ):
            if 2 * sum(w.numel() for w in mod.parameters()) >= total:
                return name, mod
    return None


def _by_classes(named, classes: tuple) -> list[tuple[str, nn.Module]]:
    wanted_types, wanted_names = [], set()
    for c in classes:
        if isinstance(c, type):
            _check_module_class(c)
            wanted_types.append(c)
        elif isinstance(c, str):
            wanted_names.add(c)
        else:
            raise TypeError(f"a tuple of blocks holds classes or class names, got {c!r}")
    present = {class_name(m) for _, m in named}
    missing = sorted(wanted_names.difference(*(class_names(m) for _, m in named)))
    if missing:
        raise ValueError(
            f"block class name(s) {missing} do not occur in the model; classes present include {sorted(present)[:20]}"
        )
    return [(n, m) for n, m in named if n and (isinstance(m, tuple(wanted_types)) or class_names(m) & wanted_names)]


def _by_regex(named, pattern: str) -> list[tuple[str, nn.Module]]:
    try:
        rx = re.compile(pattern)
    except re.error as err:
        raise ValueError(f"blocks={pattern!r} is neither a class name in the model nor a valid regex ({err})") from None
    return [(n, m) for n, m in named if n and _matches_suffix(rx, n)]


def _matches_suffix(rx: re.Pattern, name: str) -> bool:
    if rx.fullmatch(name):
        return True
    return any(rx.fullmatch(name[i + 1 :]) for i, ch in enumerate(name) if ch == ".")


def _regex_for(name: str) -> str:
    r"""A regex that matches `name` and its numbered siblings ("layers.3" -> r"layers\.\d+")."""
    return re.sub(r"\\\.\d+$", r"\\.\\d+", re.escape(name)) if re.search(r"\.\d+$", name) else re.escape(name)


def _by_modules(model: nn.Module, named, modules: Sequence[nn.Module]) -> list[tuple[str, nn.Module]]:
    names = {id(m): n for n, m in named}
    chosen = []
    for mod in modules:
        if not isinstance(mod, nn.Module):
            hint = (
                (
                    " (a name): pass the modules themselves, or one regex over their names, e.g. "
                    f"blocks={_regex_for(mod)!r}"
                )
                if isinstance(mod, str)
                else ""
            )
            raise TypeError(f"a list of blocks holds modules, got {type(mod).__name__} {mod!r}{hint}")
        if id(mod) not in names:
            raise ValueError(
                f"{type(mod).__name__} given in blocks is not a submodule of this "
                f"{type(model).__name__}; pass modules reached from the model itself"
            )
        chosen.append((names[id(mod)], mod))
    order = {id(m): i for i, (_, m) in enumerate(named)}
    unique = {id(m): (n, m) for n, m in chosen}
    return sorted(unique.values(), key=lambda item: order[id(item[1])])


def _reject_nesting(chosen: list[tuple[str, nn.Module]], blocks: BlockSelection) -> None:
    for outer_name, outer in chosen:
        inner_ids = {id(m) for m in outer.modules() if m is not outer}
        for inner_name, inner in chosen:
            if id(inner) in inner_ids:
                hint = _nesting_hint(blocks, inner_name) if isinstance(blocks, str) else ""
                raise ValueError(
                    f"block {outer_name or '<root>'!r} contains block {inner_name!r}: "
                    f"a selection must not nest; select one level (e.g. only the layers){hint}"
                )


def _nesting_hint(pattern: str, inner_name: str) -> str:
    """Why a regex took both levels: a glob read as a regex, or a name matched by its dotted suffix."""
    if re.fullmatch(pattern, inner_name):
        return (
            f" (blocks={pattern!r} is a regex on the whole name, not a glob: it matched both; for "
            f"one level, e.g. blocks={_regex_for(inner_name)!r})"
        )
    suffix = next(
        inner_name[i + 1 :]
        for i, ch in enumerate(inner_name)
        if ch == "." and re.fullmatch(pattern, inner_name[i + 1 :])
    )
    return (
        f" (blocks={pattern!r} matches a whole name or any dotted suffix of one, and {inner_name!r} ends "
        f"in {suffix!r}; for whole names only, pass a filter: "
        f"blocks=lambda module, name: re.fullmatch({pattern!r}, name) is not None)"
    )


# ---------------------------------------------------------------- helpers
def _is_inside(name: str, container: str) -> bool:
    return container == "" or name.startswith(container + ".")


def _check_module_class(c: type) -> None:
    if not issubclass(c, nn.Module):
        raise TypeError(f"a block class must be a torch.nn.Module subclass, got {c.__name__}")


def _child_classes(mod: nn.Module) -> str:
    names = sorted({class_name(c) for c in mod})
    return names[0] if len(names) == 1 else "mixed: " + "/".join(names[:4])


def _is_container_name(cls: str) -> bool:
    return cls in {"ModuleList", "Sequential", "ModuleDict"}


def _show(blocks: object) -> str:
    if isinstance(blocks, type):
        return blocks.__name__
    if callable(blocks) and not isinstance(blocks, (list, tuple)):
        return getattr(blocks, "__name__", "a filter")
    text = repr(blocks)
    return text if len(text) < 80 else text[:77] + "..."
