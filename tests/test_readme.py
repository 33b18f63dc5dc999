"""The README's examples run as written (reference backend on the CPU), and the commands it shows exist."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from leapquant.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
_spec = importlib.util.spec_from_file_location("readme_examples", ROOT / "scripts" / "readme_examples.py")
readme_examples = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(readme_examples)
BLOCKS = readme_examples.python_blocks(README)


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_python_block_runs(code, monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the torch reference path, as on a CPU install
    monkeypatch.chdir(tmp_path)  # from any folder: nothing may depend on the repository layout
    exec(compile(code, str(README), "exec"), {})


def _subparsers(parser):
    actions = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    return actions[0].choices if actions else {}


# the command table's rows: `leapquant CMD [SUB] ...` in the first cell
ROWS = re.findall(r"^\| `leapquant ([^`]*)`", README.read_text(), flags=re.M)


@pytest.mark.parametrize("row", ROWS)
def test_readme_commands_and_flags_exist(row):
    """Every command of the README's table exists and takes every flag the row shows."""
    words = row.split()
    parser = _subparsers(build_parser())[words[0]]
    if words[1:] and words[1] in _subparsers(parser):
        parser = _subparsers(parser)[words[1]]
    options = {opt for action in parser._actions for opt in action.option_strings}
    shown = set(re.findall(r"(?<![\w-])(-{1,2}[a-z][\w-]*)", row))
    assert shown <= options, f"`leapquant {row}`: {sorted(shown - options)} not accepted"
    assert len(ROWS) >= 10
