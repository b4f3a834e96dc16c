"""Framework integrations that import their framework (install the matching extra)."""
