"""Serving over any engine: the OpenAI-compatible server (``server``), the fields its requests may hold
(``api``), tokens into text and log-probabilities (``text``), the one thread that owns the engine
(``worker``), the chat page and its headless-browser screenshot (``browser``).

The package sits above the engines and below the experiments: ``experiment=serve`` measures through it,
``serve.py`` runs it from the command line; nothing here imports an experiment or the runner.
"""
