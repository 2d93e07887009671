"""`python -m opennpu.analyze script.py [args]`: see runner.py."""

from __future__ import annotations

from .runner import main

if __name__ == "__main__":
    raise SystemExit(main())
