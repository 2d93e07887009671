"""The `opennpu` command line (also `python -m opennpu`)."""

from __future__ import annotations

import argparse


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="opennpu",
                                     description="opennpu: torch_npu's fused operators on CPU")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run every available op next to the native code")
    demo.add_argument("--device", default="cpu", choices=("cpu",), help="where the ops run")
    demo.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    demo.add_argument("--min-run-time", type=float, default=0.2, help="seconds per timing")
    from .analyze.runner import build_parser as analyze_parser

    analyze_parser(commands.add_parser("analyze", help="op-support census of a script (see "
                                       "python -m opennpu.analyze --help)"))
    args = parser.parse_args(argv)
    if args.command == "analyze":
        from .analyze.runner import main as analyze

        return analyze(args=args)

    from . import demo as demo_module  # imports torch and loads the operator library

    demo_module.run(threads=args.threads, min_run_time=args.min_run_time)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
