"""Serving over any engine: the OpenAI-compatible server (``server``), the one thread that owns the engine
(``worker``), the chat page and its headless-browser screenshot (``browser``).

The package sits above the engines and below the experiments: ``experiment=serve`` measures through it,
``serve.py`` runs it from the command line; nothing here imports an experiment or the runner.
"""
