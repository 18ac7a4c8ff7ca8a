"""GPU benchmarks of humming_jax (see NOTES.md for what was measured)."""
