"""Benchmarks: `make bench` writes bench/results/<name>.json and <name>.md."""
