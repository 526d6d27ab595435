"""The scope: ``on_device`` and what runs inside a block.

- ``_context``: ``on_device``, the block's device per thread, asyncio task and generator;
- ``_constructors``: torch's constructors filled in with the block's device;
- ``_resumed``: generators and coroutines that re-enter their block on every resume;
- ``_precision``: ``precision_scope`` and ``choose_precision``;
- ``_audit``: ``on_device(audit=...)``, naming constructors the block did not reach.
"""
