"""Paths: where an object sits inside a structure, written as a user would write it.

``batch['mask']`` (a mapping key), ``xs[2]`` (a sequence index), ``out.logits`` (an
attribute or a field), ``list(tags)[0]`` (a set member, in iteration order). A bare
object's path is just its name. Paths are only ever built when something needs them:
:func:`~devicectx.find_devices`, an error message, or a ``skip`` given as paths.
"""

from __future__ import annotations

from collections.abc import Iterable

ITEM = 0
"""Children addressed by ``[key]``: mappings and sequences."""
ATTR = 1
"""Children addressed by ``.name``: dataclass fields, namedtuple fields, registered types."""
MEMBER = 2
"""Children of a set: no key, so ``list(parent)[i]``, in iteration order."""
NAME = 3
"""Children that are roots of their own: the arguments of one call, named by parameter."""


def join(parent: str, style: int, key: object) -> str:
    """The path of the child at ``key`` of the object at path ``parent``."""
    if style == ITEM:
        return f"{parent}[{key!r}]"
    if style == ATTR:
        return f"{parent}.{key}"
    if style == MEMBER:
        return f"list({parent})[{key}]"
    return str(key)


def build(root: str, parts: Iterable[tuple[int, object]]) -> str:
    """The path reached from ``root`` through ``(style, key)`` parts, outermost first.

    In time linear in the path's length, where joining part by part would be quadratic:
    a path 100,000 levels deep is 300,000 characters long.
    """
    pieces = [root]
    for style, key in parts:
        if style == ITEM:
            pieces.append(f"[{key!r}]")
        elif style == ATTR:
            pieces.append(f".{key}")
        elif style == MEMBER:
            pieces = [f"list({''.join(pieces)})[{key}]"]
        else:
            pieces = [str(key)]
    return "".join(pieces)


def module_path(parent: str, qualified_name: str) -> str:
    """The path of a parameter or buffer of the module at ``parent``.

    ``layers.0.weight`` becomes ``model.layers[0].weight``: the digits are indices of a
    ``ModuleList`` or ``Sequential``, which Python code writes with brackets.
    """
    parts = [parent]
    for part in qualified_name.split("."):
        parts.append(f"[{part}]" if part.isdigit() else f".{part}")
    return "".join(parts)


def is_path(text: str, root: str) -> bool:
    """Whether ``text`` is a path under ``root`` (``obj['x']``, ``obj.y``), not a bare key."""
    return text.startswith((f"{root}[", f"{root}.", f"list({root}"))
