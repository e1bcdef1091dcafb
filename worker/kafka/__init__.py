"""Kafka plumbing: client factories, the at-least-once batch loop every role runs, and
:class:`~worker.kafka.runtime.RoleRuntime`, the scaffolding every role shares."""
