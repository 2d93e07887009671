"""``python -m opennpu.migrate``: the offline converter (msFmkTransplt-compatible command line)."""

from .convert.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
