"""opennpu's benchmark harness: `python -m benchmarks.run --help`.

The method and targets are in shared/PERFORMANCE.md.
"""
