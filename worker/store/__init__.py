"""Redis: the key layout, the checkpoint registry, the updater lease and canary evidence."""
