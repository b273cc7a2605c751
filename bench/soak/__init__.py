"""Long runs through the proxy: memory, descriptors and exact counts over 100,000 requests."""
