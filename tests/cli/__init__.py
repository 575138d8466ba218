"""The command line's search and index commands; a package so its conftest does not shadow tests/conftest.py."""
