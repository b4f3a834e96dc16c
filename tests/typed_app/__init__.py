"""A user's small typed app (see tests/test_typed_app.py)."""
