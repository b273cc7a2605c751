"""The scrape pipeline: one page's cost (pipeline), big pages (bigpage), parse lag, and
1,000 pods (scale)."""
