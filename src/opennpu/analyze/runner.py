"""Running a script under the census: `python -m opennpu.analyze script.py [args]`."""

from __future__ import annotations

import argparse
import runpy
import sys
import traceback
from pathlib import Path

from .census import STEP_EVENTS, OpCensus
from .report import FORMATS


def run_script(path, argv=(), *, steps: int | None = None, step_on: str = "optimizer",
               fusion: bool = True, inner: bool = True, top: int = 3) -> OpCensus:
    """Run `path` as __main__ (sys.argv = [path, *argv], its folder first on sys.path) under an
    OpCensus and return the census. A script that ends by sys.exit(0) is fine; after `steps`
    steps the script is stopped and the census keeps what ran. A script that fails (an exception,
    a non-zero exit) leaves its error in `census.error`, and the census of what ran before it."""
    path = Path(path)
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(path), *argv]
    sys.path.insert(0, str(path.resolve().parent))
    census = OpCensus(steps=steps, step_on=step_on, fusion=fusion, inner=inner, top=top)
    try:
        with census:
            try:
                runpy.run_path(str(path), run_name="__main__")
            except SystemExit as exit_:
                if exit_.code not in (None, 0):
                    census.error = f"the script exited with status {exit_.code}"
            except Exception:  # the census of what ran up to the error still stands
                census.error = traceback.format_exc()
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return census


def _npu_device_on() -> None:
    """The command runs a script on the npu device, so it asks for npu (and torch_npu) also
    beside a visible CUDA GPU, where they are off by default (docs/npu_device.md)."""
    from .. import _device, distributed

    _device.ask_for_npu()
    if _device.register(explicit=True):
        distributed.register()


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(
        prog="python -m opennpu.analyze",
        description="Run a script on the npu device and report every operator it dispatched: "
                    "calls, signatures, how opennpu runs it, whether Ascend has it, and the "
                    "fused replacements graph mode would make.")
    parser.add_argument("script", help="the Python script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    parser.add_argument("-o", "--output", metavar="DIR", help="write the report files here")
    parser.add_argument("--steps", type=int, default=None,
                        help="stop the script after N steps (see --step-on)")
    parser.add_argument("--step-on", choices=STEP_EVENTS, default="optimizer",
                        help="what a step is: an optimizer.step() call (default), a backward() "
                             "call, or an outermost nn.Module call (forward)")
    parser.add_argument("--format", default="csv,table,html",
                        help=f"comma-separated, of {','.join(FORMATS)} (default: all three)")
    parser.add_argument("--no-fusion", action="store_true",
                        help="skip the fused-replacement report (it compiles the model once)")
    parser.add_argument("--no-inner", action="store_true",
                        help="do not look inside composite ops (no `inner` calls)")
    parser.add_argument("--top", type=int, default=3, help="signatures kept per op (default 3)")
    return parser


def main(argv=None, args: argparse.Namespace | None = None) -> int:
    if args is None:
        args = build_parser().parse_args(argv)
    _npu_device_on()
    formats = tuple(f.strip() for f in args.format.split(",") if f.strip())
    unknown = set(formats) - set(FORMATS)
    if unknown:
        print(f"opennpu analyze: unknown format(s) {sorted(unknown)}; choose from {FORMATS}",
              file=sys.stderr)
        return 2
    census = run_script(args.script, args.args, steps=args.steps, step_on=args.step_on,
                        fusion=not args.no_fusion, inner=not args.no_inner, top=args.top)
    if census.error:
        print(census.error, file=sys.stderr)
        print("opennpu analyze: the script failed; the report covers what ran before",
              file=sys.stderr)
    text = census.report(args.output, formats=formats)
    print(text, end="")
    if args.output:
        print(f"report written to {args.output}", file=sys.stderr)
    return 1 if census.error else 0
