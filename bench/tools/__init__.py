"""Driving the load tools kvtax reads (guidellm, kvtax loadtest, annotate), and the CLI's
start-up."""
