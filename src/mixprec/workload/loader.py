"""Turn a target string into a Workload: a model by name (a built-in such as ``resnet50``, or
``torchvision:NAME``, ``timm:NAME``, ``hf:ARCH``; see :mod:`mixprec.workload.models`), or a
factory, ``path/to/file.py:function`` / ``package.module:function``.

A factory returns a :class:`~mixprec.workload.Workload`. It takes no arguments, or keyword
options (``image_size``, ``seq_len``, ``--model-config`` keys) when its signature names them.
The returned workload carries a :class:`~mixprec.workload.WorkloadSpec`, so another process
rebuilds the same workload with ``workload_from_spec(spec)``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from types import ModuleType
from typing import Any, cast

from mixprec.errors import UsageError, did_you_mean
from mixprec.workload.models import SOURCES, build_named, is_model_name
from mixprec.workload.workload import SPEC_KINDS, Workload, WorkloadSpec
from mixprec.workload.zoo import ZOO_NAMES, build_zoo_workload

_FORMS = (
    "a model name (a built-in, or torchvision:NAME, timm:NAME, hf:ARCH), "
    "'path/to/file.py:function' or 'package.module:function'"
)


def load_workload(target: str, **sizes: Any) -> Workload:
    """Build the workload that ``target`` names, passing ``sizes`` (image_size, seq_len, config
    overrides) to the model or the factory."""
    if not isinstance(target, str) or not target.strip():
        raise UsageError(
            f"workload target {target!r} is empty or not a string; pass {_FORMS} "
            f"(zoo names: {', '.join(ZOO_NAMES)})."
        )
    target = target.strip()
    if target in ZOO_NAMES:
        return build_zoo_workload(target, **sizes)
    if is_model_name(target):
        return build_named(target, sizes)
    if ":" not in target:
        hint = f" Add the factory's name: '{target}:make_workload'." if _is_file_target(target) else ""
        raise UsageError(
            f"workload target {target!r} is neither a zoo model nor 'module:function'; pass {_FORMS}. "
            f"Zoo names: {', '.join(ZOO_NAMES)}; sources: {', '.join(f'{s}:NAME' for s in SOURCES)}."
            f"{did_you_mean(target, ZOO_NAMES)}{hint}"
        )
    module_part, _, func_name = target.rpartition(":")
    if not module_part or not func_name.isidentifier():
        raise UsageError(
            f"workload target {target!r} is malformed; expected 'path/to/file.py:function' or "
            "'package.module:function' with a function name after the last ':'."
        )
    if _misspelt_source(module_part):
        raise UsageError(
            f"unknown model source {module_part!r} in {target!r} (and no module of that name to import); "
            f"valid sources: {', '.join(SOURCES)}.{did_you_mean(module_part, list(SOURCES))}"
        )
    return call_factory(
        target, sizes, Workload, "a mixprec.Workload; return Workload(model=..., make_batch=..., loss_fn=...)"
    )


def call_factory(target: str, sizes: dict[str, Any], kind: type, expected: str) -> Any:
    """The workload the factory ``target`` ('path/to/file.py:fn' or 'package.module:fn') returns,
    called with the ``sizes`` it accepts; a :class:`UsageError` when it raises, exits or returns
    anything but a ``kind`` (``expected`` says what, in the user's terms). Its spec names the
    factory, by an absolute path for a file, so a child process started elsewhere rebuilds it."""
    module_part, _, func_name = target.rpartition(":")
    module, directory = _load_module(target, module_part)
    factory = _get_factory(target, module, func_name)
    kwargs = _factory_kwargs(target, factory, sizes)
    try:
        with _on_sys_path(directory) if directory else nullcontext():
            workload = factory(**kwargs)
    except SystemExit as exc:
        raise UsageError(
            f"workload factory {target!r} called sys.exit({exc.code!r}); a factory must return "
            f"{expected.split(';')[0]}, not exit."
        ) from None
    except Exception as exc:
        raise UsageError(
            f"workload factory {target!r} raised {type(exc).__name__}: {exc}; fix the factory "
            "(run it directly to see the traceback, or use 'mixprec --debug')."
        ) from exc
    if not isinstance(workload, kind):
        raise UsageError(f"workload factory {target!r} returned {_type_name(workload)}, expected {expected}.")
    workload = cast(Any, workload)
    if workload.spec is None:
        spec_target = f"{Path(module_part).resolve()}:{func_name}" if directory else target
        workload.spec = WorkloadSpec("factory", spec_target, tuple(sorted(sizes.items())))
    return workload


def workload_from_spec(spec: WorkloadSpec) -> Workload:
    """Rebuild a workload from its spec (e.g. in a child process)."""
    if not isinstance(spec, WorkloadSpec):
        raise UsageError(
            f"workload_from_spec expects a WorkloadSpec, got {type(spec).__name__}; "
            "pass workload.spec or WorkloadSpec(kind, target, sizes)."
        )
    if spec.kind not in SPEC_KINDS:
        raise UsageError(
            f"WorkloadSpec.kind {spec.kind!r} is invalid; valid kinds: {', '.join(SPEC_KINDS)}."
            + did_you_mean(spec.kind, SPEC_KINDS)
        )
    if spec.kind == "zoo":
        return build_zoo_workload(spec.target, **dict(spec.sizes))
    if spec.kind == "model":
        return build_named(spec.target, dict(spec.sizes))
    return load_workload(spec.target, **dict(spec.sizes))


# --------------------------------------------------------------------------------------------------


def _type_name(value: Any) -> str:
    cls = type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _misspelt_source(module_part: str) -> bool:
    """'tim' in 'tim:convnext_atto': close to a model source and not an importable module."""
    if _is_file_target(module_part) or "." in module_part or not did_you_mean(module_part, list(SOURCES)):
        return False
    try:
        return importlib.util.find_spec(module_part) is None
    except (ImportError, ValueError):
        return True


def _is_file_target(module_part: str) -> bool:
    return module_part.endswith(".py") or "/" in module_part or "\\" in module_part


@contextmanager
def _on_sys_path(directory: str) -> Iterator[None]:
    """Put ``directory`` first on sys.path for the duration; afterwards remove exactly that one entry."""
    sys.path.insert(0, directory)
    try:
        yield
    finally:
        # Removes the first occurrence: ours, or an equal one the code put in front, same net effect.
        if directory in sys.path:
            sys.path.remove(directory)


def _load_module(target: str, module_part: str) -> tuple[ModuleType, str | None]:
    """The module, and for a file target the directory to keep importable while its code runs."""
    if _is_file_target(module_part):
        module = _load_file(target, Path(module_part))
        return module, str(Path(module.__file__ or ".").parent)
    try:
        return importlib.import_module(module_part), None
    except ImportError as exc:
        raise UsageError(
            f"cannot import module {module_part!r} of workload target {target!r}: "
            f"{type(exc).__name__}: {exc}. Install the package or add its directory to PYTHONPATH, "
            "or pass a file path instead ('path/to/file.py:function')."
        ) from exc
    except Exception as exc:
        raise UsageError(
            f"importing module {module_part!r} of workload target {target!r} raised "
            f"{type(exc).__name__}: {exc}; fix the module."
        ) from exc


def _load_file(target: str, path: Path) -> ModuleType:
    path = path.expanduser()
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise UsageError(
            f"workload file {str(path)!r} of target {target!r} {what} (looked in {str(Path.cwd())!r}); "
            "pass the path of an existing .py file, e.g. 'train.py:make_workload'."
        )
    path = path.resolve()
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module_name = f"_mixprec_workload_{path.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise UsageError(
            f"cannot load {str(path)!r} of workload target {target!r} as a Python module; pass a .py file."
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickle look the module up here
    try:
        with _on_sys_path(str(path.parent)):  # so the file can import its siblings
            spec.loader.exec_module(module)
    except BaseException as exc:
        sys.modules.pop(module_name, None)
        if isinstance(exc, SystemExit):
            raise UsageError(
                f"workload file {str(path)!r} of target {target!r} called sys.exit({exc.code!r}) while "
                "mixprec imported it; put the script's own code under `if __name__ == '__main__':`."
            ) from None
        if not isinstance(exc, Exception):
            raise
        raise UsageError(
            f"executing workload file {str(path)!r} of target {target!r} raised "
            f"{type(exc).__name__}: {exc}; fix the file (run 'python {path}' to see the traceback)."
        ) from exc
    return module


def _get_factory(target: str, module: ModuleType, func_name: str) -> Any:
    if not hasattr(module, func_name):
        callables = sorted(
            name
            for name, value in vars(module).items()
            if callable(value)
            and not name.startswith("_")
            and not inspect.isclass(value)
            and not inspect.ismodule(value)
        )
        listing = ", ".join(callables) if callables else "none"
        raise UsageError(
            f"workload target {target!r}: module {module.__name__!r} has no function {func_name!r}; "
            f"its functions: {listing}.{did_you_mean(func_name, callables)} "
            "Fix the name after ':'."
        )
    factory = getattr(module, func_name)
    if not callable(factory):
        raise UsageError(
            f"workload target {target!r}: {func_name!r} is a {type(factory).__name__}, not callable; "
            "point the target at a function that returns a Workload."
        )
    return factory


def _factory_kwargs(target: str, factory: Any, sizes: dict[str, Any]) -> dict[str, Any]:
    if not sizes:
        return {}
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # builtins without a signature: pass everything
        return dict(sizes)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(sizes)
    accepted = [
        name
        for name, p in params.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
    for key in sizes:
        if key not in accepted:
            options = ", ".join(accepted) if accepted else "none (it takes no arguments)"
            raise UsageError(
                f"workload factory {target!r} does not accept {key}={sizes[key]!r}; "
                f"its keyword arguments: {options}.{did_you_mean(key, accepted)} "
                f"Drop {key} or add a '{key}' parameter to the factory."
            )
    return dict(sizes)
