"""Regeneration jobs: the target writes the training data (job.py, run.py, output.py)."""
