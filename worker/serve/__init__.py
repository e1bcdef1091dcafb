"""``probeguard serve``: OpenAI- and Perspective-compatible moderation endpoints on the
scoring engine the Kafka scorer uses, through the front door the inline guard has too
(:mod:`worker.scoring.front`; see :mod:`worker.serve.server`)."""
