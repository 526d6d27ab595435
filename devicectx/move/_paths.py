"""Paths: where an object sits inside a structure, written as a user would write it.

``batch['mask']`` (a mapping key), ``xs[2]`` (a sequence index), ``out.logits`` (an
attribute or a field), ``list(tags)[0]`` (a set member, in iteration order). A bare
object's path is just its name. An object read two ways (a dataclass that is also a
mapping, such as a transformers ``ModelOutput``) writes each child as it can be reached:
``out.logits`` for a field, ``out['extra']`` for an entry that is no field. Paths are only
ever built when something needs them: :func:`~devicectx.find_devices`, an error message,
or a ``skip`` given as paths.
"""

from __future__ import annotations

import keyword
from collections.abc import Collection, Iterable

import torch
from torch import nn

ITEM = 0
"""Children addressed by ``[key]``: mappings and sequences."""
ATTR = 1
"""Children addressed by ``.name``: dataclass fields, namedtuple fields, registered types."""
MEMBER = 2
"""Children of a set: no key, so ``list(parent)[i]``, in iteration order."""
NAME = 3
"""Children that are roots of their own: the arguments of one call, named by parameter."""
DUAL = 4
"""Children of an object with two views (a dataclass that is also a mapping or a sequence):
a key of type ``str`` is a field or an attribute, written ``.name`` where Python can write
it so; any other key, :class:`Entry` included, is an entry, written ``[key]``."""


class Entry(str):
    """A ``str`` key of an entry that is no field, in a :data:`DUAL` container.

    Equal to (and hashed as) the plain string, so ``skip='labels'`` still matches it.
    """

    __slots__ = ()


def key_text(key: object) -> str:
    """``key`` as a path writes it in brackets: its ``repr``, but a tensor (an optimizer's
    state is keyed by its parameters) by kind, shape and device, not by its values.

    Example:
        >>> key_text("mask"), key_text(3)
        ("'mask'", '3')
        >>> key_text(nn.Parameter(torch.zeros(4, 4)))
        '<Parameter (4, 4) on cpu>'
    """
    if isinstance(key, torch.Tensor):
        return f"<{type(key).__name__} {tuple(key.shape)} on {key.device}>"
    return repr(key)


def join(parent: str, style: int, key: object) -> str:
    """The path of the child at ``key`` of the object at path ``parent``."""
    if style == ITEM:
        return f"{parent}[{key_text(key)}]"
    if style == ATTR:  # a registered container's keys may be no names (its indices)
        return f"{parent}.{key}" if type(key) is str else f"{parent}[{key_text(key)}]"
    if style == MEMBER:
        return f"list({parent})[{key}]"
    if style == DUAL:
        return f"{parent}{_dual(key)}"
    return str(key)


# A tuple, not keyword.iskeyword (a frozenset's bound __contains__): module paths are also
# written while torch.compile traces an error, and dynamo (torch 2.6) cannot trace that.
_KEYWORDS = tuple(keyword.kwlist)


def _dual(key: object) -> str:
    if type(key) is str and key.isidentifier() and key not in _KEYWORDS:
        return f".{key}"
    return f"[{key_text(key)}]"


def build(root: str, parts: Iterable[tuple[int, object]]) -> str:
    """The path reached from ``root`` through ``(style, key)`` parts, outermost first.

    In time linear in the path's length, where joining part by part would be quadratic:
    a path 100,000 levels deep is 300,000 characters long.
    """
    pieces = [root]
    for style, key in parts:
        if style == ITEM:
            pieces.append(f"[{key_text(key)}]")
        elif style == ATTR:
            pieces.append(f".{key}")
        elif style == MEMBER:
            pieces = [f"list({''.join(pieces)})[{key}]"]
        elif style == DUAL:
            pieces.append(_dual(key))
        else:
            pieces = [str(key)]
    return "".join(pieces)


def module_path(parent: str, qualified_name: str, keyed: Collection[str] = ()) -> str:
    """The path of a submodule, parameter or buffer of the module at ``parent``.

    ``layers.0.weight`` becomes ``model.layers[0].weight``: the digits are indices of a
    ``ModuleList`` or ``Sequential``, which Python code writes with brackets. A name that
    is no identifier (a ``ModuleDict`` key such as ``cls-head``) is written as a key,
    ``model.heads['cls-head'].weight``, as ``getattr`` is the only other way to reach it.

    Args:
        keyed: the qualified names (``""``: the module at ``parent`` itself) of the modules
            whose children are a dict's keys (:func:`keyed_modules`): a ``ModuleDict``'s
            ``heads.1`` is ``model.heads['1']``, as its keys are strings even when they
            are digits (``heads[1]`` raises ``KeyError``); ``heads.cls`` stays
            ``model.heads.cls``.
    """
    pieces = [parent]
    owner = ""  # the qualified name of the module whose child is the part
    for part in qualified_name.split("."):
        if keyed and owner in keyed:  # a key: an attribute where it is an identifier
            pieces.append(_dual(part))
        # ASCII only: "²".isdigit() is True, but no ModuleList index is written so.
        elif part.isascii() and part.isdigit():
            pieces.append(f"[{part}]")
        else:
            pieces.append(_dual(part))
        owner = f"{owner}.{part}" if owner else part
    return "".join(pieces)


# Modules whose children are reached by string key only: ``[1]`` is a KeyError there.
_KEYED = (nn.ModuleDict, nn.ParameterDict)


def keyed_modules(named: Iterable[tuple[str, nn.Module]]) -> tuple[str, ...]:
    """The qualified names of the ``ModuleDict`` and ``ParameterDict`` modules among
    ``named`` (a module's ``named_modules()``, or a walk that lists each place): what
    :func:`module_path` needs to write their keys as keys.

    A tuple, as :data:`_KEYWORDS`: module paths are also written while torch.compile traces
    an error, and dynamo (torch 2.6) traces ``in`` on a tuple.
    """
    return tuple(path for path, module in named if isinstance(module, _KEYED))


def is_path(text: str, root: str) -> bool:
    """Whether ``text`` is a path under ``root`` (``obj['x']``, ``obj.y``), not a bare key."""
    return text.startswith((f"{root}[", f"{root}.", f"list({root}"))


def within(path: str, ancestor: str) -> bool:
    """Whether ``path`` is ``ancestor`` or under it; ``""`` is the root, which holds every
    path. For a structure's paths and for modules' qualified names alike.

    Example:
        >>> [within(p, "model.a") for p in ["model.a", "model.a[0]", "model.a.b", "model.ab"]]
        [True, True, True, False]
        >>> within("encoder.layer", "")
        True
    """
    if not ancestor:
        return True
    return path.startswith(ancestor) and path[len(ancestor) : len(ancestor) + 1] in ("", ".", "[")
