"""torch's pytree (``torch.utils._pytree``): the containers dynamo traces a walk of.

Private in every torch devicectx supports (2.6 to 2.15); the functions used here have kept
their signatures across those releases.

Example:
    >>> import torch
    >>> tree_map(lambda t: t + 1, {"x": [torch.zeros(1)]})
    {'x': [tensor([1.])]}
"""

from torch.utils._pytree import keystr, tree_flatten_with_path, tree_map

__all__ = ["keystr", "tree_flatten_with_path", "tree_map"]
