"""The decorator: ``@device_agnostic``.

- ``_decorator``: the public decorator and its options;
- ``_wrappers``: the wrapt wrappers for each binding form (function, method, class);
- ``_plan``: what one eager call does (find the target, move or check, run in scope);
- ``_compiled``: the same call written for dynamo, a layer above the plan;
- ``_stand_ins``: the errors traced code raises on torch 2.6 (delete with 2.6);
- ``_probe``: whether this torch's dynamo honours the inline hook;
- ``_params``, ``_inputs``: a signature's tensor parameters, and reading a call's tensors;
- ``_autograd``: which ``autograd.Function`` a ``forward`` belongs to (no move in there);
- ``_optimizers``: an optimizer argument still stepping the parameters a move replaced;
- ``_target``: the call's device (``device=``, a module's parameters, the scope);
- ``_module_watch``: a module's device, cached until torch says its tensors moved;
- ``_spread``: models spread over devices, on purpose (accelerate's hooks,
  ``declare_spread``) or by mistake; ``module_placement``;
- ``_mismatch``: the error that names each argument on the wrong device;
- ``_unseen``: torch's device mismatch inside a body, told in devicectx's words (the
  tensors the decorator could not see).
"""
