"""Checks of user input shared by the command line and the Python API.

Each check raises :class:`~leapquant.errors.LeapQuantError` with one line that names the argument and what
was wrong, before any work starts; the CLI turns the same checks into argparse types (``cli/args.py``).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path

from .errors import LeapQuantError

__all__ = [
    "check_count",
    "check_input_file",
    "check_output_dir",
    "check_output_file",
    "read_json",
    "require_triton",
    "resolve_device",
]


def check_count(name: str, value, minimum: int = 1) -> int:
    """``value`` as an int, which must be a whole number (not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise LeapQuantError(f"{name} must be a whole number >= {minimum}, got {value!r}")
    return value


def _suffix_error(path: Path, what: str, suffixes: Sequence[str]) -> LeapQuantError | None:
    if suffixes and path.suffix.lower() not in suffixes:
        got = path.suffix or "no extension"
        return LeapQuantError(f"{what} {path}: expected a {' or '.join(suffixes)} file, got {got}")
    return None


def check_input_file(path: str | Path, what: str, suffixes: Sequence[str] = ()) -> Path:
    """An existing, non-empty regular file with one of ``suffixes`` (any suffix if empty)."""
    path = Path(path)
    if not path.exists():
        raise LeapQuantError(f"{what} {path}: no such file")
    if not path.is_file():
        raise LeapQuantError(f"{what} {path}: not a file")
    if (error := _suffix_error(path, what, suffixes)) is not None:
        raise error
    if path.stat().st_size == 0:
        raise LeapQuantError(f"{what} {path}: the file is empty")
    if not os.access(path, os.R_OK):
        raise LeapQuantError(f"{what} {path}: not readable (permission denied)")
    return path


def _check_folder(folder: Path, what: str, path: Path) -> None:
    # folders are never created for a file: a typo in a path should fail, not grow a tree
    if not folder.is_dir():
        raise LeapQuantError(f"{what} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise LeapQuantError(f"{what} {path}: the folder {folder} is not writable")


def check_output_file(path: str | Path, what: str, suffixes: Sequence[str] = ()) -> Path:
    """A file that can be written: its folder exists and is writable, and it is not itself a folder.

    Nothing is created; call this before the work whose result goes there.
    """
    path = Path(path)
    if (error := _suffix_error(path, what, suffixes)) is not None:
        raise error
    if path.is_dir():
        raise LeapQuantError(f"{what} {path}: is a folder, expected a file name")
    if path.exists() and not os.access(path, os.W_OK):
        raise LeapQuantError(f"{what} {path}: the file exists and is not writable")
    _check_folder(path.parent, what, path)
    return path


def check_output_dir(path: str | Path, what: str) -> Path:
    """A folder to write into: an existing writable folder, or a new one whose parent exists."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise LeapQuantError(f"{what} {path}: exists and is not a folder")
    if path.is_dir():
        _check_folder(path, what, path)
    else:
        _check_folder(path.parent, what, path)
    return path


def read_json(path: str | Path, what: str):
    """The parsed content of a JSON file; binary garbage, empty files and bad JSON are one-line errors."""
    import json

    path = check_input_file(path, what)
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise LeapQuantError(f"{what} {path}: not a text file (not UTF-8), expected JSON") from None
    except json.JSONDecodeError as exc:
        raise LeapQuantError(f"{what} {path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None


def resolve_device(device: str) -> str:
    """``auto`` (CUDA if present, else CPU), ``cpu``, ``cuda`` or ``cuda:N``, checked against this machine."""
    import torch

    text = str(device).strip().lower()
    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise LeapQuantError(f"unknown device {device!r}: use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return "cpu"
    if dev.type != "cuda":
        raise LeapQuantError(f"device {device!r}: leapquant runs on cpu or cuda (auto, cpu, cuda, cuda:N)")
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else "no visible GPU"
        raise LeapQuantError(f"device {device!r}: CUDA is not available (torch {torch.__version__}, {build})")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise LeapQuantError(
            f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    return str(dev)


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def require_triton(what: str) -> None:
    """Fail with the install command if Triton is missing (it ships only with the ``[triton]`` extra)."""
    if not _triton_installed():
        raise LeapQuantError(f"{what} needs Triton, which is not installed: pip install 'leapquant[triton]'")
