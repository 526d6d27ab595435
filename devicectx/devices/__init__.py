"""The device tools.

- ``_resolve``: ``resolve_device``, ``explain_device``, ``available_devices``;
- ``_capabilities``: ``supports_dtype``, ``device_capabilities``: what a device can hold
  (MPS: no float64), asked once per dtype; and the device types whose copies devicectx
  always makes blocking;
- ``_report`` and ``_cli``: the device report (``python -m devicectx``);
- ``_oom``: ``shrink_batch_on_oom``, out-of-memory back-off;
- ``_xla``: XLA devices, through the ``torch_xla`` package, where it is installed.
"""
