"""Run the README's Python examples as written, each in a fresh namespace (the vLLM one needs vLLM and a
model: tests_vllm/ covers it). ``tests/test_readme.py`` runs them in the test environment; ``scripts/test.sh``
runs this file with an installed wheel, from a folder outside the repository.

Usage: python scripts/readme_examples.py [README.md]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks(readme: Path = README) -> list[str]:
    """The README's ```python blocks, without the vLLM one."""
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), flags=re.S)
    return [b for b in blocks if "from vllm" not in b]


def main(argv: list[str]) -> int:
    readme = Path(argv[0]) if argv else README
    blocks = python_blocks(readme)
    for i, code in enumerate(blocks):
        exec(compile(code, f"{readme} (python block {i})", "exec"), {})
        print(f"README python block {i}: ok")
    return 0 if blocks else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
