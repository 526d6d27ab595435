"""The documentation: README.md and the site in docs/ (built by mkdocs; CI builds it strict).

What mkdocs checks when it builds is not repeated here. These tests need no mkdocs: the
links and anchors (README.md too, which the site does not build), the nav, the Python
examples (run), and the performance page's figures (each one printed by a benchmark run
kept in docs/figures/).
"""

from __future__ import annotations

import re
import unicodedata
import warnings
from decimal import Decimal
from pathlib import Path
from typing import NamedTuple

import pytest

import devicectx

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
MARKDOWN = [ROOT / "README.md", *PAGES]
FIGURES = DOCS / "figures"

FENCE = re.compile(r"^( *)(```+)(\S*)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
NOT_RUN = re.compile(r"^\s*<!-- not run: (.+) -->\s*$")
NOT_FROM_RUNS = re.compile(r"^<!-- figures not from these runs: (.+) -->$")
OTHER_SCRIPT = re.compile(
    r"^`python (?:-m devicectx\.testing\.emulate (?:--devices \d+ )?)?"
    r"benchmarks/(\w+\.py)"
)
SNIPPET = re.compile(r'^\s*--8<-- "([^":]+)(?::(\d+):(\d+))?"\s*$')
# A figure: a number, or a range of two, then a unit the benchmark prints (fmt_ns: ns, µs,
# ms, s; ratios: x). "8x8" and "x128" are shapes, not figures.
FIGURE = re.compile(
    r"(?<![\w.])(\d[\d,]*(?:\.\d+)?)(?:-(\d[\d,]*(?:\.\d+)?))? ?(ns|µs|ms|s|x)(?![\w])"
)
TARGET = re.compile(r"(?:<=|>=|~) ?$")


def rel(path: Path) -> str:
    """``path`` as the tests name it: relative to the repository."""
    return path.relative_to(ROOT).as_posix()


def prose(text: str) -> str:
    """``text`` with its fenced code blocks blanked (line numbers kept)."""
    lines, fence = text.split("\n"), None
    for i, line in enumerate(lines):
        match = FENCE.match(line)
        if fence is None and match:
            fence = match.group(2)
            lines[i] = ""
        elif fence is not None:
            if line.strip() == fence:
                fence = None
            lines[i] = ""
    return "\n".join(lines)


def slug(heading: str) -> str:
    """The anchor mkdocs gives a heading: Python-Markdown's ``toc`` slugify of its text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(text: str) -> set[str]:
    """The anchors of a page: one per heading (made unique as toc does), one per API entry."""
    found: set[str] = set()
    for line in prose(text).split("\n"):
        if heading := re.match(r"#{1,6} (.+)", line):
            base = anchor = slug(heading.group(1))
            count = 0
            while anchor in found:
                count += 1
                anchor = f"{base}_{count}"
            found.add(anchor)
        elif entry := re.match(r"::: ([\w.]+)", line):
            found.add(entry.group(1))
    return found


def relative_links() -> list[tuple[Path, int, str]]:
    """Every relative link in README.md and docs/*.md: (page, line, target)."""
    links = []
    for page in MARKDOWN:
        # Code spans blanked in place (they may run over a line end, and so may a link).
        text = re.sub(
            r"`[^`]*`", lambda span: re.sub(r"[^\n]", " ", span.group()), prose(page.read_text())
        )
        for match in LINK.finditer(text):
            target = match.group(1)
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):
                links.append((page, text.count("\n", 0, match.start()) + 1, target))
    return links


@pytest.mark.parametrize(
    ("page", "line", "target"),
    relative_links(),
    ids=[f"{rel(page)}:{line}:{target}" for page, line, target in relative_links()],
)
def test_relative_link_points_to_a_file_and_heading_that_exist(
    page: Path, line: int, target: str
) -> None:
    """A relative link opens a file that exists (inside docs/ from a page), at an anchor it has."""
    path_part, _, anchor = target.partition("#")
    destination = (page.parent / path_part).resolve() if path_part else page
    assert destination.exists(), f"{rel(page)}:{line}: {target} does not exist"
    if page.parent == DOCS:
        assert destination.is_relative_to(DOCS), f"{rel(page)}:{line}: {target} leaves docs/"
    if anchor:
        assert destination.suffix == ".md", f"{rel(page)}:{line}: an anchor into a non-page"
        assert anchor in anchors(destination.read_text()), f"{rel(page)}:{line}: no #{anchor}"


def test_links_were_found() -> None:
    """The link test has links to check: README.md links to the guides, and they to each other."""
    pages = {page for page, _, _ in relative_links()}
    assert ROOT / "README.md" in pages
    assert len(pages) > len(PAGES) // 2


def test_anchors_follow_python_markdown() -> None:
    """Headings with code, punctuation and repeats get the anchors mkdocs gives them."""
    page = "# `on_device`: the default device\n## Limits\n## Limits\n```\n# not a heading\n```\n"
    assert {"on_device-the-default-device", "limits", "limits_1"} == anchors(page)


def nav_pages() -> list[str]:
    """The pages mkdocs.yml's nav lists, in order (read without a YAML parser)."""
    config = (ROOT / "mkdocs.yml").read_text()
    nav = re.search(r"^nav:\n((?:[ \t]+.*\n)+)", config, re.MULTILINE)
    assert nav is not None, "mkdocs.yml has no nav"
    return re.findall(r"^\s*- (?:[^:\n]+: )?(\S+\.md)\s*$", nav.group(1), re.MULTILINE)


def test_every_page_is_in_the_nav_and_every_nav_entry_exists() -> None:
    """docs/*.md and mkdocs.yml's nav list the same pages, each once."""
    listed = nav_pages()
    assert sorted(set(listed)) == sorted(listed), "a page is listed twice"
    assert sorted(page.name for page in PAGES) == sorted(listed)


class Block(NamedTuple):
    """A ```python block of a page, and the output block shown after it, if any."""

    page: Path
    line: int
    code: str
    not_run: str | None  # why it does not run, from the marker above it
    shown: str  # the next fenced block, when only a sentence or nothing comes between


def fenced_blocks(lines: list[str]) -> list[tuple[int, int, str, str]]:
    """(first line, closing line, language, code) of each fenced block, indentation removed."""
    blocks, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence, language = match.groups()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == fence)
        code = "\n".join(line[len(indent) :] for line in lines[i + 1 : end])
        blocks.append((i, end, language, code))
        i = end + 1
    return blocks


def python_blocks() -> list[Block]:
    """Every ```python block of README.md and docs/*.md."""
    found = []
    for page in MARKDOWN:
        lines = page.read_text().split("\n")
        blocks = fenced_blocks(lines)
        for k, (start, end, language, code) in enumerate(blocks):
            if language not in ("python", "py"):
                continue
            before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
            marker = NOT_RUN.match(before)
            after = blocks[k + 1] if k + 1 < len(blocks) else None
            between = [text for text in lines[end + 1 : after[0]] if text.strip()] if after else []
            shown = after[3] if after and after[2] != "python" and len(between) <= 1 else ""
            found.append(Block(page, start + 1, code, marker.group(1) if marker else None, shown))
    return found


RUNNABLE = [block for block in python_blocks() if block.not_run is None]
DEVICECTX_WARNINGS = {name for name in devicectx.__all__ if name.endswith("Warning")}


@pytest.mark.parametrize("block", RUNNABLE, ids=[f"{rel(b.page)}:{b.line}" for b in RUNNABLE])
def test_python_example_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Python block of the docs runs as it stands, and warns as the output shown after it.

    On an accelerator that cannot compute in a precision a block asks for (bfloat16 on a
    CUDA GPU before Ampere), the block raises as the docs say it does, and is skipped.
    """
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = compile(block.code, f"{rel(block.page)}:{block.line}", "exec")
        try:
            exec(code, {"__name__": "__main__"})
        except devicectx.PrecisionUnsupportedError as error:
            pytest.skip(f"this machine's accelerator cannot run it: {error}")
    warned = {type(w.message).__name__ for w in caught} & DEVICECTX_WARNINGS
    shown = set(re.findall(r"\b(\w+Warning):", block.shown)) & DEVICECTX_WARNINGS
    assert shown == warned


def test_every_python_block_runs_or_says_why_not() -> None:
    """Most blocks run; each one that does not carries a reason, and every marker is on a block."""
    skipped = [block.not_run for block in python_blocks() if block.not_run is not None]
    assert all(reason.strip() for reason in skipped)
    assert len(RUNNABLE) > len(skipped)
    markers = sum(
        1 for page in MARKDOWN for text in page.read_text().split("\n") if NOT_RUN.match(text)
    )
    assert len(skipped) == markers, "a <!-- not run: ... --> marker is not above a python block"


def figures(text: str) -> list[tuple[str, str]]:
    """The figures in ``text`` as (number, unit), both ends of a range; targets left out."""
    found = []
    for match in FIGURE.finditer(text):
        if TARGET.search(text[max(0, match.start() - 3) : match.start()]):
            continue
        low, high, unit = match.groups()
        found += [(number.replace(",", ""), unit) for number in (low, high) if number]
    return found


def printed(prefix: str) -> dict[str, set[str]]:
    """Every figure the kept runs whose file names start with ``prefix`` printed, by unit."""
    by_unit: dict[str, set[str]] = {}
    for path in sorted(FIGURES.glob(f"{prefix}*.txt")):
        for number, unit in figures(path.read_text()):
            by_unit.setdefault(unit, set()).add(number)
    return by_unit


def was_printed(number: str, unit: str, runs: dict[str, set[str]]) -> bool:
    """``number`` is a figure a run printed, as printed or, from 3 significant digits, rounded."""
    candidates = runs.get(unit, set())
    if number in candidates:
        return True
    if len(number.replace(".", "").lstrip("0")) < 3:
        return False
    quoted = Decimal(number)
    step = Decimal(1).scaleb(quoted.as_tuple().exponent)
    return any(Decimal(value).quantize(step) == quoted for value in candidates)


def checked_passages() -> list[tuple[str, int, str]]:
    """performance.md's passages whose figures are checked: (section, line, text).

    A passage is a paragraph or a table (a table without its target column). Passages
    under a ``<!-- figures not from these runs: why -->`` line are left out, and so are
    code blocks and included snippets.
    """
    lines = prose((DOCS / "performance.md").read_text()).split("\n")
    passages, section, start = [], "", 0
    for i, line in enumerate([*lines, ""]):
        if line.startswith("## "):
            section = line
        if line.strip():
            continue
        block = [text for text in lines[start:i] if text.strip() and not SNIPPET.match(text)]
        start = i + 1
        if not block or NOT_FROM_RUNS.match(block[0]) or block[0].startswith("#"):
            continue
        if block[0].startswith("|"):
            header = [cell.strip() for cell in block[0].strip("|").split("|")]
            target = header.index("target") if "target" in header else None
            rows = [
                [cell for k, cell in enumerate(row.strip("|").split("|")) if k != target]
                for row in block
            ]
            block = ["|".join(row) for row in rows]
        passages.append((section, i - len(block) + 1, " ".join(block)))
    return passages


def test_performance_figures_were_printed_by_a_kept_run() -> None:
    """Each figure performance.md quotes was printed by one of the runs in docs/figures/.

    The 2-core section is checked against the cpu-2core-* runs, the H100 section against the
    h100-* runs, the rest against all. A figure matches when a run printed it as quoted, or
    (with 3 or more significant digits: 82.1 ms for 82.14 ms) rounded as quoted. Targets
    (``<= 0.5x``, the target column) are not figures. This catches a figure typed wrong or
    taken from a run that was not kept; it cannot tell a figure put on the wrong row when
    the same figure is printed on another.
    """
    runs = {"2-core": printed("cpu-2core-"), "H100": printed("h100-"), "": printed("")}
    missing, checked = [], 0
    for section, line, text in checked_passages():
        machine = next(key for key in runs if key in section)
        for number, unit in figures(text):
            checked += 1
            if not was_printed(number, unit, runs[machine]):
                missing.append(f"performance.md:{line}: {number} {unit}")
    assert [] == missing
    assert checked > 50


def test_figure_check_rejects_what_no_run_printed() -> None:
    """The figure check tells a printed figure from a rounded one and from one never printed."""
    runs = {"ms": {"82.14", "4.93"}, "x": {"0.65"}}
    assert was_printed("82.1", "ms", runs)
    assert was_printed("4.93", "ms", runs)
    assert not was_printed("4.9", "ms", runs)  # two digits: as printed, or not at all
    assert not was_printed("82", "ms", runs)
    assert not was_printed("82.2", "ms", runs)
    assert not was_printed("0.66", "x", runs)
    assert [("1.40", "x"), ("1.44", "x"), ("2.76", "µs")] == figures(
        "1.40-1.44x, <= 2x, 8x8, 2.76 µs"
    )


def test_kept_runs_are_the_benchmarks_reports_and_all_shown() -> None:
    """Each file in docs/figures/ is a report bench.py wrote, and performance.md shows its table;
    or the output of another script of benchmarks/, shown whole.

    The page includes lines 3 to N of a report: the command line, then the first table,
    whole; and lines 1 to N of another script's file: its command line, then its output as
    printed, in a code block.
    """
    page = (DOCS / "performance.md").read_text()
    included = {}
    for line in page.split("\n"):
        if match := SNIPPET.match(line):
            path, first, last = match.groups()
            included[Path(path).name] = (int(first), int(last))
    kept = sorted(FIGURES.glob("*.txt"))
    assert sorted(path.name for path in kept) == sorted(included)
    for path in kept:
        lines = path.read_text().split("\n")
        first, last = included[path.name]
        script = OTHER_SCRIPT.match(lines[0])
        if script is not None:
            assert (ROOT / "benchmarks" / script.group(1)).is_file(), path.name
            assert (1, "```", "") == (first, lines[last - 1], lines[last]), path.name
            continue
        assert "# devicectx benchmark" == lines[0]
        assert lines[2].startswith("`python benchmarks/bench.py "), path.name
        assert 3 == first
        assert lines[last - 1].startswith("|"), path.name
        assert "" == lines[last], path.name
