"""The `opennpu` command line (also `python -m opennpu`)."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["migrate"]:  # all of its options belong to the converter's own parser
        from .migrate.convert.cli import main as migrate_main

        return migrate_main(argv[1:], prog="opennpu migrate")
    parser = argparse.ArgumentParser(prog="opennpu",
                                     description="opennpu: torch_npu's fused operators on CPU")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="a few ops next to the native code (the benchmark "
                               "cases' LLM shapes), then a training run, a compiled model and the "
                               "npu device")
    demo.add_argument("--device", default="cpu", choices=("cpu",), help="where the ops run")
    demo.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    demo.add_argument("--min-run-time", type=float, default=0.2, help="seconds per timing")
    demo.add_argument("--ops", default="", help="comma-separated op families: only their rows of "
                      "the op table (see python -m benchmarks.demo --help)")
    from .analyze.runner import build_parser as analyze_parser

    analyze_parser(commands.add_parser("analyze", help="op-support census of a script (see "
                                       "python -m opennpu.analyze --help)"))
    commands.add_parser("migrate", add_help=False,
                        help="convert a CUDA project to NPU code (msFmkTransplt-compatible; "
                             "`opennpu migrate -h` for its options)")
    args = parser.parse_args(argv)
    if args.command == "analyze":
        from .analyze.runner import main as analyze

        return analyze(args=args)

    from . import demo as demo_module  # imports torch and loads the operator library

    demo_module.run(threads=args.threads, min_run_time=args.min_run_time,
                    ops=args.ops.split(",") if args.ops else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
