"""Runs real public CUDA training programs on tiny synthetic data, on CPU and migrated to the npu
device, and compares their losses (and, where the program saves one, the final weights).

    python scripts/public_programs.py /work/.mirror/karpathy+nanoGPT/repo
    python scripts/public_programs.py <folder with train.py, model.py, configurator.py> --program nanogpt

The source is a bare git directory (the program is taken from its HEAD, or --ref) or a folder; it
is copied to a temporary folder and never modified. Each mode is a function
`run_<mode>(program, workdir) -> Run`; MODES lists them. Today's modes:

* ``cpu``: the program as published, told to use the CPU;
* ``transfer``: the program as published, with its default CUDA device, run with
  TORCH_TRANSFER_TO_NPU=1 (transfer_to_npu applied when `import torch` loads opennpu);
* ``convert``: the program's folder, as extracted, converted by the offline converter
  (``python -m opennpu.migrate -i <copy> -o <out>``, as a user runs it), then the converted
  program run with the command line of ``transfer`` (its CUDA device is now npu), without
  transfer_to_npu.

The processes inherit this process's environment (PYTHONPATH included), so they test whichever
opennpu that environment imports.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np


@dataclasses.dataclass
class Run:
    """What one mode's run of a program gave."""

    mode: str
    returncode: int
    losses: list[float]
    output: str
    weights: dict | None = None  # final weights (CPU tensors) when the program saved them
    report: dict[str, int] | None = None  # convert: rows of each CSV the converter wrote


@dataclasses.dataclass
class Program:
    """A public program: the files it needs, how to make its data and run it, and how to read its
    losses and final weights."""

    name: str
    files: tuple[str, ...]
    synthesize: Callable[[Path], None]
    command: Callable[[str], list[str]]  # mode -> command line (run in the work folder)
    losses: Callable[[str], list[float]]
    weights: Callable[[Path, str], dict | None]
    subdir: str = ""  # the program's folder in its repository
    outputs: tuple[str, ...] = ()  # glob patterns of what the runs write (not converted)

    def folder(self, workdir: Path) -> Path:
        return workdir / self.subdir

    def matches(self, workdir: Path) -> bool:
        return all((self.folder(workdir) / f).is_file() for f in self.files)


# -- nanoGPT (karpathy/nanoGPT train.py) ----------------------------------------------------------

_NANOGPT_CONFIG = ["--dataset=synthetic", "--compile=False", "--dtype=float32", "--batch_size=4",
                   "--block_size=32", "--n_layer=2", "--n_head=2", "--n_embd=32", "--max_iters=6",
                   "--eval_interval=6", "--eval_iters=2", "--log_interval=1", "--warmup_iters=2",
                   "--lr_decay_iters=6", "--gradient_accumulation_steps=2", "--wandb_log=False"]


def _nanogpt_data(folder: Path) -> None:
    """data/synthetic/{train,val}.bin (uint16 tokens) and meta.pkl with a 64-token vocabulary."""
    data = folder / "data" / "synthetic"
    data.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for split, n in (("train", 20000), ("val", 4000)):
        rng.integers(0, 64, n, dtype=np.uint16).tofile(data / f"{split}.bin")
    with open(data / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 64}, f)


def _nanogpt_command(mode: str) -> list[str]:
    device = ["--device=cpu"] if mode == "cpu" else []  # otherwise the program's default: cuda
    return ["train.py", *_NANOGPT_CONFIG, *device, f"--out_dir=out_{mode}"]


def _nanogpt_losses(output: str) -> list[float]:
    return [float(m.group(1)) for m in re.finditer(r"^iter \d+: loss ([-\d.]+)", output, re.M)]


def _nanogpt_weights(folder: Path, mode: str) -> dict | None:
    import torch

    path = folder / f"out_{mode}" / "ckpt.pt"
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)["model"]


# -- word_language_model (pytorch/examples, the versions with --cuda, up to ac7e960) ------------

_WORDS = [f"w{i}" for i in range(40)]


def _wlm_data(folder: Path) -> None:
    """data/synthetic/{train,valid,test}.txt: lines of words drawn from a 40-word vocabulary."""
    data = folder / "data" / "synthetic"
    data.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for split, lines in (("train", 200), ("valid", 40), ("test", 40)):
        text = "\n".join(" ".join(rng.choice(_WORDS, 12)) for _ in range(lines))
        (data / f"{split}.txt").write_text(text + "\n", encoding="utf8")


def _wlm_command(mode: str) -> list[str]:
    cuda = [] if mode == "cpu" else ["--cuda"]
    return ["main.py", "--data", "data/synthetic", "--epochs", "2", "--emsize", "16", "--nhid", "16",
            "--nlayers", "1", "--bptt", "10", "--batch_size", "4", "--log-interval", "10",
            "--save", f"model_{mode}.pt", *cuda]


def _wlm_losses(output: str) -> list[float]:
    return [float(m.group(1)) for m in re.finditer(r"\|\s+(?:valid |test )?loss\s+([-\d.]+)", output)]


def _wlm_weights(folder: Path, mode: str) -> dict | None:
    import torch

    path = folder / f"model_{mode}.pt"
    if not path.exists():
        return None
    sys.path.insert(0, str(folder))  # the file pickles the whole module, of class model.RNNModel
    try:
        return torch.load(path, map_location="cpu", weights_only=False).state_dict()
    finally:
        sys.path.remove(str(folder))


PROGRAMS = {
    "nanogpt": Program("nanogpt", ("train.py", "model.py", "configurator.py"), _nanogpt_data,
                       _nanogpt_command, _nanogpt_losses, _nanogpt_weights, outputs=("out_*",)),
    "word_language_model": Program("word_language_model", ("main.py", "model.py", "data.py"),
                                   _wlm_data, _wlm_command, _wlm_losses, _wlm_weights,
                                   subdir="word_language_model", outputs=("model_*.pt",)),
}


# -- modes ---------------------------------------------------------------------------------------

def _run(program: Program, workdir: Path, mode: str, env: dict, folder: Path | None = None) -> Run:
    folder = program.folder(workdir) if folder is None else folder
    proc = subprocess.run([sys.executable, *program.command(mode)], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=1800)
    output = proc.stdout + proc.stderr
    weights = program.weights(folder, mode) if proc.returncode == 0 else None
    return Run(mode, proc.returncode, program.losses(proc.stdout), output, weights)


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_TRANSFER_TO_NPU",)}
    if env.get("PYTHONPATH"):  # the programs run in another folder
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in env["PYTHONPATH"].split(os.pathsep) if p)
    env.update(extra)
    return env


def run_cpu(program: Program, workdir: Path) -> Run:
    """The program as published, on the CPU."""
    return _run(program, workdir, "cpu", _env(TORCH_TRANSFER_TO_NPU="0"))


def run_transfer(program: Program, workdir: Path) -> Run:
    """The program as published, on its CUDA device, migrated at run time by transfer_to_npu."""
    return _run(program, workdir, "transfer", _env(TORCH_TRANSFER_TO_NPU="1"))


def run_convert(program: Program, workdir: Path) -> Run:
    """The program's folder copied to <workdir>_convert/<name>, converted with the converter's
    command line into <workdir>_convert/out/<name>_msft, and run there on its (now npu) device."""
    base = workdir.with_name(workdir.name + "_convert")
    source = base / program.name
    shutil.copytree(program.folder(workdir), source,
                    ignore=shutil.ignore_patterns("__pycache__", *program.outputs))
    (base / "out").mkdir()
    env = _env(TORCH_TRANSFER_TO_NPU="0")
    proc = subprocess.run([sys.executable, "-m", "opennpu.migrate", "-i", str(source), "-o",
                           str(base / "out")], env=env, capture_output=True, text=True, timeout=600)
    converter = f"$ python -m opennpu.migrate -i {source} -o {base / 'out'}\n{proc.stdout}{proc.stderr}"
    if proc.returncode != 0:
        return Run("convert", proc.returncode, [], converter)
    converted = base / "out" / f"{program.name}_msft"
    run = _run(program, workdir, "convert", env, folder=converted)
    run.output = converter + run.output
    results = converted / "transplant_result_file"
    run.report = {}
    for path in sorted(results.glob("*.csv")):
        with open(path, newline="", encoding="utf-8") as f:
            run.report[path.name] = max(0, sum(1 for _ in csv.reader(f)) - 1)  # less the header
    return run


MODES: dict[str, Callable[[Program, Path], Run]] = {"cpu": run_cpu, "transfer": run_transfer,
                                                     "convert": run_convert}


# -- source ----------------------------------------------------------------------------------------

def _is_git_dir(path: Path) -> bool:
    return (path / "HEAD").is_file() and (path / "objects").is_dir()


def _git(source: Path, *args: str, text: bool = True):
    return subprocess.run(["git", "--git-dir", str(source), *args], capture_output=True, text=text)


def _pick(exists: Callable[[str], bool], name: str | None) -> Program:
    if name is not None:
        return PROGRAMS[name]
    for program in PROGRAMS.values():
        if all(exists(f"{program.subdir}/{f}".lstrip("/")) for f in program.files):
            return program
    raise SystemExit(f"no known program found (known: {', '.join(PROGRAMS)})")


def extract(source: Path, workdir: Path, ref: str, name: str | None) -> tuple[Program, str]:
    """Copies the program's folder into `workdir`: from a git directory, the files of commit `ref`
    (files whose contents the snapshot lacks, such as large data sets, are skipped); from a folder,
    everything. Returns the program and where it came from."""
    if not _is_git_dir(source):
        shutil.copytree(source, workdir, dirs_exist_ok=True)
        return _pick(lambda f: (workdir / f).is_file(), name), str(source)
    commit = _git(source, "rev-parse", ref).stdout.strip()
    listing = _git(source, "ls-tree", "-r", "--name-only", commit)
    if listing.returncode != 0:
        raise SystemExit(listing.stderr)
    files = set(listing.stdout.split("\n")) - {""}
    program = _pick(lambda f: f in files, name)
    prefix = f"{program.subdir}/" if program.subdir else ""
    skipped = []
    for path in sorted(f for f in files if f.startswith(prefix)):
        blob = _git(source, "show", f"{commit}:{path}", text=False)
        if blob.returncode != 0:
            skipped.append(path)
            continue
        target = workdir / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(blob.stdout)
    note = f" ({len(skipped)} files absent from the snapshot skipped)" if skipped else ""
    return program, f"{source} @ {commit}{note}"


def compare_weights(a: dict | None, b: dict | None) -> str | None:
    """"bit-identical", or how two state dicts differ (None when either is missing)."""
    if a is None or b is None:
        return None
    if a.keys() != b.keys():
        return "differ in their keys"
    diff = max(float((a[k].double() - b[k].double()).abs().max()) if a[k].numel() else 0.0 for k in a)
    return "bit-identical" if diff == 0 else f"differ (max abs difference {diff:.3g})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="a bare git directory or a folder")
    parser.add_argument("--program", choices=sorted(PROGRAMS), help="default: detected from the files")
    parser.add_argument("--ref", default="HEAD", help="commit to take from a git directory")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, first is the reference")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    args = parser.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="public_program_"))
    workdir = root / "program"
    try:
        program, origin = extract(args.source.resolve(), workdir, args.ref, args.program)
        program.synthesize(program.folder(workdir))
        print(f"program {program.name} from {origin}")
        runs = [MODES[mode](program, workdir) for mode in args.modes.split(",")]
        reference = runs[0]
        ok = True
        for run in runs:
            print(f"{run.mode:>9}: exit {run.returncode}, losses {run.losses}")
            if run.report is not None:
                print(f"{'':>9}  converter report rows: "
                      + ", ".join(f"{name} {rows}" for name, rows in run.report.items()))
            if run.returncode != 0 or not run.losses:
                ok = False
                print(run.output[-4000:])
        for run in runs[1:]:
            losses_match = run.losses == reference.losses and bool(run.losses)
            weights = compare_weights(run.weights, reference.weights)
            ok = ok and losses_match
            print(f"{run.mode} vs {reference.mode}: losses {'match' if losses_match else 'DIFFER'}"
                  + ("" if weights is None else f", final weights {weights}"))
        return 0 if ok else 1
    finally:
        if args.keep:
            print(f"work folder kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
