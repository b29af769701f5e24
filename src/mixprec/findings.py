"""One vocabulary for what mixprec finds: :class:`Finding`, the base of lint's findings (about a
model, before it runs: :class:`mixprec.linting.model.LintFinding`) and the monitor's (about a run,
at a step: :class:`mixprec.monitor.findings.MonitorFinding`).

Every finding answers the same four questions, under the same names, whichever part of mixprec
made it; each specialisation adds what only it knows (lint: the rule and the fix; the monitor: the
step and what it did) and writes the JSON it always wrote (:meth:`Finding.to_dict`).
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any, ClassVar


def jsonable(value: Any) -> Any:
    """``value`` with what JSON cannot hold spelled out: a non-finite float as its string
    ('inf', 'nan'), mapping keys as strings, tuples as lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


class Finding:
    """One thing mixprec found, at one place.

    A specialisation is a dataclass that provides these four, as fields or properties (declared
    here for the type checker only: a property defined on the base would be taken by a dataclass
    for its field's default):

    Attributes:
        kind: what was found, a short stable name ('overflow', 'conv-channels').
        module: the qualified name of the module it is about; None when it is about the whole
            model or run ('' is the model's own forward).
        message: what is wrong, one line for a person.
        evidence: the figures behind it (JSON-serialisable).
    """

    source: ClassVar[str] = "mixprec"
    """Which part of mixprec made it ('lint', 'monitor'): the first word of :meth:`line`."""

    if TYPE_CHECKING:

        @property
        def kind(self) -> str: ...

        @property
        def module(self) -> str | None: ...

        @property
        def message(self) -> str: ...

        @property
        def evidence(self) -> dict[str, Any]: ...

    @property
    def where(self) -> str:
        """The module's name, '(model forward)' for the model's own forward, '(model)' for none."""
        if self.module is None:
            return "(model)"
        return self.module or "(model forward)"

    def line(self) -> str:
        """The finding as one log line: 'mixprec lint: fc: linear-features: ...'."""
        return f"mixprec {self.source}: {self.where}: {self.kind}: {self.message}"

    def to_dict(self) -> dict[str, Any]:
        """The finding for JSON: each specialisation's own keys, unchanged across versions."""
        raise NotImplementedError(type(self).__name__)

    def to_json(self) -> str:
        """:meth:`to_dict` as one line of JSON (non-finite figures as strings)."""
        return json.dumps(jsonable(self.to_dict()))
