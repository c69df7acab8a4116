"""Control plane of dflash-trainer: HTTP API, persistent job queue, metrics, CLI (no tensor code;
it drives dflash_core's engine, which returns plain Python values)."""
