"""Where a result came from: git commit, package versions, hardware. Used by every record.json."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

PACKAGES = ("lmforge", "torch", "transformers", "tokenizers", "safetensors", "numpy",
            "datasketch", "peft", "fastapi", "uvicorn", "prometheus-client", "typer")


def git_info(cwd: str | Path | None = None) -> dict:
    """`{"commit": sha or None, "dirty": bool or None}` for the repository holding `cwd` (default: this package)."""
    cwd = Path(cwd) if cwd else Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True,
                                text=True, timeout=5, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                                capture_output=True, text=True, timeout=5, check=True).stdout
        return {"commit": commit, "dirty": bool(status.strip())}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def hardware_info() -> dict:
    """The machine in a few fields; the accelerator when torch sees one.

    torch is asked only when the stage already imported it: a data stage that never touches
    torch should not pay ~2 s to import it just to write record.json."""
    info = {"platform": platform.platform(), "machine": platform.machine(),
            "processor": platform.processor() or None, "cpu_count": os.cpu_count(),
            "python_executable": sys.executable}
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch_threads"] = torch.get_num_threads()
        info["cuda"] = torch.cuda.is_available()
        if info["cuda"]:
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpu_count"] = torch.cuda.device_count()
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_bytes"] = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return info
