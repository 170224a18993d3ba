"""The loss head: finding a model's output projection, and wrapping it so it can run chunked.

A head selection is one of
  - ``"auto"``: a Hugging Face language model's output projection: the outermost
    module with ``get_output_embeddings()`` returning an ``nn.Linear`` whose
    ``forward`` takes ``labels`` (``*ForCausalLM``, GPT-2's ``LMHeadModel``, T5,
    BERT's masked LM). Its logits are chunked only in calls given ``labels=``:
    a call without them (generation, a loss of the user's own) runs as it is.
    None where the model has no such head;
  - the qualified name of an ``nn.Linear`` (``"lm_head"``), or the module itself:
    a model of one's own (nanoGPT's ``lm_head`` and ``F.cross_entropy``). Its
    logits are chunked in every training call;
  - ``None``: no head is managed.

The projection gets an instance-level ``forward`` (as blocks do): in KEPT mode,
outside training, or without labels it is the module's own forward, bit for bit;
in CHUNKED mode it returns `ChunkedLogits` and the loss is computed chunk by chunk
(`adaptmem.strategies.head`).
"""

from __future__ import annotations

import copy
import functools
import inspect
import weakref
from typing import Any, Union

import torch
from torch import nn

from adaptmem.modes import HeadMode
from adaptmem.strategies.head import ChunkedLogits

HeadSelection = Union[str, nn.Module, None]

#: Tokens per chunk when CHUNKED is set without a size (the manager's planner picks its own).
DEFAULT_CHUNK_TOKENS = 1024


class HeadHandle:
    """The managed loss head: its projection (`module`), the model whose `labels` arm it
    (`owner`, None for a head named by the user), its `mode` and `chunk_tokens`.

    Counters: `calls` (training calls), `chunked_calls` (of those, run chunked),
    `armings` (training calls of the owner given `labels=`: a step that armed the head and never
    called it made its loss from the head's weight elsewhere, as TRL's fused LM head does),
    `last_tokens` and `last_chunks` (of the last chunked loss); calls traced by torch.compile
    are not counted (a counter in traced code would make every step compile again)."""

    def __init__(self, name: str, module: nn.Linear, owner: nn.Module | None, runtime: Any) -> None:
        self.name = name
        self.module = module
        self.owner = owner
        self.runtime = runtime
        self._mode = HeadMode.KEPT
        self._chunk: int | None = None
        self._chunk_planned = True  # the planner's choice (never warned about) or the user's
        self.chunkable = type(module).forward is nn.Linear.forward
        self.armed = owner is None
        self.calls = self.chunked_calls = self.armings = self.last_tokens = self.last_chunks = 0
        self._hooks: list[Any] = []

    @property
    def mode(self) -> HeadMode:
        return self._mode

    @mode.setter
    def mode(self, value: HeadMode | str) -> None:
        self._mode = HeadMode.parse(value)

    @property
    def chunk_tokens(self) -> int | None:
        """Tokens per chunk in CHUNKED mode; None: `DEFAULT_CHUNK_TOKENS` (a manager's planner sets its own)."""
        return self._chunk

    @chunk_tokens.setter
    def chunk_tokens(self, value: int | None) -> None:
        self._chunk = _chunk_size(value)
        self._chunk_planned = False

    def planned(self, mode: HeadMode | str, chunk: int | None) -> None:
        """Set by the planner: its chunk is sized to the batch, a user's may not be (see `_HeadForward`)."""
        self.mode, self._chunk, self._chunk_planned = mode, _chunk_size(chunk), True

    @property
    def vocab(self) -> int:
        return self.module.out_features

    @property
    def hidden(self) -> int:
        return self.module.in_features

    @property
    def weight_bytes(self) -> int:
        w = self.module.weight
        return w.numel() * w.element_size()

    def loss_taken(self, tokens: int, chunks: int) -> None:
        self.last_tokens, self.last_chunks = tokens, chunks

    def __repr__(self) -> str:
        chunk = f", chunk_tokens={self.chunk_tokens}" if self._mode is HeadMode.CHUNKED else ""
        return f"HeadHandle(name={self.name!r}, mode={self._mode.label}{chunk}, vocab={self.vocab})"


class _HeadForward:
    """The instance-level `forward` adaptmem installs on the head's projection."""

    def __init__(self, module: nn.Module, handle: HeadHandle, previous: Any) -> None:
        self._module = weakref.ref(module)
        self._handle = weakref.ref(handle)
        self.previous = previous

    def own(self, module: nn.Module) -> Any:
        return self.previous if self.previous is not None else functools.partial(type(module).forward, module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module, handle = self._module(), self._handle()
        forward = self.own(module)
        if handle is None or not (module.training and torch.is_grad_enabled() and handle.armed):
            return forward(*args, **kwargs)
        compiling = torch.compiler.is_compiling()  # a counter torch.compile traced would be guarded on
        if not compiling:
            handle.calls += 1
        if handle.mode is HeadMode.KEPT:
            return forward(*args, **kwargs)
        if not handle.chunkable or kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor):
            handle.runtime.warn_once(
                "head-unchunkable",
                (
                    f"adaptmem: the loss head {handle.name} ({type(module).__name__}) cannot run chunked "
                    "(a subclass of nn.Linear with its own forward, or called with other arguments); it runs kept"
                ),
            )
            return forward(*args, **kwargs)
        if not compiling:
            handle.chunked_calls += 1
        chunk = handle.chunk_tokens or DEFAULT_CHUNK_TOKENS
        tokens = args[0].numel() // max(1, args[0].shape[-1])
        if not handle._chunk_planned and chunk > tokens:
            handle.runtime.warn_once(
                f"head-chunk-{chunk}",
                (
                    f"adaptmem: the loss head {handle.name} has chunk_tokens={chunk}, more than this batch's {tokens} "
                    f"tokens: its logits are made in one chunk, as large as KEPT's. Set a chunk below the tokens "
                    f"per batch (head.chunk_tokens = {_below(tokens)}), or leave it to the planner "
                    "(head.chunk_tokens = None under a manager)"
                ),
            )
        on_loss = None if compiling else handle.loss_taken
        return ChunkedLogits.of(args[0], module.weight, module.bias, chunk, on_loss=on_loss)

    def belongs_to(self, handle: HeadHandle) -> bool:
        return self._handle() is handle

    # Weak references are copied as-is by `copy`; point them at the copies instead (as blocks do).
    def __deepcopy__(self, memo: dict) -> _HeadForward:
        module, handle = self._module(), self._handle()
        new = _HeadForward.__new__(_HeadForward)
        new._module = weakref.ref(memo.get(id(module), module))
        new._handle = weakref.ref(copy.deepcopy(handle, memo)) if handle is not None else _dead
        new.previous = copy.deepcopy(self.previous, memo)
        return new

    def __reduce__(self) -> tuple:
        return (_rebuild_forward, (self._module(), self._handle(), self.previous))


def _chunk_size(value: int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"chunk_tokens must be a positive number of tokens or None (the planner's choice), got {value!r}"
        )
    return value


def _below(tokens: int) -> int:
    """The largest power of two under `tokens` (at least 1): a chunk that makes two or more."""
    return 1 << max(0, (tokens - 1).bit_length() - 1)


def _dead() -> None:
    return None


def _rebuild_forward(module: nn.Module, handle: HeadHandle | None, previous: Any) -> _HeadForward:
    new = _HeadForward.__new__(_HeadForward)
    new._module = weakref.ref(module)
    new._handle = weakref.ref(handle) if handle is not None else _dead
    new.previous = previous
    return new


def find_head(model: nn.Module, head: HeadSelection = "auto") -> tuple[str, nn.Linear, nn.Module | None] | None:
    """``(qualified name, projection, owner)`` of the selected head, or None (see the module)."""
    if head is None or head is False:
        return None
    named = dict(model.named_modules())
    if isinstance(head, nn.Module):
        name = next((n for n, m in named.items() if m is head), None)
        if name is None:
            raise ValueError(f"head: the module given ({type(head).__name__}) is not part of {type(model).__name__}")
        return name, _linear(head, name), None
    if not isinstance(head, str):
        raise TypeError(
            f"head must be 'auto', a qualified module name, an nn.Linear or None, got {type(head).__name__}"
        )
    if head == "auto":
        return _hugging_face_head(model, named)
    if head.lower() in ("kept", "chunked"):  # the policy's choice for the head, not a head
        raise ValueError(
            f'head={head!r}: head= names the module that is the loss head (head="lm_head"; "auto" finds a '
            "Hugging Face model's); whether it is kept whole or chunked is the policy's `head`: pass "
            f"policy=adaptmem.load_policy().model_copy(update={{'head': {head.lower()!r}}}), or set "
            f'head = "{head.lower()}" in a policy file'
        )
    if head not in named:
        linears = [n for n, m in named.items() if isinstance(m, nn.Linear)]
        raise ValueError(
            f"head={head!r}: {type(model).__name__} has no submodule of that name. Its linear layers include "
            f"{', '.join(linears[-4:]) or 'none'} (the output projection is usually the last); pass its "
            "qualified name, the module itself, or head=None"
        )
    return head, _linear(named[head], head), None


def likely_head(model: nn.Module) -> tuple[str, str] | None:
    """Where `find_head` found none under "auto": ``(name, embedding's name)`` of the last linear
    layer with as many outputs as an embedding has rows (a language model's output projection
    of one's own, nanoGPT's lm_head), or None."""
    named = list(model.named_modules())
    rows = {m.num_embeddings: n for n, m in named if isinstance(m, nn.Embedding) and m.num_embeddings >= 256}
    for name, module in reversed(named):
        if isinstance(module, nn.Linear) and module.out_features in rows:
            return name, rows[module.out_features]
    return None


def _linear(module: nn.Module, name: str) -> nn.Linear:
    if not isinstance(module, nn.Linear):
        raise ValueError(
            f"head {name!r} is {_article(type(module).__name__)} {type(module).__name__}, not an nn.Linear: the "
            "loss head is the output projection whose logits go to the loss (nanoGPT's lm_head); pass that, "
            "or head=None"
        )
    return module


def _article(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


def _hugging_face_head(model: nn.Module, named: dict[str, nn.Module]):
    for owner in named.values():
        getter = getattr(owner, "get_output_embeddings", None)
        if getter is None or not _takes_labels(owner):
            continue
        projection = getter()
        if not isinstance(projection, nn.Linear):
            continue
        name = next((n for n, m in named.items() if m is projection), None)
        if name is not None:
            return name, projection, owner
    return None


def _takes_labels(module: nn.Module) -> bool:
    try:
        return "labels" in inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return False


def attach_head(found: tuple[str, nn.Linear, nn.Module | None], runtime: Any) -> HeadHandle:
    """Wrap the found head (see `find_head`) and return its handle; `detach_head` undoes it."""
    name, module, owner = found
    if isinstance(module.__dict__.get("forward"), _HeadForward):
        raise ValueError(f"head {name!r} is already managed through another model object; restore that one first")
    handle = HeadHandle(name, module, owner, runtime)
    module.__dict__["forward"] = _HeadForward(module, handle, module.__dict__.get("forward"))
    if owner is not None:
        handle._hooks = [
            owner.register_forward_pre_hook(_Arm(handle), with_kwargs=True),
            owner.register_forward_hook(_Disarm(handle), always_call=True),
        ]
    return handle


def detach_head(handle: HeadHandle) -> None:
    module = handle.module
    current = module.__dict__.get("forward")
    if not (isinstance(current, _HeadForward) and current.belongs_to(handle)):
        raise RuntimeError(
            f"head {handle.name!r}: its forward was replaced after adaptmem wrapped it (now {current!r}); "
            "remove that wrapper first, then call adaptmem.restore"
        )
    if current.previous is None:
        del module.__dict__["forward"]
    else:
        module.__dict__["forward"] = current.previous
    for hook in handle._hooks:
        hook.remove()
    handle._hooks = []


class _Arm:
    """The owner's forward pre-hook: the head is armed in a call given `labels` (held weakly, so the
    model does not keep its manager's handle alive; a deep copy points at the copy's handle)."""

    def __init__(self, handle: HeadHandle) -> None:
        self._handle = weakref.ref(handle)
        self._signature: inspect.Signature | None = None  # the owner's forward's, read at its first call

    def __deepcopy__(self, memo: dict) -> _Arm:
        new = type(self).__new__(type(self))
        handle = self._handle()
        new._handle = weakref.ref(copy.deepcopy(handle, memo)) if handle is not None else _dead
        new._signature = self._signature
        return new

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        handle = self._handle()
        if handle is None:
            return
        if self._signature is None:
            self._signature = inspect.signature(type(module).forward)
        try:
            labels = self._signature.bind_partial(module, *args, **kwargs).arguments.get("labels")
        except TypeError:
            labels = kwargs.get("labels")
        handle.armed = labels is not None
        if handle.armed and module.training and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            handle.armings += 1


class _Disarm(_Arm):
    """The owner's forward hook (always called, also after an error): the head is disarmed."""

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:  # type: ignore[override]
        handle = self._handle()
        if handle is not None:
            handle.armed = False
