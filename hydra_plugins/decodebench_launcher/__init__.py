"""decodebench's Hydra launcher (``hydra/launcher=isolated``). Hydra loads launchers only from the
``hydra_plugins`` namespace package, and imports every module in it at start-up: keep imports lazy."""
