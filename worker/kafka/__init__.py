"""Kafka plumbing: client factories (``clients``), the at-least-once batch loop every role
runs (``batch_loop``; its send side, resending until acknowledged, ``delivery``), an
out-of-order offset tracker for inputs answered one at a time (``offsets``: the review
queue), what each long-running role shares around it (``runtime``:
:class:`~worker.kafka.runtime.RoleRuntime`, with health, metrics server and stop), a judged
batch's verdict and review records (``judged``) and the outbox that sends them off the
request path for ``serve`` and the inline guard (``outbox``)."""
