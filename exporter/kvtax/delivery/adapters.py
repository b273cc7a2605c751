"""LoRA adapters and their base models: which engine series an adapter's tokens belong to.

A request for a LoRA adapter names the adapter in ``model``, while vLLM's metrics carry only the
base model's ``model_name``: the adapter's tokens run on the base model's engine. So the ledger
must count them under the base model, or the join loses them (they would land in a label no
engine series has). The map comes from two places: vLLM's ``/v1/models``, which lists every
adapter with its ``parent`` (:func:`adapters_from_models`), and the operator's config
(``--delivery.adapters``), which wins where both name an adapter. The same list names the
base model's ``--served-model-name`` aliases and its default (:func:`served_from_models`), so a
request for an alias, or for no model, counts under the name vLLM's metrics use. Pure: no I/O.

Example::

    >>> adapters_from_models(
    ...     {"data": [{"id": "base"}, {"id": "sql-lora", "parent": "base"}]}
    ... )
    {'sql-lora': 'base'}
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtax.errors import UpstreamError

__all__ = [
    "MAX_ADAPTERS",
    "AdapterError",
    "ServedNames",
    "adapter_pairs",
    "adapters_from_models",
    "merge_adapters",
    "served_from_models",
]

# More adapters than this are ignored: each one is a label value on kvtax's own series.
MAX_ADAPTERS = 256


class AdapterError(UpstreamError, ValueError):
    """``/v1/models`` answered something that is not an OpenAI model list."""


def adapters_from_models(document: object, limit: int = MAX_ADAPTERS) -> dict[str, str]:
    """Adapter id -> base model id, from a parsed ``GET /v1/models`` body.

    An entry with a ``parent`` other than itself is an adapter (vLLM sets ``parent`` to None on
    base models); entries without one, or with fields of the wrong type, are skipped. Raises
    :class:`AdapterError` when the body has no ``data`` list at all.
    """
    if not isinstance(document, Mapping) or not isinstance(document.get("data"), list):
        raise AdapterError("expected a JSON object with a 'data' list of models")
    found: dict[str, str] = {}
    for entry in document["data"]:
        if len(found) >= limit:
            break
        if not isinstance(entry, Mapping):
            continue
        adapter, parent = entry.get("id"), entry.get("parent")
        named = isinstance(adapter, str) and isinstance(parent, str) and adapter and parent
        if named and adapter != parent:
            found[str(adapter)] = str(parent)
    return found


@dataclass(frozen=True, slots=True)
class ServedNames:
    """The names vLLM serves its base model under, as its metrics see them.

    ``default`` is the name vLLM's metrics label ``model_name`` carries, and the model that
    serves a request naming none: vLLM's first ``--served-model-name`` (``/v1/models`` lists it
    first). ``aliases`` maps every other name of the same model to its metrics name.
    """

    default: str | None = None
    aliases: Mapping[str, str] = field(default_factory=dict)


def served_from_models(document: object, limit: int = MAX_ADAPTERS) -> ServedNames:
    """The base model's names, from a parsed ``GET /v1/models`` body.

    vLLM lists each ``--served-model-name`` as its own entry, in the order given, each with
    ``root`` set to the model's path and no ``parent`` (that is what adapters have). Its
    metrics and its default are the first name (``base_model_paths[0]``), so the first base
    entry is the default, and a later base entry with the same ``root`` is an alias of the
    first one with that root. An entry without a ``root`` stands for itself. Raises
    :class:`AdapterError` when the body has no ``data`` list at all.
    """
    if not isinstance(document, Mapping) or not isinstance(document.get("data"), list):
        raise AdapterError("expected a JSON object with a 'data' list of models")
    default: str | None = None
    first_of_root: dict[str, str] = {}
    aliases: dict[str, str] = {}
    for entry in document["data"]:
        if len(aliases) >= limit:
            break
        if not isinstance(entry, Mapping):
            continue
        name, parent, root = entry.get("id"), entry.get("parent"), entry.get("root")
        if not isinstance(name, str) or not name:
            continue
        if isinstance(parent, str) and parent and parent != name:
            continue  # an adapter
        if default is None:
            default = name
        if not isinstance(root, str) or not root:
            continue
        canonical = first_of_root.setdefault(root, name)
        if canonical != name:
            aliases[name] = canonical
    return ServedNames(default, aliases)


def merge_adapters(
    configured: Iterable[tuple[str, str]],
    discovered: Mapping[str, str],
    limit: int = MAX_ADAPTERS,
) -> dict[str, str]:
    """The adapters kvtax uses: ``discovered`` overridden by ``configured`` pairs, bounded."""
    merged = dict(configured)
    for adapter, parent in discovered.items():
        if len(merged) >= limit:
            break
        merged.setdefault(adapter, parent)
    # An adapter that names itself as its base would join nothing new.
    return {a: p for a, p in merged.items() if a != p}


def adapter_pairs(value: Any) -> tuple[tuple[str, str], ...]:
    """``sql-lora=llama,chat-lora=llama`` (or a YAML mapping) as (adapter, base) pairs.

    The setting parser of ``--delivery.adapters``; raises ValueError on a malformed pair.
    """
    if isinstance(value, Mapping):
        items = [(str(k), str(v)) for k, v in value.items()]
    else:
        items = []
        for part in str(value or "").split(","):
            if not part.strip():
                continue
            adapter, sep, base = part.partition("=")
            items.append((adapter, base) if sep else ("", ""))
    pairs = tuple((a.strip(), b.strip()) for a, b in items)
    for adapter, base in pairs:
        if not adapter or not base:
            raise ValueError("expected ADAPTER=BASE pairs separated by commas")
        if adapter == base:
            raise ValueError(f"adapter {adapter!r} names itself as its base model")
    if len(pairs) > MAX_ADAPTERS:
        raise ValueError(f"at most {MAX_ADAPTERS} adapters")
    return tuple(sorted(pairs))
