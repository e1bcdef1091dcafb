"""Running parts of probeguard: extraction, Kafka loops, Redis registry, CLI, embedded stack."""
