"""Whole-repository static checks: layering between packages, the layout of tests/."""
