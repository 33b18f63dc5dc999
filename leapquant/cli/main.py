"""The ``leapquant`` command: one entry point, subcommands registered by their modules."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from ..errors import LeapQuantError
from .args import Parser

__all__ = ["main"]

# Third-party loggers that speak on every CPU run about things that do not matter to these commands:
# torchao's CUDA-only extensions failing to load, torch's pytree deprecation notice (torchao registers
# enums), and transformers' "install flash-linear-attention / causal-conv1d" notices, which break the
# progress bar. Commands say the one thing that matters on a CPU themselves (model.cpu_note).
_NOISY_LOGGERS = ("torchao", "torch.utils._pytree", "transformers.integrations.hub_kernels")


def _quiet_third_party() -> None:
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def build_parser() -> Parser:
    from .. import __version__
    from . import bench, calibrate, memory, model, recall, simulate

    parser = Parser(
        prog="leapquant",
        description="Low-bit recurrent state for linear-attention layers (LeapQuant).",
    )
    parser.add_argument("--version", action="version", version=f"leapquant {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    simulate.add_parsers(sub)
    bench.add_parsers(sub)
    model.add_parsers(sub)
    recall.add_parsers(sub)
    memory.add_parsers(sub)
    calibrate.add_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; bad input prints one line ``leapquant: error: ...`` and returns 2."""
    _quiet_third_party()
    try:
        args = build_parser().parse_args(argv)
        return int(args.run(args) or 0)
    except LeapQuantError as exc:
        print(f"leapquant: error: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as exc:
        print(f"leapquant: error: {exc.strerror}: {exc.filename}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("leapquant: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `leapquant ... | head`: the reader left; say nothing more
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 141
    except SystemExit as exc:  # --help and --version exit through argparse
        return exc.code if isinstance(exc.code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
