"""Third-party log lines that say nothing to a mixprec user, dropped from mixprec's output (the
CLI's process and every candidate process).

Importing transformers imports torchao when it is installed (the ``fp8`` extra), and torchao
0.18 registers two Enums as pytree constants, which torch 2.14 answers with a deprecation
warning per Enum on stderr: two ``W... torch/utils/_pytree.py`` lines before anything mixprec
says (a one-line error included), about code that is neither the user's nor mixprec's. And on a
machine without CUDA, every process that compiles (each torch.compile candidate) logs that
cpp_extension found no CUDA runtime, the expected state of a CPU run, once per candidate. A
compiled training step traces ``optimizer.step()``, whose profiler ``record_function`` Dynamo says
it ignores (``W... torch/_logging/_internal.py ... Profiler record function ... will be ignored``),
once per compiling process, in the middle of tune's progress lines.
"""

from __future__ import annotations

import logging

# (logger, a phrase of the message) pairs that are dropped; anything else from the logger shows
KNOWN_NOISE = (
    ("torch.utils._pytree", "is an Enum subclass and is now natively supported"),
    ("torch.utils.cpp_extension", "No CUDA runtime is found"),
    ("torch._dynamo.variables.ctx_manager", "Profiler record function"),
)


class _DropPhrase(logging.Filter):
    def __init__(self, phrase: str) -> None:
        super().__init__()
        self.phrase = phrase

    def filter(self, record: logging.LogRecord) -> bool:
        return self.phrase not in record.getMessage()


def quiet_known_noise() -> None:
    """Drop :data:`KNOWN_NOISE` in this process (once; calling again adds nothing)."""
    for name, phrase in KNOWN_NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropPhrase) and f.phrase == phrase for f in logger.filters):
            logger.addFilter(_DropPhrase(phrase))
