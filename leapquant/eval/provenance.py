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


def provenance(cuda: bool = False) -> dict:
    """Command line, UTC date, package versions, host; with ``cuda=True`` also the GPU and driver."""
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
