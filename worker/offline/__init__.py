"""Offline work on labeled files: reading them, building hidden-state caches, fit and eval."""
