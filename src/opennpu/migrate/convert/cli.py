"""Command line of the offline converter, compatible with msFmkTransplt (``ms_fmk_transplt.py``):

    python -m opennpu.migrate -i PROJECT -o OUTDIR [-v 2.8.0] [-s] [distributed -m main.py -t model]
    python -m opennpu.migrate -i PROJECT --diff      # print a unified diff, write nothing
    python -m opennpu.migrate -i PROJECT --check     # exit 1 when something would be converted

The result goes to ``OUTDIR/<name>_msft`` (``_msft_multi`` with ``distributed``), reports to its
``transplant_result_file/``. A single .py file is accepted too: ``OUTDIR/<stem>_msft/<file>``.
Nothing ever prompts: an existing result is an error unless ``--force``.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import shutil
import sys
from pathlib import Path

from . import reports
from .transformer import DEFAULT_VERSION, VERSIONS, ConvertOptions, convert_source

PROG = "python -m opennpu.migrate"
MAX_FILE_BYTES = 10 * 1024 * 1024  # like msFmkTransplt: larger files are skipped
log = logging.getLogger("opennpu.migrate")


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Convert a CUDA PyTorch project to Ascend NPU (torch_npu) code; "
        "msFmkTransplt-compatible options and result files.")
    parser.add_argument("-i", "--input", required=True, metavar="PATH",
                        help="project directory (or a single .py file) to convert")
    parser.add_argument("-o", "--output", metavar="DIR",
                        help="existing directory that receives <name>_msft (not needed with "
                             "--diff, --check or --in-place)")
    parser.add_argument("-v", "--version", choices=VERSIONS, default=DEFAULT_VERSION,
                        help=f"PyTorch version of the target, as msFmkTransplt's -v (default "
                             f"{DEFAULT_VERSION}; recorded in the log, the rules are the same)")
    parser.add_argument("-s", "--specify-device", action="store_true",
                        help="use the NPU given by the environment variable DEVICE_ID (default 0)")
    parser.add_argument("--diff", action="store_true", help="print a unified diff; write nothing")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when a file would be converted")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing result directory (never asks)")
    parser.add_argument("--in-place", action="store_true",
                        help="rewrite the input files themselves (reports go to -o when given)")
    commands = parser.add_subparsers(dest="command")
    dist = commands.add_parser("distributed", help="also convert single-card training to "
                               "multi-card (DistributedSampler, DDP, init_process_group('hccl'))")
    dist.add_argument("-m", "--main", required=True, metavar="FILE",
                      help="the training entry script, relative to the project (or absolute)")
    dist.add_argument("-t", "--target-model", default="model", metavar="NAME",
                      help="variable that holds the model (default: model; e.g. self.model)")
    return parser


def _check_paths(parser, args) -> tuple[Path, Path | None]:
    """(input, result directory or None), or a parser error naming the option."""
    src = Path(args.input)
    if not src.exists():
        parser.error(f"-i/--input: expected an existing project directory or .py file, "
                     f"got '{args.input}' (does not exist)")
    if src.is_file() and src.suffix != ".py":
        parser.error(f"-i/--input: expected a project directory or a .py file, got '{args.input}'")
    src = src.resolve()
    writes_result = not (args.diff or args.check or args.in_place)
    if args.output is None:
        if writes_result:
            parser.error("-o/--output: expected an existing output directory (required unless "
                         "--diff, --check or --in-place)")
        return src, None
    out = Path(args.output)
    if not out.is_dir():
        parser.error(f"-o/--output: expected an existing directory, got '{args.output}' "
                     f"({'not a directory' if out.exists() else 'does not exist'})")
    out = out.resolve()
    if not os.access(out, os.W_OK):
        parser.error(f"-o/--output: expected a writable directory, got '{args.output}'")
    if src.is_dir() and (out == src or src in out.parents):
        parser.error(f"-o/--output: expected a directory outside the -i/--input project "
                     f"'{args.input}', got '{args.output}' (inside it)")
    if not writes_result:
        return src, out
    suffix = "_msft_multi" if args.command == "distributed" else "_msft"
    result = out / ((src.name if src.is_dir() else src.stem) + suffix)
    if result.exists() and not args.force:
        parser.error(f"-o/--output: the result '{result}' already exists; pass --force to "
                     f"replace it")
    return src, result


def _python_files(src: Path) -> list[Path]:
    if src.is_file():
        return [Path(src.name)]
    files = []
    for root, dirs, names in os.walk(src):
        dirs[:] = sorted(d for d in dirs if d not in (reports.REPORT_DIR, "__pycache__", ".git"))
        files += [Path(root, n).relative_to(src) for n in sorted(names) if n.endswith(".py")]
    return files


def _cuda_sources(src: Path) -> list[tuple[str, list[str]]]:
    if src.is_file():
        return []
    found = []
    for path in sorted(src.rglob("*")):
        if path.suffix in reports.CUDA_SOURCE_SUFFIXES and path.is_file():
            ops = reports.scan_cuda_ops(path.read_text(encoding="utf-8", errors="replace"))
            if ops:
                found.append((path.relative_to(src).as_posix(), ops))
    return found


def _setup_log(report_dir: Path | None):
    log.handlers.clear()
    log.setLevel(logging.INFO)
    log.propagate = False
    if report_dir is not None:
        report_dir.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(report_dir / reports.LOG_FILE, mode="w", encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s [%(levelname)s] %(message)s"))
        log.addHandler(handler)
    warn = logging.StreamHandler(sys.stderr)
    warn.setLevel(logging.WARNING)
    warn.setFormatter(logging.Formatter("opennpu.migrate: %(levelname)s: %(message)s"))
    log.addHandler(warn)


def run(args, parser) -> int:
    src, result_dir = _check_paths(parser, args)
    root = src if src.is_dir() else src.parent
    options = ConvertOptions(specify_device=args.specify_device,
                             distributed=args.command == "distributed", version=args.version)
    main_file = None
    if args.command == "distributed":
        from . import distributed
        main_file = distributed.resolve_main(parser, root, args.main)

    writes = not (args.diff or args.check)
    if args.in_place and writes:
        report_dir = result_dir / reports.REPORT_DIR if result_dir else None
    elif writes:
        if result_dir.exists():
            shutil.rmtree(result_dir)
        if src.is_dir():
            shutil.copytree(src, result_dir, symlinks=True)
        else:
            result_dir.mkdir()
            shutil.copy2(src, result_dir / src.name)
        report_dir = result_dir / reports.REPORT_DIR
    else:
        report_dir = None
    _setup_log(report_dir)
    log.info("opennpu.migrate (msFmkTransplt-compatible converter), PyTorch version %s", args.version)
    log.info("input: %s; output: %s; mode: %s%s", src, result_dir or "-",
             args.command or "single-card", ", specify-device" if args.specify_device else "")

    results = []
    for rel in _python_files(src):
        path = root / rel
        if path.stat().st_size > MAX_FILE_BYTES:
            log.warning("%s: larger than 10 MB; skipped", rel)
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            log.warning("%s: not UTF-8 text; skipped", rel)
            continue
        result = convert_source(text, options, path=rel.as_posix())
        if main_file is not None and path == main_file:
            from . import distributed
            distributed.convert_main(result, args.target_model)
        if result.error:
            log.warning("%s: %s", rel, result.error)
        else:
            log.info("%s: %d changes", rel, len(result.changes))
        results.append((rel.as_posix(), result))
    changed = [(rel, r) for rel, r in results if r.changed]

    if args.diff:
        for rel, r in changed:
            sys.stdout.writelines(difflib.unified_diff(
                r.source.splitlines(keepends=True), r.converted.splitlines(keepends=True),
                f"a/{rel}", f"b/{rel}"))
    if args.check:
        for rel, _ in changed:
            print(f"would convert {rel}", file=sys.stderr)
        print(f"opennpu.migrate --check: {len(changed)} of {len(results)} Python files would be "
              f"converted", file=sys.stderr)
    if not writes:
        return 1 if (args.check and changed) else 0

    target_root = root if args.in_place else (result_dir if src.is_dir() else result_dir)
    for rel, r in changed:
        (target_root / rel).write_text(r.converted, encoding="utf-8")
    if args.command == "distributed" and not args.in_place:
        from . import distributed
        distributed.write_launcher(result_dir, main_file.relative_to(root).as_posix())

    used = set().union(*(r.used_apis for _, r in results)) if results else set()
    from .rules import performance_advice
    project_advice = [(api, f"[{rule}] {tip}") for rule, (api, tip)
                      in performance_advice()["project"].items() if api not in used]
    rows = reports.collect_rows(results, _cuda_sources(src), project_advice)
    for name, count in ((n, len(r)) for n, r in rows.items()):
        log.info("%s: %d rows", name, count)
    counts = reports.write_reports(report_dir, rows) if report_dir else {n: len(r) for n, r in rows.items()}
    where = report_dir or "(no report directory: --in-place without -o)"
    print(f"opennpu.migrate: converted {len(changed)} of {len(results)} Python files"
          f" -> {root if args.in_place else result_dir}")
    print(f"result files in {where}:")
    width = max(map(len, counts))
    for name, count in counts.items():
        print(f"  {name:<{width}}  {count:>5} rows")
    log.info("finished")
    for handler in log.handlers:
        handler.close()
    log.handlers.clear()
    return 0


def main(argv=None, prog: str = PROG) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    return run(args, parser)
