"""opennpu's benchmark harness: `python -m benchmarks.run --help` (method: shared/PERFORMANCE.md)."""
