"""Against a real engine: offload, the tax estimate, prefill ratios, what-if runs, vLLM's CLI."""
