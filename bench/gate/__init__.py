"""The gate under open-loop overload beside vLLM's caps and GIE's rule (gate), and fair
shares (fair)."""
