"""The model a script trains: every module its first optimizer's parameters live in.

Scripts build their model in parts as often as in one module: a backbone and a head, an encoder and
a decoder (a VAE, a seq2seq), two towers (CLIP), each its own variable, and one optimizer over
``[*enc.parameters(), *dec.parameters()]``. Taking the one module that holds the most of them as "the
model" left the others out of the candidate: the encoder ran in fp32 under bf16-mixed (autocast began
at the decoder's forward) and kept fp32 weights under bf16-true, while the run was reported under
the candidate's name. :func:`find_models` finds every part; :class:`Models` holds them for the agent
as one module, named as the script names them (``enc.0.weight``), so a candidate is applied to all
of them and a precision map names their layers in the script's terms.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import itertools
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from mixprec.policy.hooks import CastInputs

__all__ = [
    "ChildCalls",
    "Models",
    "models_to_come",
    "describe",
    "find_models",
    "live_modules",
    "model_of",
    "named_parts",
    "preparing",
]

_TORCH = str(Path(torch.__file__).parent)
_MIXPREC = str(Path(__file__).parents[2])


class Models(nn.Module):
    """The parts of a script's model (two or more root modules), held under the script's names. The
    script calls the parts, never this module: its forward refuses."""

    def __init__(self, parts: dict[str, nn.Module]) -> None:
        super().__init__()
        for name, part in parts.items():
            self.add_module(name, part)
        self._spreading = False

    @contextlib.contextmanager
    def spreading(self) -> Iterator[None]:
        """While a Policy prepares the model: its forward pre-hooks (input casts) go on the parts."""
        self._spreading = True
        try:
            yield
        finally:
            self._spreading = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("the script's model is in parts (mixprec's Models): call each part")

    def register_forward_pre_hook(
        self, hook: Any, *, prepend: bool = False, with_kwargs: bool = False
    ) -> RemovableHandle:
        """While :meth:`spreading`, a forward pre-hook (a Policy's input cast) goes on each part,
        which the script calls: none would ever run here. One handle removes it from all of them (a
        rescue that widens a *-true model to fp32 removes the cast). Any other hook (a range
        collector's on every module) stays here, with its forward hook, and neither runs."""
        if not self._spreading:
            return super().register_forward_pre_hook(hook, prepend=prepend, with_kwargs=with_kwargs)
        parts = list(self.children())
        held = [d for part in parts for d in (part._forward_pre_hooks, part._forward_pre_hooks_with_kwargs)]
        handle = RemovableHandle(self._forward_pre_hooks, extra_dict=held)
        for part in parts:
            part._forward_pre_hooks[handle.id] = hook
            if with_kwargs:
                part._forward_pre_hooks_with_kwargs[handle.id] = True
            if prepend:  # (an OrderedDict, typed as a dict)
                part._forward_pre_hooks.move_to_end(handle.id, last=False)  # type: ignore[attr-defined]
        return handle


class ChildCalls:
    """A model's input cast (a *-true candidate's, or the fp32 one of a script's own half weights
    widened) on each of its children too, for a loop that calls them itself: a GAN in one module
    (``gan.d(real)``), a backbone and a head called in turn. Only there: inside the model's forward
    its own cast took the inputs, nor in a backward (a checkpoint's recomputation replays inputs the
    model chose). On children with weights only, fp32 islands aside: a loss module the model holds
    (``model.criterion(out, y)``) computes as the script has it. The cast on the model is the one
    that counts (a rescue that widens a *-true model to fp32 removes it, and these with it). Plain
    data, as :class:`CastInputs` is: a deep copy of the model (an EMA) gets its own, and
    ``torch.save(model)`` pickles it."""

    def __init__(self, model: nn.Module, cast_id: int) -> None:
        self.model, self.cast_id, self.depth = model, cast_id, 0
        children = [
            child
            for child in model.children()
            if any(p.is_floating_point() for p in child.parameters())
            and not getattr(child, "_mixprec_fp32_island", False)
        ]
        if not children:  # (nothing to cast for: no hooks on the model's every forward)
            return
        model.register_forward_pre_hook(self.enter, prepend=True)
        model.register_forward_hook(self.leave, always_call=True)
        for child in children:
            child.register_forward_pre_hook(self.cast, with_kwargs=True, prepend=True)

    def enter(self, module: nn.Module, args: tuple) -> None:
        self.depth += 1

    def leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.depth -= 1

    def cast(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if self.depth:  # (first: a compiled forward of the model sees a constant here, and no more)
            return None
        if torch._C._current_graph_task_id() != -1:  # (inside a backward)
            return None
        cast = self.model._forward_pre_hooks.get(self.cast_id)
        return cast(module, args, kwargs) if cast is not None else None


@contextlib.contextmanager
def preparing(model: nn.Module, label: str) -> Iterator[None]:
    """The body applies candidate ``label`` to ``model``: a :class:`Models`' input casts go on its
    parts, a one-module model's input casts go on its children too (:class:`ChildCalls`), and a part
    the candidate replaced is refused (a low format converts a Linear inside its parent: a head that
    is one was swapped inside the holder while the script kept calling its own)."""
    parts = named_parts(model)
    before = set(model._forward_pre_hooks)
    with model.spreading() if isinstance(model, Models) else contextlib.nullcontext():
        yield
    if not isinstance(model, Models):  # (a Models' casts went on each part)
        for hook_id, hook in list(model._forward_pre_hooks.items()):
            if hook_id not in before and isinstance(hook, CastInputs):
                ChildCalls(model, hook_id)
    swapped = [name for name, part in parts.items() if name and getattr(model, name) is not part]
    if swapped:
        from mixprec.errors import UnsupportedError

        raise UnsupportedError(
            f"{label}: the script's {swapped[0]!r} is itself a layer the format converts, and the script "
            f"calls it, not the module mixprec put in its place; put it in a module of the script's "
            f"(nn.Sequential({swapped[0]})) or keep it: --keep-bf16 {swapped[0]}"
        )


def describe(model: nn.Module) -> str:
    """What the script trains, as the facts name it: ``ResNet``, ``enc (Encoder) + dec (Decoder)``."""
    if isinstance(model, Models):
        return " + ".join(f"{name} ({type(part).__name__})" for name, part in model.named_children())
    return type(model).__name__


def named_parts(model: nn.Module) -> dict[str, nn.Module]:
    """The modules the script calls, by name in ``model``: a :class:`Models`' parts, else the model
    itself as ''."""
    return dict(model.named_children()) if isinstance(model, Models) else {"": model}


def find_models(params: list[int], live: list[nn.Module]) -> list[nn.Module]:
    """The outermost modules among ``live`` that hold the parameters in ``params`` (ids, in the
    optimizer's order; those of no module, a bare ``nn.Parameter``, are the script's own): the one
    holding the most of them, then the one holding the most of the rest, until no module holds any
    that is left (a module that adds none, one sharing the first's backbone, is not a part). In the
    order the optimizer holds their parameters; a torch.compile wrapper stands for the module it
    compiles."""
    children = {id(c) for m in live for c in m.children()}
    roots = [m for m in live if id(m) not in children]
    wanted = set(params)
    held = {id(root): {id(p) for p in root.parameters()} & wanted for root in roots}
    size = {id(root): sum(1 for _ in root.parameters()) for root in roots}
    left, found = set(wanted), []
    while True:
        # most of what is left; among equals, the smallest module holding them
        best = max(
            (r for r in roots if held[id(r)] & left),
            key=lambda r: (len(held[id(r)] & left), -size[id(r)]),
            default=None,
        )
        if best is None:
            break
        found.append(best)
        left -= held[id(best)]
    first = {p: i for i, p in reversed(list(enumerate(params)))}
    found.sort(key=lambda r: min(first[p] for p in held[id(r)]))
    models = []
    for module in found:
        inner = getattr(module, "_orig_mod", None)  # a torch.compile wrapper: the model it compiles
        models.append(inner if isinstance(inner, nn.Module) else module)
    return models


def model_of(parts: list[nn.Module], frame: FrameType | None = None) -> nn.Module:
    """The model the agent applies the candidate to: the one part, or the parts as :class:`Models`
    named as the script's code names them (its variable, ``self.encoder``'s attribute), else by class."""
    if len(parts) == 1:
        return parts[0]
    frame = frame or sys._getframe(1)
    named: dict[str, nn.Module] = {}
    for part in parts:
        name = _script_name(part, frame) or _snake(type(part).__name__)
        if name in named or not _usable(name):
            base = _snake(type(part).__name__)
            name = next(f"{base}_{n}" for n in itertools.count(1) if f"{base}_{n}" not in named)
        named[name] = part
    return Models(named)


def models_to_come(held: set[int], parts: list[nn.Module], frame: FrameType | None = None) -> list[nn.Module]:
    """The other models the script's code holds (its variables, an attribute of one of its objects:
    a trainer's ``self.netG``) whose parameters train, none of them in ``held`` (the ids of what its
    first optimizer holds) nor inside ``parts`` (a backbone it keeps a variable of and left out of
    the optimizer), and whose parameters the same code hands an optimizer it builds
    (``optim.Adam(netG.parameters())``): a GAN's second model, as the DCGAN tutorial builds ``netG``
    and ``netD``, then ``optimizerD`` and ``optimizerG``. Not a teacher or any model the code never
    gives an optimizer: it stays as the script has it."""
    frame = frame or sys._getframe(1)
    inside = {id(m) for part in parts for m in part.modules()}
    found: dict[int, tuple[nn.Module, str, str]] = {}  # id -> the module, its name, the file naming it

    for _, name, module, filename, _ in _modules_held(frame):
        if id(module) in found or id(module) in inside:
            continue
        params = list(module.parameters())
        if any(p.requires_grad for p in params) and not any(id(p) in held for p in params):
            found[id(module)] = (module, name, filename)
    trained = {filename: _optimized_names(filename) for filename in {f for _, _, f in found.values()}}
    return [module for module, name, filename in found.values() if name in trained[filename]]


def script_holds(model: nn.Module, fresh: set[type], frame: FrameType | None = None) -> bool:
    """Whether the script's code still holds ``model`` or a module inside it (or a compile wrapper
    of one): in a variable, or an attribute of one of its objects (a trainer's ``self.model``; not
    of mixprec's own: :func:`_modules_held`). Outside the innermost of the script's frames, what
    is of a kind the script is building a new one of now (``fresh``: the new model's classes; and
    those whose ``__init__`` runs: ``trainer = Fold(k)``, ``model, opt = build(k)``) is the last
    one, in a variable the new one goes to when that returns."""
    frame = frame or sys._getframe(1)
    inside = {id(m) for m in model.modules()}
    fresh = fresh | _being_built(frame)
    return any(
        id(module) in inside or id(getattr(module, "_orig_mod", None)) in inside
        for depth, _, module, _, kind in _modules_held(frame)
        if not (depth and kind in fresh)
    )


def _modules_held(frame: FrameType) -> Iterator[tuple[int, str, nn.Module, str, type]]:
    """Each module the script's code holds, innermost scope first (:func:`_scopes_and_files`): in
    a variable, or an attribute of an object in one (a trainer's ``self.netG``; not of mixprec's
    own: the agent holds the model it was applied to). As (the scope's depth, the name it goes by,
    the module, the file whose code holds it, the class of the variable's value)."""
    for depth, (scope, filename) in enumerate(_scopes_and_files(frame)):
        for name, value in list(scope.items()):
            try:  # (a dead weakref.proxy raises on isinstance; an object's __getattr__ may raise anything)
                kind = type(value)
                if _is_module(value):
                    yield depth, name, value, filename, kind
                    continue
                if isinstance(value, (ModuleType, type)) or not hasattr(value, "__dict__"):
                    continue
                if kind.__module__.startswith("mixprec."):
                    continue
                attributes = list(vars(value).items())
            except Exception:
                continue
            for attribute, inner in attributes:
                if _is_module(inner):
                    yield depth, attribute, inner, filename, kind


def _being_built(frame: FrameType | None) -> set[type]:
    """The classes of the script's whose ``__init__`` is running (``trainer = Trainer(model)``, the
    optimizer built inside): the variable the new one goes to holds the last one until it returns."""
    kinds: set[type] = set()
    while frame is not None:
        code = frame.f_code
        own = not code.co_filename.startswith((_TORCH, _MIXPREC))
        if own and code.co_name == "__init__" and code.co_argcount:
            value = frame.f_locals.get(code.co_varnames[0])
            if value is not None:
                kinds.add(type(value))
        frame = frame.f_back
    return kinds


def _optimized_names(filename: str) -> set[str]:
    """The names whose parameters the code in ``filename`` hands an optimizer's constructor:
    ``netG`` in ``optim.Adam(netG.parameters(), lr=lr)`` or ``AdamW(self.netG.named_parameters())``
    (any class of torch.optim's, or a subclass of Optimizer defined by now)."""
    import ast
    import linecache

    classes, todo = set(), [torch.optim.Optimizer]
    while todo:
        cls = todo.pop()
        classes.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    try:
        tree = ast.parse("".join(linecache.getlines(filename)))
    except (SyntaxError, ValueError):
        return set()
    names: set[str] = set()
    for call in ast.walk(tree):
        if not isinstance(call, ast.Call) or _last_name(call.func) not in classes:
            continue
        for node in (n for arg in [*call.args, *call.keywords] for n in ast.walk(arg)):
            method = node.func if isinstance(node, ast.Call) else None
            if isinstance(method, ast.Attribute) and method.attr in ("parameters", "named_parameters"):
                names.add(_last_name(method.value) or "")
    return names


def _last_name(node: Any) -> str | None:
    """``Adam`` of ``torch.optim.Adam``, ``netG`` of ``self.netG``."""
    import ast

    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def _script_name(part: nn.Module, frame: FrameType | None) -> str | None:
    """The name the script's code gives ``part``: a variable that holds it or its compile wrapper in
    a frame of the script's own (not torch's, not mixprec's), innermost first, else an attribute of
    one of that frame's objects (``self.encoder``); then a global of the script's."""
    for scope in _script_scopes(frame):
        for name, value in list(scope.items()):
            if _holds(value, part) and _usable(name):
                return name
        for value in list(scope.values()):
            if isinstance(value, nn.Module) or not hasattr(value, "__dict__"):
                continue
            for name, attribute in list(vars(value).items()):
                if _holds(attribute, part) and _usable(name):
                    return name
    return None


def _script_scopes(frame: FrameType | None) -> Iterator[dict[str, Any]]:
    """The locals of each frame of the script's code (not torch's, not mixprec's), innermost first
    (a ``build_optimizer(params)`` helper's, then the ``main()`` that named the parts), then its
    globals."""
    for scope, _ in _scopes_and_files(frame):
        yield scope


def _scopes_and_files(frame: FrameType | None) -> Iterator[tuple[dict[str, Any], str]]:
    """:func:`_script_scopes`, each with the file of the code it is the scope of."""
    outer: tuple[dict[str, Any], str] | None = None
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith((_TORCH, _MIXPREC, "<frozen")):
            scope = frame.f_locals
            try:
                yield scope, filename
            finally:
                # before 3.13 a function's f_locals is a snapshot kept on its frame: what the script
                # deletes later (a loaded checkpoint) would stay alive while the function runs
                if sys.version_info < (3, 13) and frame.f_code.co_flags & inspect.CO_OPTIMIZED:
                    scope.clear()
            outer = frame.f_globals, filename
        frame = frame.f_back
    if outer is not None:
        yield outer


def _holds(value: Any, part: nn.Module) -> bool:
    return value is part or (isinstance(value, nn.Module) and getattr(value, "_orig_mod", None) is part)


def _usable(name: str) -> bool:
    """A module name the parts can take: an identifier, not private, not one of nn.Module's own."""
    return name.isidentifier() and not name.startswith("_") and name not in _TAKEN


_TAKEN = frozenset(dir(nn.Module())) | frozenset(dir(Models))  # (``training`` is an instance's)


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def live_modules() -> list[nn.Module]:
    """Every ``nn.Module`` alive in this process (the garbage collector's objects)."""
    with warnings.catch_warnings():  # isinstance() on every live object wakes deprecated module attributes
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if _is_module(o)]


def _is_module(obj: Any) -> bool:
    """``isinstance(obj, nn.Module)``, False for a weak proxy whose object is gone (dynamo keeps
    some: isinstance() on one raises ReferenceError)."""
    try:
        return isinstance(obj, nn.Module)
    except ReferenceError:
        return False
