"""The test suite: one folder per package under test, helpers in support/ (tests/repo/test_layout.py)."""
