"""Drafter recipes beyond the DFlash one: `dspark` (Markov and confidence heads on the DFlash
backbone)."""
