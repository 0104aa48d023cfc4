"""Tests of the `dualtrack` command: replay, report, explain, janitor and the Prometheus client."""
