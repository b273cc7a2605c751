"""Grafana dashboards as code: Overview, Capacity and Fleet, generated and checked.

:mod:`.promql` composes queries from the catalog, the vLLM vocabulary and the recording rules;
:mod:`.model` holds the boards' value types and :mod:`.render` renders them into Grafana JSON
(a panel's JSON in :mod:`.panels`, the variables in :mod:`.templating`); :mod:`.overview`,
:mod:`.capacity` and :mod:`.fleet` define the three dashboards (:mod:`.boards` lists them,
:mod:`.common` holds what they share); :mod:`.schema` is the JSON Schema of the generated subset;
:mod:`.generate` produces the committed files under ``dashboards/``; :mod:`.lint` checks them
(ids, grid, datasource, rate intervals, series names); :mod:`.cli` is ``kvtax dashboards``.
The preview that draws them as PNG from a live Prometheus is development tooling, in
:mod:`kvtax_dev.preview` (a checkout only).
"""

from kvtax.dashboards.boards import BOARDS
from kvtax.dashboards.generate import artifacts, dashboards
from kvtax.dashboards.lint import problems

__all__ = ["BOARDS", "artifacts", "dashboards", "problems"]
