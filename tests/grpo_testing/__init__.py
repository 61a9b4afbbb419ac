"""Shared helpers of the test suite (importable because pyproject puts tests/ on the path)."""
