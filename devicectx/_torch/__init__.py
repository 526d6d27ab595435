"""Every use of torch's private APIs and dynamo's internals, so that a new torch release is
checked in one folder (``tests/test_layout.py`` keeps them here; CI runs the tests marked
``torch_internals`` on every minor release).

- ``modes``: torch's per-thread function-mode stack, its ``DeviceContext`` and default slot;
- ``constructors``: the constructors ``DeviceContext`` fills in, TorchScript's table of them;
- ``dynamo``: dynamo's hooks: inlining, constants, trace rules, fake tensors, graph breaks;
- ``module_hooks``: told when a module's tensors may have moved (``Module._apply``);
- ``module_tree``: a module's submodules and tensors, walked without hashing modules;
- ``pytree``: torch's pytree, which dynamo traces;
- ``fsdp``: FSDP2's module class;
- ``tensors``: a tensor's base and version counter, and what a staged move's small
  results are made with (storage slices at C++ speed, below autograd);
- ``optim``: the ``step`` wrapper an LR scheduler puts on its optimizer, kept on the
  testing kit's copies;
- ``backends``: the name of the PrivateUse1 backend, and the registration of its module.
"""

#: Private names reached outside this folder that are not torch's private API, each with why
#: (``tests/test_layout.py`` fails on a private module attribute not listed here, and on an
#: entry nothing uses).
NOT_TORCH_PRIVATE: dict[str, str] = {
    "sys._getframe": "CPython's frame access, to find the caller (no torch API involved)",
    "atexit._run_exitfuncs": "CPython's exit handlers, run by the emulated accelerator's "
    "runner (python -m devicectx.testing.emulate) before it leaves with os._exit",
    "os._exit": "the emulated accelerator's runner leaves short of the interpreter's "
    "finalization, where the device's worker threads made C++'s static destructors abort",
}
