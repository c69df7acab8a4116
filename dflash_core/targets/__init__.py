"""Real pretrained targets the project's own files can install (never downloaded at run time)."""
