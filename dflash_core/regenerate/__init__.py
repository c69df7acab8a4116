"""Regeneration jobs: the target writes the training data (job.py, run.py, output.py; decode.py is
the static-cache decoder the run and a continual job's answering share)."""
