"""The device tools.

- ``_resolve``: ``resolve_device``, ``explain_device``, ``available_devices``;
- ``_report`` and ``_cli``: the device report (``python -m devicectx``);
- ``_oom``: ``shrink_batch_on_oom``, out-of-memory back-off;
- ``_xla``: XLA devices, through the ``torch_xla`` package, where it is installed.
"""
