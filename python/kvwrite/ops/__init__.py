"""Public store ops: host validation, backend dispatch and torch custom-op registration."""
