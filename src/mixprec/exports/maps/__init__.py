"""The precision-map targets: a low-format policy's precision map (``keep_bf16``) written for the
stack that trains with it, one module per stack, each a :class:`~mixprec.exports.maps.target.MapTarget`
(an :class:`~mixprec.exports.target.ExportTarget` whose input is the candidate and the model).

The low-format Linear policies (fp8-rowwise, fp8-tensorwise, mxfp8, nvfp4) keep some Linear layers,
or single GEMM directions of them, in bf16 (:mod:`mixprec.policy.lowformat`). The map is resolved
against the model's concrete Linear names (:mod:`.resolve`: globs become the exact names
:func:`~mixprec.policy.lowformat.plan_layers` gives) and written in the form each stack takes:

- ``torchao`` (:mod:`.torchao`): Python. fp8: ``convert_to_float8_training`` with a
  ``module_filter_fn`` that converts exactly the map's layers; mxfp8: those ``nn.Linear`` swapped for
  torchao's ``MXFP8Linear`` (``wgrad_with_hp=True`` for a ``:wgrad`` entry); nvfp4: ``quantize_``
  with ``NVFP4TrainingConfig`` and a ``filter_fn``.
- ``torchtitan`` (:mod:`.torchtitan`): TOML for the releases configured by TOML (v0.2.x):
  ``[quantize.linear.float8]`` or ``[quantize.linear.mx]`` with ``filter_fqns`` (a substring match
  that *skips* modules).
- ``accelerate-fp8`` (:mod:`.accelerate`): Python, fp8 only:
  ``AORecipeKwargs(config=..., module_filter_func=...)``. (``accelerate`` is the training-script
  target of :mod:`mixprec.exports.accelerate`.)
- ``megatron`` (:mod:`.megatron`): YAML for Megatron-LM's ``--te-precision-config-file``.
- ``transformer-engine`` (:mod:`.transformer_engine`): Python: the map's layers as ``te.Linear``
  under a TE recipe.

Every text opens with the header every export has (policy, device, target; what runs, with the map
as resolved and its share of the Linear GEMM work; what the stack cannot express; what you fill in).
Where a stack cannot express the map it is refused, never approximated: the one refusal type,
:class:`~mixprec.errors.ExportRefused`, with ``entry`` naming the map entry or Linear at fault and
the alternative naming the targets that can. Pure text: nothing is imported from the target stacks.
This package imports none of its modules: :mod:`mixprec.exports.registry` lists the family.
"""
