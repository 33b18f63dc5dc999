"""The ``leapquant`` command: one entry point, subcommands registered by their modules."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..errors import LeapQuantError

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    from . import bench, memory, model, recall, simulate

    parser = argparse.ArgumentParser(
        prog="leapquant",
        description="Low-bit recurrent state for linear-attention layers (LeapQuant).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    simulate.add_parsers(sub)
    bench.add_parsers(sub)
    model.add_parsers(sub)
    recall.add_parsers(sub)
    memory.add_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; bad input prints one line ``leapquant: error: ...`` and returns 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except LeapQuantError as exc:
        print(f"leapquant: error: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, PermissionError, IsADirectoryError) as exc:
        print(f"leapquant: error: {exc.strerror}: {exc.filename}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("leapquant: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
