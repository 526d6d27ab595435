"""The emulated accelerator's C++ sources, its build, and the ``torch.emu`` device module.

The public API is :mod:`devicectx.testing.emulated`; this package is its implementation.
"""
