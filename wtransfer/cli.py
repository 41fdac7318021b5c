"""The command line: ``wtransfer backends`` and ``wtransfer demo``."""

from __future__ import annotations

import argparse
import sys

from wtransfer.registry import list_backends


def cmd_backends(args: argparse.Namespace) -> int:
    """Print every backend with its availability."""
    rows = list_backends()
    if not rows:
        print("no backends installed (pip install wtransfer-ipc, wtransfer-nccl, wtransfer-ucx)")
        return 1
    width = max(len(n) for n in rows)
    print(f"{'backend':<{width}}  {'available':<9}  {'distribution':<18}  summary / reason")
    for name, info in rows.items():
        detail = info.summary if info.available else info.reason
        print(f"{name:<{width}}  {'yes' if info.available else 'no':<9}  "
              f"{info.distribution:<18}  {detail}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the two-process transfer demo (see `wtransfer.demo`)."""
    from wtransfer.demo import run_demo

    return run_demo(backend=args.backend, model=args.model, rounds=args.rounds,
                    bucket_mb=args.bucket_mb, checksum=args.checksum)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `wtransfer` command."""
    parser = argparse.ArgumentParser(prog="wtransfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("backends", help="list installed backends and whether they can run here") \
        .set_defaults(func=cmd_backends)
    demo = sub.add_parser("demo", help="push a model's weights into another process and prove "
                                       "they landed")
    demo.add_argument("--backend", default="ipc")
    demo.add_argument("--model", default="demo", help="demo, mixed, qwen3-0.6b, ...")
    demo.add_argument("--rounds", type=int, default=5)
    demo.add_argument("--bucket-mb", type=int, default=32)
    demo.add_argument("--checksum", action="store_true")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `wtransfer` command."""
    args = build_parser().parse_args(argv)
    sys.exit(args.func(args))
