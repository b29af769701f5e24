"""TensorFlow and Keras, imported on first use: ``import mixprec`` and every torch command never
import them (``tests/test_keras_seam.py`` checks it).

Keras 3 runs on several backends; mixprec measures TensorFlow's, so ``KERAS_BACKEND`` must be
``tensorflow`` (the default). TensorFlow's C++ start-up chatter (oneDNN, CUDA stub and cuInit lines,
absl's "before InitializeLog" warning) is silenced unless the user set ``TF_CPP_MIN_LOG_LEVEL``
themselves: errors that matter reach Python as exceptions.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from typing import Any

from mixprec.errors import UnsupportedError, UsageError

INSTALL_HINT = "pip install 'mixprec[tensorflow]' (tensorflow 2.21 with Keras 3)"


def missing() -> str | None:
    """Why TensorFlow/Keras cannot be used here, or None when they can (without importing them)."""
    for module in ("tensorflow", "keras"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed; {INSTALL_HINT}"
    backend = os.environ.get("KERAS_BACKEND", "tensorflow")
    if backend != "tensorflow":
        return (
            f"KERAS_BACKEND={backend!r}: mixprec measures Keras on TensorFlow; unset it or set "
            "KERAS_BACKEND=tensorflow"
        )
    return None


def tf() -> Any:
    """The ``tensorflow`` module; :class:`UnsupportedError` (exit 3) when it cannot be used."""
    reason = missing()
    if reason:
        raise UnsupportedError(f"the TensorFlow framework needs TensorFlow: {reason}.")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    _torch_compiler_first()
    # "3" as well: candidate processes inherit the level this sets and must be quiet too
    if "tensorflow" in sys.modules or os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3") != "3":
        import tensorflow

        return tensorflow
    # absl writes the import's info lines straight to file descriptor 2 before any log level
    # applies (TF_CPP_MIN_LOG_LEVEL=3 leaves them): only a redirect of the descriptor hides them.
    with _stderr_to_devnull():
        import tensorflow

    return tensorflow


def _torch_compiler_first() -> None:
    """Import torch's compiler stack (``torch._dynamo``, which imports triton) before TensorFlow:
    the other way round the process dies with a segmentation fault when triton loads (torch 2.14.1
    with TensorFlow 2.21 on Linux: ``import tensorflow; import torch._dynamo`` exits 139), which a
    Keras tune in a process that also compiles torch, or any later ``torch.compile``, would hit."""
    if "tensorflow" not in sys.modules:
        import torch._dynamo  # noqa: F401


@contextlib.contextmanager
def _stderr_to_devnull() -> Iterator[None]:
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def keras() -> Any:
    """The ``keras`` (3.x) module, on the TensorFlow backend."""
    tf()
    import keras as keras_module

    if not keras_module.__version__.startswith("3."):
        raise UnsupportedError(f"mixprec needs Keras 3, found {keras_module.__version__}; {INSTALL_HINT}.")
    return keras_module


def set_threads(threads: int | None) -> None:
    """TensorFlow's intra-op threads, as torch's are set: only possible before its runtime starts
    (a fresh candidate process); later calls keep what is set."""
    if not threads:
        return
    config = tf().config.threading
    if config.get_intra_op_parallelism_threads() == threads:
        return
    with contextlib.suppress(RuntimeError):  # the runtime is already initialised in this process
        config.set_intra_op_parallelism_threads(threads)


def device_name(device: str) -> str:
    """``'cpu'`` / ``'cuda:N'`` (mixprec's spelling) as TensorFlow's ``'/CPU:0'`` / ``'/GPU:N'``."""
    kind, _, index = str(device).partition(":")
    if kind == "cpu":
        return "/CPU:0"
    if kind == "cuda":
        gpus = tf().config.list_physical_devices("GPU")
        n = int(index or 0)
        if n >= len(gpus):
            raise UnsupportedError(
                f"device {device!r}: TensorFlow sees {len(gpus)} GPU(s) here; use --device cpu or a "
                "visible GPU (TensorFlow's pip wheel needs 'tensorflow[and-cuda]' for CUDA)."
            )
        return f"/GPU:{n}"
    raise UsageError(f"Unknown device {device!r} for TensorFlow; valid: cpu, cuda[:N].")


def default_device() -> str:
    """CUDA when TensorFlow sees a GPU, else the CPU."""
    return "cuda" if tf().config.list_physical_devices("GPU") else "cpu"
