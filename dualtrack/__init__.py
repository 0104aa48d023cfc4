"""The `dualtrack` command: tools that work on a run's records and on the Pushgateway."""
