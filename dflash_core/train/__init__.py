"""Training jobs: the run of the default kind (run.py), which the continual kind extends, and when
a run evaluates (evaluation.py)."""
