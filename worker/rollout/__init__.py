"""Probe versions in production.

The pure promotion/rollback policy, stage operations and status views.
"""
