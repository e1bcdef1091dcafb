"""``probeguard serve``: OpenAI- and Perspective-compatible moderation endpoints on the
scoring engine the Kafka scorer uses (see :mod:`worker.serve.server`)."""
