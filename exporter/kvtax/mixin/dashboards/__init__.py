"""Grafana dashboards as code: Overview, Capacity, Fleet and Gate, generated and checked.

:mod:`.queries` composes queries from the catalog, the vLLM vocabulary and the recording rules;
:mod:`.model` holds the boards' value types and :mod:`.render` renders them into Grafana JSON
(a panel's JSON in :mod:`.panels`, the variables in :mod:`.templating`); :mod:`.overview`,
:mod:`.capacity`, :mod:`.fleet`, :mod:`.costs` and :mod:`.gate` define the dashboards
(:mod:`.boards` lists them, :mod:`.common` holds what they share); :mod:`.generate` produces the
committed files under ``dashboards/``. ``kvtax dashboards`` is :mod:`kvtax.cli.dashboards`.
The checks of the generated JSON (its schema, and the lint of ids, grid, datasource, rate
intervals and series names) and the PNG preview are development tooling, in
:mod:`kvtax_dev.dashboard_schema`, :mod:`kvtax_dev.dashboard_lint` and :mod:`kvtax_dev.preview`
(a checkout only).
"""

from kvtax.mixin.dashboards.boards import BOARDS
from kvtax.mixin.dashboards.generate import artifacts, dashboards

__all__ = ["BOARDS", "artifacts", "dashboards"]
