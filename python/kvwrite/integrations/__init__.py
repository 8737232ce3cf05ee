"""Engine integrations: plugins that route an unmodified engine's cache writes through kvwrite."""
