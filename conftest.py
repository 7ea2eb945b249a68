"""Doctests in jshard/ run with the same simulated devices as the tests."""

pytest_plugins = ["tests.conftest"]
