"""The typed example is type-checked (tests/test_typed_app.py), never imported by pytest."""

collect_ignore_glob = ["*.py"]
