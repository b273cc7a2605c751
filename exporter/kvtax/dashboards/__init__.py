"""Grafana dashboards as code: Overview, Capacity and Fleet, generated, checked and previewed.

:mod:`.promql` composes queries from the catalog, the vLLM vocabulary and the recording rules;
:mod:`.model` renders panels into Grafana JSON; :mod:`.overview`, :mod:`.capacity` and
:mod:`.fleet` define the three dashboards (:mod:`.boards` lists them, :mod:`.common` holds what
they share); :mod:`.schema` is the JSON Schema of the generated subset;
:mod:`.generate` produces the committed files under ``dashboards/``; :mod:`.lint` checks them
(ids, grid, datasource, rate intervals, series names); :mod:`.preview` draws them as PNG from a
live Prometheus (matplotlib, the ``preview`` extra); :mod:`.cli` is ``kvtax dashboards``.
"""

from .boards import BOARDS
from .generate import artifacts, dashboards
from .lint import problems

__all__ = ["BOARDS", "artifacts", "dashboards", "problems"]
