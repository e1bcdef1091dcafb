"""Kafka plumbing: client factories (``clients``), the at-least-once batch loop every role
runs (``batch_loop``), and what each long-running role shares around it (``runtime``:
:class:`~worker.kafka.runtime.RoleRuntime`, with health, metrics server and stop)."""
