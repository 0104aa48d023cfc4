"""Helpers the tests share (no tests here): daemons, fakes, fixtures data, paths."""
