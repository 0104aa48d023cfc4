"""One-line integrations with training frameworks (each an optional extra)."""
