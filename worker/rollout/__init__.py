"""Probe versions in production.

``policy`` the pure promotion/rollback rules, ``changes`` applies them as stage changes
(:class:`~worker.rollout.changes.Rollout`), ``operator`` an operator's own changes with
the refusals the CLI and the console share, ``status`` the views of versions and stages
(``status_text`` renders them for the CLI).
"""
