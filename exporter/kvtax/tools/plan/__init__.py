"""``kvtax plan``: size a vLLM deployment before it runs, and predict what a setting would cost.

The package reads from the bottom up (its one exception is :class:`kvtax.errors.PlanError`):
:mod:`.modelcfg` (a model's KV shape from config.json or flags), :mod:`.params` (weights
estimated from config.json), :mod:`.gpus` (``--gpu`` presets), :mod:`.weights` (weight bytes
from safetensors headers), :mod:`.sizing` (pool, tokens and concurrency: arithmetic only),
:mod:`.profile` (request lengths from flags or histograms), :mod:`.simulate` (vLLM V1's
scheduler, step by step: its value types in :mod:`.simtypes`, its step machinery in
:mod:`.scheduler` over the block pool of :mod:`.blockpool`), :mod:`.summary` (the table and the
JSON), then :mod:`.fetch` (the only module here that touches the network), :mod:`.inputs` (the
flags, files and pages read into a shape, a pool and a length profile) and :mod:`.build` (the
plan made of them). The command line, its flags and its output, is :mod:`kvtax.cli.plan`.
"""
