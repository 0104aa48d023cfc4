"""Tests of trainer_hook: the hook, its record, push / pull / remote write, integrations, DDP."""
