"""decodebench core: configuration, device layer, checkpoints, evidence records."""
