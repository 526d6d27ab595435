"""The move engine: ``to_device``, ``find_devices`` and what they are built from.

- ``_move``: ``to_device`` and the entry points the decorator calls;
- ``_walk``: reading walks (``find_devices``, ``find_layouts``, ``iter_tensors``);
- ``_rebuild``: the moving walk, rebuilding each container with its moved contents;
- ``_containers``: how each kind of container is opened and rebuilt (``register_container``);
- ``_alias``: tensors moved once however often they appear, views kept as views;
- ``_paths``: the nested paths errors and reports name (``batch['x'][0]``);
- ``_skip``: ``skip=``, what a move leaves where it is;
- ``_staging`` and ``_pinned``: small tensors moved in one copy through pinned buffers;
- ``_streams``: the copy stream of each accelerator device (non-blocking moves, ``prefetch``);
- ``_transfers``: ``track_transfers``, and what reads every move's copies;
- ``_repeats``: the repeated-move warning (a constant copied to the device every step);
- ``_prefetch``: ``prefetch``, batches moved ahead of the step on a copy stream;
- ``_background``: the thread of its own a prefetcher moves its batches on;
- ``_distributed``: DTensor and FSDP2 parameters (``Layout``).
"""
