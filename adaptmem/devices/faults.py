"""Out-of-memory errors on demand: to see `run_step` retry a step, and check that it left the whole
training state as an unmanaged step would, without filling a device."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

#: Where an error can be armed: a block's forward, its recompute (the forward run again in backward, by
#: a recomputing mode), or its backward.
PLACES = ("forward", "recompute", "backward")


class OutOfMemoryInjector:
    """Raises one `torch.OutOfMemoryError` where it is armed (`arm`), then is disarmed.

        injector = OutOfMemoryInjector(model.model.layers)
        injector.arm(2, "backward")       # the next backward of the third block
        mem.run_step(lambda: model(**batch).loss.backward())
        assert injector.fired == 1 and mem.last_step["attempt"] == 1

    A recompute happens only where the block runs a recomputing mode (CHECKPOINT, SELECTIVE), and is
    seen where the block calls layers of its own; an armed place the step never reaches stays armed
    (`disarm` it). `remove()` takes the hooks off."""

    def __init__(self, blocks: Iterable[nn.Module]) -> None:
        self.blocks = list(blocks)
        if not self.blocks or not all(isinstance(b, nn.Module) for b in self.blocks):
            raise ValueError(
                "OutOfMemoryInjector needs the model's blocks, a non-empty list of modules "
                "(model.model.layers, model.transformer.h, ...)"
            )
        self.armed: tuple[int, str] | None = None
        self.fired = 0
        self._hooks = []
        self._leaves = set()  # blocks with no layers of their own: their forward raises before it runs
        for i, block in enumerate(self.blocks):
            if not any(True for _ in block.children()):
                self._leaves.add(i)
            self._hooks.append(block.register_forward_pre_hook(lambda m, a, i=i: self._before(i)))
            self._hooks.append(block.register_forward_hook(lambda m, a, out, i=i: self._after(i, out)))
            # a recompute runs the block's forward function, not the module: its layers are called
            for child in block.children():
                self._hooks.append(child.register_forward_pre_hook(lambda m, a, i=i: self._inside(i)))

    def arm(self, index: int, place: str = "forward") -> None:
        """Raise at block `index` (of the blocks given) in `place`: "forward", "recompute" or "backward"."""
        if place not in PLACES:
            raise ValueError(f"place {place!r}: one of {', '.join(repr(p) for p in PLACES)}")
        if not -len(self.blocks) <= index < len(self.blocks):
            raise ValueError(f"block {index}: there are {len(self.blocks)} blocks (0 to {len(self.blocks) - 1})")
        self.armed = (index % len(self.blocks), place)

    def disarm(self) -> None:
        self.armed = None

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks, self.armed = [], None

    def _fire(self) -> None:
        self.armed = None
        self.fired += 1
        raise torch.OutOfMemoryError("out of memory injected by OutOfMemoryInjector")

    def _before(self, i: int) -> None:
        if i in self._leaves and self.armed == (i, "forward") and torch._C._current_graph_task_id() == -1:
            self._fire()

    def _inside(self, i: int) -> None:
        """A layer of block `i` called: in its forward (raised inside the block, as a real error is, not
        before a wrapper around it has begun), or in its recompute (inside backward)."""
        in_backward = torch._C._current_graph_task_id() != -1
        if self.armed == (i, "recompute" if in_backward else "forward"):
            self._fire()

    def _after(self, i: int, out: object) -> None:
        """Armed for this block's backward: its output's gradient, when backward reaches it, raises."""
        if self.armed != (i, "backward") or torch._C._current_graph_task_id() != -1:
            return
        outs = out if isinstance(out, (tuple, list)) else (out,)
        first = next((t for t in outs if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if first is None:
            return

        def hook(*grads: object) -> None:
            if self.armed == (i, "backward"):
                self._fire()

        # on the node that makes the output, after what a wrapper registered there as the block ran (a
        # tensor's own hooks run before the node's: the block's backward would not have begun)
        if first.grad_fn is not None:
            first.grad_fn.register_prehook(hook)
        else:
            first.register_hook(hook)
