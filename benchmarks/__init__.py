"""rollart benchmarks: ``python -m benchmarks.NAME [--quick] --json OUT`` (see README.md)."""
