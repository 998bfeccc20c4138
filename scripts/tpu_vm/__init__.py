"""A TPU VM that runs a sweep on boot: ``startup.sh`` (its startup script), ``boot_stage.py`` (one
stage's boot evidence), ``create.py`` (the gcloud commands for a v5e-1 queued resource)."""
