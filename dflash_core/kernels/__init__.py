"""Hand-written Triton kernels for the CUDA step: the two-pass cross-entropy of a loss chunk
(`ce`) and the AdamW update over fp32 masters with bf16 working copies (`adamw`). Both import
Triton at module import; callers import them lazily so CPU-only installs without Triton work."""
