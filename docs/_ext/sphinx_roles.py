"""A griffe extension for the API reference: the docstrings' Sphinx habits, read as Markdown.

devicectx's docstrings are Google style, as Napoleon reads it, with a little
reStructuredText. griffe reads Google style more strictly, and Markdown has no roles. So,
in each docstring when the site is built (the source is left alone):

- a Sphinx role (:func:`to_device`, :class:`~x.Y`) becomes a link where it names an object
  the API pages show (an entry ``::: devicectx.to_device``, or a documented member of
  one), and inline code otherwise;
- a literal block (a line ending with ``::``, then an indented block) becomes a fenced code
  block after a line ending with ``:``;
- ``Example:`` before doctests becomes ``Examples:``, the section griffe renders as code
  (it reads ``Example:`` as the title of a note, and the doctests as quotes);
- a ``Raises:`` section that names no exception ("The same errors as f.") becomes a
  sentence ("Raises the same errors as f."), which griffe would otherwise warn about.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|attr|mod|data|exc|obj):`([^`]+)`")
SECTION_TITLE = re.compile(r"[A-Z][\w ()]*")
EXCEPTIONS = re.compile(r"[A-Za-z_][\w.]*(\s*,\s*[A-Za-z_][\w.]*)*\s*:")
ENTRY = re.compile(r"^::: ([\w.]+)", re.MULTILINE)


class SphinxRoles(griffe.Extension):
    """Rewrite Sphinx roles and ``::`` in every docstring of the loaded package.

    ``api_pages``: the pages whose ``:::`` entries the roles may link to.
    """

    def __init__(self, api_pages: list[str]) -> None:
        super().__init__()
        self._entries = [
            entry for page in api_pages for entry in ENTRY.findall(Path(page).read_text())
        ]
        self._public: dict[str, str] | None = None

    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        docstring = obj.docstring
        if obj.is_alias or docstring is None:
            return
        if self._public is None:
            self._public = public_paths(loader, self._entries)
        public = self._public
        text = ROLE.sub(lambda match: rewrite(match.group(1), obj, loader, public), docstring.value)
        docstring.value = "\n".join(sections(text.split("\n")))


def sections(lines: list[str]) -> list[str]:
    """The docstring's literal blocks, ``Example:`` and bare ``Raises:`` rewritten."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        end = _block_end(lines, i + 1, indent)
        block = [text for text in lines[i + 1 : end] if text.strip()]
        if not block:
            out.append(line)
        elif stripped.endswith("::"):
            out += literal_block(stripped[:-2], indent, lines[i + 1 : end])
            i = end - 1
        elif stripped == "Example:" and block[0].lstrip().startswith(">>>"):
            out.append(line.replace("Example:", "Examples:"))
        elif stripped == "Raises:" and not EXCEPTIONS.match(block[0].lstrip()):
            sentence = " ".join(text.strip() for text in block)
            out.append(f"{' ' * indent}Raises {sentence[:1].lower()}{sentence[1:]}")
            i = end - 1
        else:
            out.append(line)
        i += 1
    return out


def literal_block(title: str, indent: int, body: list[str]) -> list[str]:
    """``title::`` and its indented block as ``title:`` and a fenced block.

    A title alone (``Example::``) is a section of its own, whose content griffe reads
    indented under it; a sentence ends a paragraph, and the block follows at its level.
    """
    at = " " * (indent + 4 if SECTION_TITLE.fullmatch(title) else indent)
    language = "python" if "Example" in title else "text"
    body = body[next(k for k, text in enumerate(body) if text.strip()) :]
    depth = min(len(text) - len(text.lstrip()) for text in body if text.strip())
    code = [at + text[depth:] if text.strip() else "" for text in body]
    return [f"{' ' * indent}{title}:" if title else "", "", f"{at}```{language}", *code, f"{at}```"]


def _block_end(lines: list[str], start: int, indent: int) -> int:
    """The end of the block indented deeper than ``indent`` from ``start``, trailing blanks out."""
    end = start
    for j in range(start, len(lines)):
        if lines[j].strip() and len(lines[j]) - len(lines[j].lstrip()) <= indent:
            break
        end = j + 1
    while end > start and not lines[end - 1].strip():
        end -= 1
    return end


def public_paths(loader: griffe.GriffeLoader, entries: list[str]) -> dict[str, str]:
    """Map the canonical path of each object the API pages show to the path they show it at."""
    paths: dict[str, str] = {}
    for entry in entries:
        try:
            paths[loader.modules_collection.get_member(entry).canonical_path] = entry
        except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            continue
    return paths


def rewrite(
    target: str, obj: griffe.Object, loader: griffe.GriffeLoader, public: dict[str, str]
) -> str:
    """``:func:`~a.b``` as ``[`b`][a.b]`` if ``a.b`` is documented, else as ```b```."""
    title, _, explicit = target.partition(" <")
    if explicit:
        target = explicit.rstrip(">")
    short = target.startswith("~")
    target = target.lstrip("~.").removesuffix("()")
    if not explicit:
        title = target.rsplit(".", 1)[-1] if short else target
    shown = f"`{title}`"
    path = public_path(target, obj, loader, public)
    return f"[{shown}][{path}]" if path else shown


def public_path(
    target: str, obj: griffe.Object, loader: griffe.GriffeLoader, public: dict[str, str]
) -> str | None:
    """Where the site documents ``target`` (resolved in ``obj``'s scope), or None."""
    head, _, rest = target.partition(".")
    try:
        resolved = obj.resolve(head) + (f".{rest}" if rest else "")
    except griffe.NameResolutionError:
        resolved = target
    try:
        found = loader.modules_collection.get_member(resolved)
        canonical = found.canonical_path
    except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None
    if canonical in public:
        return public[canonical]
    # A documented member of a class or module the pages show: shown in its owner's entry.
    owner, _, member = canonical.rpartition(".")
    if owner in public and not member.startswith("_") and found.docstring is not None:
        return f"{public[owner]}.{member}"
    return None
