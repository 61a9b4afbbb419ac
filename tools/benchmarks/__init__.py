"""Benchmarks of the GRPO trainer: lag sweep, engine throughput, TRL side by side.

Run everything with ``python tools/benchmarks/run_all.py`` (see ``benchmarks/README.md``). The
benchmark environments in ``tools.benchmarks.envs`` are importable as env-config ``agent_type``
entries when the repository root is on ``PYTHONPATH``.
"""
