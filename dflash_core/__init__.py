"""Tensor side of dflash-trainer: data -> target -> drafter -> loss -> engine -> checkpoints.

Nothing in this package imports web or metrics libraries; `service` drives it.
"""
