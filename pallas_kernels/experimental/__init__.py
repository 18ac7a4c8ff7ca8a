"""Kernels no op reaches yet; each module says what would promote it."""
