"""What every benchmark report shares: the machine it ran on and how loaded it was
(`provenance`, `loadavg`), and printing + writing the report (`emit`: JSON and Markdown).

It knows nothing about what a benchmark measures.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path


from lmforge.bench.doctor import cpu_name
from lmforge.track.io import atomic_write_json, atomic_write_text
from lmforge.track.provenance import git_info, hardware_info, package_versions


def emit(report: dict, to_md, out: Path | None, name: str) -> None:
    """Print the report's Markdown; with `out`, also write `name`.json and `name`.md there (atomically)."""
    md = to_md(report)
    print(md)
    if out is not None:
        atomic_write_json(out / f"{name}.json", report)
        atomic_write_text(out / f"{name}.md", md)


def loadavg() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, rounded; None where the platform has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def provenance(dtype: str) -> dict:
    """Date, torch threads, dtype, machine, load average now, hardware, package versions and git state."""
    import torch  # deferred: every `lmforge` verb imports this module, and a CLI verb starts without torch

    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "threads": torch.get_num_threads(), "dtype": dtype,
            "machine": f"{platform.node()}, {cpu_name()}, {os.cpu_count()} cores", "load_average": loadavg(),
            "hardware": hardware_info(), "packages": package_versions(), "git": git_info()}
