"""How a result was made: command, date, versions and device, stored beside every number we report."""

from __future__ import annotations

import datetime
import platform
import shlex
import sys
from importlib import metadata

__all__ = ["provenance"]


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git() -> tuple[str | None, bool | None]:
    """``(commit, dirty)`` of the checkout this package runs from (``(None, None)`` for an installed wheel
    or without git): which code made a number, where a file name alone would be the only record."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None, None
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        )
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", "leapquant", "scripts"],
            cwd=root, capture_output=True, text=True, timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None, None
    if head.returncode != 0 or status.returncode != 0:
        return None, None
    return head.stdout.strip(), bool(status.stdout.strip())


def provenance(cuda: bool = False) -> dict:
    """Command line, UTC date, package versions, host, the git commit (and whether the package's code
    differs from it) where it runs from a checkout; with ``cuda=True`` also the GPU and driver."""
    import torch

    from .. import __version__

    info = {
        "command": shlex.join(["leapquant", *sys.argv[1:]]) if sys.argv else None,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "leapquant": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "fla": _version("flash-linear-attention") or _version("fla-core"),
        "machine": f"{platform.system()} {platform.machine()}",
    }
    info["git_commit"], info["git_dirty"] = _git()
    if cuda and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["device"] = props.name
        info["cuda"] = torch.version.cuda
        info["sms"] = props.multi_processor_count
        try:
            import subprocess

            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            info["driver"] = out.stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            info["driver"] = None
    else:
        info["device"] = "cpu"
    return info
