"""Fault-injection tests (issue #6); a package so its conftest does not shadow tests/conftest.py."""
