"""The move engine: ``to_device``, ``find_devices`` and what they are built from.

- ``_move``: ``to_device`` and the entry points the decorator calls;
- ``_walk``: reading walks (``find_devices``, ``find_layouts``, ``iter_tensors``);
- ``_rebuild``: the moving walk, rebuilding each container with its moved contents;
- ``_own_to``: objects moved by their own ``.to`` (called on a copy; what it left behind);
- ``_traced``: the moving walk as ``torch.compile`` traces it (the same rebuild, without
  ``id()``);
- ``_containers``: the container registry, which kind each type gets, worked out once and
  cached (``register_container``);
- ``_kinds``: the ``Kind`` model (container, tensor, module, own ``.to``, leaf) and the
  common kinds;
- ``_dataclasses``: dataclasses (``ModelOutput``'s two views included) and
  ``SimpleNamespace``, taken apart and rebuilt;
- ``_collection_types``: the other collections taken apart and rebuilt (``PackedSequence``,
  ``ChainMap``, namedtuples, graphs, lazy stacks, ``UserDict``, any ``Mapping``/``Sequence``);
- ``_attributes``: an instance's attributes as rebuilds copy them (slots, cached properties);
- ``_alias``: tensors moved once however often they appear, views kept as views;
- ``_paths``: the nested paths errors and reports name (``batch['x'][0]``);
- ``_skip``: ``skip=``, what a move leaves where it is;
- ``_dtypes``: ``dtypes=``, what a move does with a dtype the target cannot hold (float64
  on MPS): refuse it, or cast it;
- ``_unmaterialised``: the refusal of a move of modules holding tensors on ``meta``, made
  before any module moves;
- ``_wrapped``: the refusal of a move of a model DDP or FSDP2 (``fully_shard``) wrapped
  at another device, made before any module moves;
- ``_hooks``: modules accelerate hooked (where each part runs), and the refusal of a move
  that takes a part off its hook's device;
- ``_host_arrays``: numpy arrays, which a move leaves on the host (the warning where a
  move got nothing else);
- ``_unseen``: the tensors a move cannot see (attributes of plain objects), looked for
  after a device mismatch, so that the error names them;
- ``_staging`` and ``_pinned``: small tensors moved in one copy through pinned buffers;
- ``_streams``: the copy stream of each accelerator device (non-blocking moves, ``prefetch``);
- ``_transfers``: ``track_transfers``, and what reads every move's copies;
- ``_repeats``: the repeated-move warning (a constant copied to the device every step);
- ``_nbytes``: the bytes a tensor's copy carries (a sparse tensor's indices and values);
- ``_prefetch``: ``prefetch``, batches moved ahead of the step on a copy stream;
- ``_background``: the thread of its own a prefetcher moves its batches on;
- ``_distributed``: DTensor and FSDP2 parameters (``Layout``).
"""
