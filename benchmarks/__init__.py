"""Benchmarks of the algorithm scripts; see benchmarks/README.md. Run them as scripts:
`python benchmarks/run.py --mode quick`."""
