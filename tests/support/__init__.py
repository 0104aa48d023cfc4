"""Helpers the tests share (no tests here): daemons, fakes, builders of records and plans, paths."""
