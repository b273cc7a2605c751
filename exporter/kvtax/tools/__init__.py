"""The offline tools: ``kvtax plan`` (capacity planner and scheduler simulator) and
``kvtax loadtest`` / ``kvtax annotate`` (knee finder and benchmark annotator).

They run on a workstation or in CI, never in the pod, and ``kvtax serve`` never imports them.
"""
