"""The lint rules: stable ids (like ruff codes), a severity, a rationale, a source and a check.

Ids by family, a module each: MP1xx tensor-core shapes (:mod:`.shapes`), MP2xx memory
format (:mod:`.layout`), MP3xx precision mistakes (:mod:`.precision`), MP4xx fusion
(:mod:`.fusion`). A rule's check takes a :class:`~mixprec.linting.context.LintContext` (the
traced forward pass, the policy, the device) and yields
:class:`~mixprec.linting.model.Finding` objects; it never prints and never changes the model.

Which hardware the tensor-core rules judge (``tensor_core=True``): the lint *target*, by
default the type of the device the policy runs on. Tensor cores are NVIDIA hardware, so on
a CPU target these rules still run (they describe the GPU the model will likely train on)
but every finding they make is ``info``: oneDNN on a CPU blocks channels and pads GEMMs
itself, and nothing there says an unaligned layer is slow. ``lint(target="cuda")`` (CLI
``--target cuda``) judges them at full severity from a machine without a GPU. Under a
policy that computes in strict fp32 no tensor core runs at all, so the alignment rules do
not apply and report nothing (the report says so).

A rule's ``source`` names the public documents it follows. "SURF, 'Deep Learning on A100 GPUs'" is
a tutorial in the user wiki of SURF, which runs the Dutch national supercomputers
(https://servicedesk.surf.nl/wiki/display/WIKI/Deep+Learning+on+A100+GPUs); its tips condense
NVIDIA's cuDNN developer guide.
"""

from mixprec.linting.model import Rule
from mixprec.linting.rules.fusion import FUSION_RULES
from mixprec.linting.rules.layout import LAYOUT_RULES
from mixprec.linting.rules.precision import PRECISION_RULES
from mixprec.linting.rules.shapes import SHAPE_RULES


def _in_id_order(*families: dict[str, Rule]) -> dict[str, Rule]:
    rules: dict[str, Rule] = {}
    for family in families:
        for rule_id, rule in family.items():
            if rule_id in rules:
                raise ValueError(f"rule {rule_id} is defined by two families")
            rules[rule_id] = rule
    return dict(sorted(rules.items()))


# Every rule, in id order: the order they run in and are listed in.
RULES: dict[str, Rule] = _in_id_order(SHAPE_RULES, LAYOUT_RULES, PRECISION_RULES, FUSION_RULES)

__all__ = ["RULES"]
