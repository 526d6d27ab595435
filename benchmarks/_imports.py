"""Section 4: what ``import devicectx`` costs beyond ``import torch``, in fresh interpreters."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from typing import Any

from _report import Row, judge

PEER_MODULES = ("accelerate.utils", "lightning_utilities.core.apply_func", "optree", "tensordict")

# Run in a fresh interpreter: torch first, then the module, timed apart; and what the module
# pulled in besides itself (other packages, and torch submodules that `import torch` skips).
_PROBE = """
import json, sys, time
t0 = time.perf_counter(); import torch; t1 = time.perf_counter()
before = set(sys.modules)
import {module}
t2 = time.perf_counter()
added = set(sys.modules) - before
new = sorted({{m.split(".")[0] for m in added}} - {{"torch", "{module}".split(".")[0]}})
torch_new = sum(m.startswith("torch.") for m in added)
print(json.dumps({{"torch_s": t1 - t0, "module_s": t2 - t1, "new_top_level": new,
                  "new_torch_submodules": torch_new}}))
"""


def import_cost(module: str, runs: int) -> dict[str, Any]:
    """Median milliseconds ``import module`` takes after ``import torch``, over ``runs``."""
    samples = []
    for _ in range(runs):
        done = subprocess.run(
            [sys.executable, "-c", _PROBE.format(module=module)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            tail = done.stderr.strip().splitlines()[-1:] or ["?"]
            return {"status": "not available", "detail": tail[0]}
        samples.append(json.loads(done.stdout))
    return {
        "status": "ok",
        "runs": runs,
        "median_ms": 1e3 * statistics.median(s["module_s"] for s in samples),
        "torch_median_ms": 1e3 * statistics.median(s["torch_s"] for s in samples),
        "samples_ms": [1e3 * s["module_s"] for s in samples],
        "new_top_level_modules": samples[-1]["new_top_level"],
        "new_torch_submodules": samples[-1]["new_torch_submodules"],
    }


def section_import(quick: bool) -> tuple[dict[str, Any], list[Row]]:
    """(4) devicectx's import (7 runs; 1 with ``--quick``) and the peers' (3; none quick)."""
    ours = import_cost("devicectx", 1 if quick else 7)
    peers = {} if quick else {name: import_cost(name, 3) for name in PEER_MODULES}
    ms = ours.get("median_ms")
    peer_text = "; ".join(
        f"{name} +{p['median_ms']:.1f} ms" if p["status"] == "ok" else f"{name} n/a"
        for name, p in peers.items()
    )
    row = judge(
        "4 import",
        "import devicectx after import torch (fresh process)",
        None if ms is None else ms * 1e6,
        peer_text or "skipped in --quick",
        None if ms is None else ours["torch_median_ms"] * 1e6,
        "import torch",
        None,
    )
    return {"devicectx": ours, "peers": peers}, [row]
