"""Kafka plumbing: client factories and the at-least-once batch loop every role runs."""
