"""One drafter training step, in the order it runs: block inputs and labels (`blocks`), the
DFlash attention mask and its kernels (`attention`), the chunked lm_head + cross-entropy
(`loss`), and the micro-step that strings them together (`micro_step`)."""
