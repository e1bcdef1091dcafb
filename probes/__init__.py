"""Probe modules and their checkpoint format. Depends on torch and schemas only."""
