"""The scope: ``on_device`` and what runs inside a block.

- ``_stack``: the scopes open in each thread, asyncio task and decorated call, and the entry
  and exit of one (the hot path of a block and of a decorated call);
- ``_context``: ``on_device``, the public block and decorator;
- ``_constructors``: torch's constructors filled in with the block's device;
- ``_index``: the accelerator's current index, per thread: the devices a scope keeps it
  for (``INDEX_READERS``), given back in order, followed by threads that run a copy of a
  block's context;
- ``_resumed``: generators and coroutines that re-enter their block on every resume;
- ``_precision``: ``precision_scope`` and ``choose_precision``;
- ``_audit``: ``on_device(audit=...)``, naming constructors the block did not reach;
- ``_optimizer_step``: torch's optimizers step as outside every scope, their closures in it;
  ``_suspended``: a scope set aside for one call in one thread, which that takes.
"""
