"""The benchmark's report: comparison rows judged against the targets, rendered as markdown."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from _timing import Measurement, fmt_ns

TOLERANCE = 0.05
"""A ratio counts as meeting its target up to 5% above it: the noise of a shared machine."""


@dataclass(frozen=True)
class Row:
    """One comparison: devicectx's figure, the peers', the ratio, the target, met or not."""

    section: str
    what: str
    ours: str
    peers: str
    ratio: str
    target: str
    met: str
    ratio_value: float | None = None
    target_value: float | None = None


def judge(
    section: str,
    what: str,
    ours_ns: float | None,
    peers: str,
    against_ns: float | None,
    against: str,
    target: float | None,
    *,
    ours_text: str | None = None,
    target_text: str | None = None,
    tolerance: float = TOLERANCE,
    missing: str = "not available",
) -> Row:
    """A row whose ratio is ``ours_ns / against_ns``, met when at most ``target`` (+ tolerance).

    ``met`` is ``""`` for a row without a target, ``missing`` (``"not available"`` or
    ``"error"``) when devicectx's side could not run, ``"n/a"`` when only the peer's is.
    """
    ratio = None
    if ours_ns is not None and against_ns is not None and against_ns > 0:
        ratio = ours_ns / against_ns
    if target is None:
        met = ""
    elif ours_ns is None:
        met = missing
    elif ratio is None:
        met = "n/a"
    else:
        met = "yes" if ratio <= target * (1 + tolerance) else "no"
    if ours_text is None:
        ours_text = fmt_ns(ours_ns) if ours_ns is not None else missing
    return Row(
        section,
        what,
        ours_text,
        peers,
        "n/a" if ratio is None else f"{ratio:.2f}x {against}".rstrip(),
        "" if target is None else (target_text or f"<= {_num(target)}x"),
        met,
        ratio,
        target,
    )


def _num(value: float) -> str:
    """``0.5``, ``1.0``, ``1.25``: a target as written in docs/performance.md."""
    return f"{value:.1f}" if value * 10 == int(value * 10) else f"{value:g}"


def times(measured: dict[str, Measurement], names: Iterable[str]) -> str:
    """``name 1.20 µs; other not available`` for a table cell."""
    return "; ".join(
        f"{name} {fmt_ns(measured[name].median_ns) if measured[name].ok else measured[name].status}"
        for name in names
    )


def rows_from(rows: list[Row]) -> list[dict[str, Any]]:
    """The rows as JSON objects."""
    return [asdict(row) for row in rows]


def _table(header: list[str], lines: Iterable[list[str]]) -> list[str]:
    def cells(values: list[str]) -> str:
        return "| " + " | ".join(v.replace("|", "\\|") for v in values) + " |"

    return [cells(header), cells(["---"] * len(header)), *(cells(line) for line in lines)]


def _summary(report: dict[str, Any]) -> list[str]:
    env = report["environment"]
    met = [row["met"] for row in report["rows"] if row["target"]]
    return [
        "# devicectx benchmark",
        "",
        f"`{env['command']}` ({env['mode']} mode): torch {env['torch']}, Python {env['python']}, "
        f"{env['platform']}, {env['cpus']} CPUs, {env['torch_threads']} torch thread; "
        f"medians of {env['trials']} trials of auto-ranged loops of at least "
        f"{env['min_time_s'] * 1e3:g} ms. A ratio meets its target up to "
        f"{env['tolerance']:.0%} above it. Targets met: {met.count('yes')} of {len(met)}."
        + (
            " The accelerator is the testing kit's emulated one, its copies undelayed: its "
            "figures show the shape of the work, not a device's speed."
            if env.get("emulated_accelerator")
            else ""
        ),
        "",
        *_table(
            ["section", "what", "devicectx", "peers", "ratio", "target", "met"],
            (
                [r["section"], r["what"], r["ours"], r["peers"], r["ratio"], r["target"], r["met"]]
                for r in report["rows"]
            ),
        ),
    ]


def _subject_lines(section: dict[str, Any]) -> Iterable[list[str]]:
    for key, case in section.get("cases", {}).items():
        extras = {
            "added": {k: fmt_ns(v) for k, v in case.get("added_ns", {}).items() if v is not None},
            "copies": {k: str(v) for k, v in case.get("copies", {}).items() if v is not None},
            "GB/s": {
                k: "n/a" if v is None else f"{v:.2f}" for k, v in case.get("gbps", {}).items()
            },
        }
        for name, m in case["subjects"].items():
            note = "; ".join(f"{col} {vals[name]}" for col, vals in extras.items() if name in vals)
            yield [
                case.get("label", key),
                name,
                fmt_ns(m["median_ns"]) if m["status"] == "ok" else m["status"],
                fmt_ns(m["min_ns"]),
                str(m["loops"]),
                "; ".join(filter(None, [note, m["detail"]])),
            ]


def render(report: dict[str, Any]) -> str:
    """The whole report as markdown: the summary table, then every measurement."""
    lines = _summary(report)
    for name in ("decorator", "move", "find_devices", "scope", "diagnostics"):
        if name not in report:  # left out with --only
            continue
        lines += ["", f"## {name}", ""]
        lines += _table(["case", "subject", "median", "min", "loops", "notes"],
                        _subject_lines(report[name]))  # fmt: skip
    if "import" in report:
        lines += _imports(report["import"])
    if "transfer" in report:
        lines += _transfer(report["transfer"])
    return "\n".join(lines) + "\n"


def _imports(section: dict[str, Any]) -> list[str]:
    lines = ["", "## import (fresh processes, after `import torch`)", ""]
    imports = {"devicectx": section["devicectx"], **section["peers"]}
    lines += _table(
        ["module", "median", "runs", "torch itself", "other packages it loads", "torch modules"],
        (
            [name, f"{i['median_ms']:.1f} ms", str(i["runs"]), f"{i['torch_median_ms']:.0f} ms",
             ", ".join(i["new_top_level_modules"]) or "none", f"+{i['new_torch_submodules']}"]
            if i["status"] == "ok"
            else [name, i["status"], "", "", i.get("detail", ""), ""]
            for name, i in imports.items()
        ),
    )  # fmt: skip
    return lines


def _transfer(transfer: dict[str, Any]) -> list[str]:
    lines = ["", "## transfer (host to accelerator)", ""]
    if "skipped" in transfer:
        lines.append(f"skipped: {transfer['skipped']}")
    else:
        nominal = transfer.get("nominal_gbps")
        lines.append(f"device {transfer['device']}; nominal {nominal or 'not given'} GB/s")
        lines += ["", *_table(["case", "subject", "median", "min", "loops", "notes"],
                              _subject_lines(transfer))]  # fmt: skip
    return lines
