"""The vocabulary table: one entry per concept, newest names first, and the only `vllm:` speller."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import kvtax
from kvtax.engine.vocabulary import (
    BY_SERIES,
    CONCEPTS,
    NOT_READ,
    Aggregate,
    Kind,
    accounted_for,
    concept_for,
)
from tests.unit.sourcescan import docstring_ids

PACKAGE = Path(kvtax.__file__).resolve().parent


def test_every_exposed_name_belongs_to_exactly_one_concept() -> None:
    seen: dict[str, str] = {}
    for concept in CONCEPTS.values():
        for name in concept.names:
            assert name not in seen, f"{name} is in both {seen[name]} and {concept.name}"
            seen[name] = concept.name
    assert set(seen) == set(BY_SERIES)


@pytest.mark.parametrize(
    ("concept", "newest_first"),
    [
        ("kv_usage", ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")),
        (
            "prefix_cache_queries",
            ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
        ),
        ("prefix_cache_hits", ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")),
        ("itl", ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")),
    ],
)
def test_renamed_concepts_list_the_newest_name_first(
    concept: str, newest_first: tuple[str, ...]
) -> None:
    assert CONCEPTS[concept].names == newest_first
    for rank, name in enumerate(newest_first):
        assert BY_SERIES[name] == (CONCEPTS[concept], rank)


def test_kv_usage_combines_engines_by_max_and_counters_by_sum() -> None:
    assert CONCEPTS["kv_usage"].aggregate is Aggregate.MAX
    assert CONCEPTS["preemptions"].aggregate is Aggregate.SUM
    assert CONCEPTS["generation_tokens"].aggregate is Aggregate.SUM


def test_v0_names_are_in_the_table() -> None:
    for name in (
        "vllm:gpu_cache_usage_perc",
        "vllm:time_per_output_token_seconds",
        "vllm:num_requests_swapped",
        "vllm:gpu_prefix_cache_hit_rate",
        "vllm:avg_prompt_throughput_toks_per_s",
        "vllm:avg_generation_throughput_toks_per_s",
    ):
        assert name in BY_SERIES


def test_the_preemption_counter_is_the_exposed_total_not_the_trap_name() -> None:
    assert concept_for("vllm:num_preemptions_total") == (CONCEPTS["preemptions"], 0, "")
    assert concept_for("vllm:num_preemptions") is None


def test_histogram_samples_map_by_part() -> None:
    ttft = CONCEPTS["ttft"]
    assert concept_for("vllm:time_to_first_token_seconds_bucket") == (ttft, 0, "bucket")
    assert concept_for("vllm:time_to_first_token_seconds_sum") == (ttft, 0, "sum")
    assert concept_for("vllm:time_to_first_token_seconds_count") == (ttft, 0, "count")
    itl = CONCEPTS["itl"]
    assert concept_for("vllm:time_per_output_token_seconds_bucket") == (itl, 1, "bucket")


@pytest.mark.parametrize(
    "name",
    [
        "vllm:time_to_first_token_seconds",  # a histogram's bare base name is not a sample
        "vllm:time_to_first_token_seconds_created",
        "vllm:prompt_tokens_created",
        "vllm:prompt_tokens_total_bucket",  # a counter never has histogram parts
        "vllm:iteration_tokens_total_bucket",
        "process_resident_memory_bytes",
    ],
)
def test_names_outside_the_table_map_to_nothing(name: str) -> None:
    assert concept_for(name) is None


def test_every_concept_has_a_kind_and_help() -> None:
    for concept in CONCEPTS.values():
        assert isinstance(concept.kind, Kind)
        assert concept.help
        assert concept.names


def _code_strings(path: Path) -> list[tuple[int, str]]:
    """String literals in a module, docstrings excluded."""
    tree = ast.parse(path.read_text())
    docstrings = docstring_ids(tree)
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
    ]


def test_no_module_but_the_vocabulary_spells_a_vllm_metric_name() -> None:
    metric_name = re.compile(r"vllm:[a-z_]")
    offenders = [
        f"{path.relative_to(PACKAGE)}:{line}: {text!r}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "vocabulary.py"
        for line, text in _code_strings(path)
        if metric_name.search(text)
    ]
    assert offenders == []


# -- every name vLLM defines is read or deliberately not read --------------------------------

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"


def _definitions(name: str) -> dict[str, tuple[str, str]]:
    """family -> (kind, labels) from a definitions list made by extract_definitions.py."""
    rows = {}
    for line in (FIXTURES / name).read_text().splitlines():
        if line and not line.startswith("#"):
            family, kind, labels, _module = line.split()
            rows[family] = (kind, labels)
    return rows


def _type_families(pattern: str) -> set[str]:
    return {
        line.split()[2]
        for path in sorted(FIXTURES.glob(pattern))
        for line in path.read_text().splitlines()
        if line.startswith("# TYPE vllm:")
    }


def test_the_0_33_definitions_fixture_lists_the_wheel_s_families() -> None:
    defined = _definitions("0.33-definitions.txt")
    # The three names the issue says 0.33 adds, and the admission counter with its reason.
    assert defined["vllm:watermark_requests_total"] == ("counter", "model_name,engine,status")
    assert defined["vllm:prompt_tokens_cached_by_source_total"][0] == "counter"
    assert defined["vllm:num_requests_kv_fetch_by_stage"] == (
        "gauge",
        "model_name,engine,stage",
    )
    assert defined["vllm:admission_rejections_total"] == ("counter", "model_name,reason")
    # A histogram is listed by base name even when it ends in _total.
    assert defined["vllm:iteration_tokens_total"][0] == "histogram"
    assert len(defined) == 53


def test_every_0_33_definition_is_read_or_deliberately_not_read() -> None:
    defined = _definitions("0.33-definitions.txt")
    assert sorted(f for f in defined if not accounted_for(f)) == []


def test_every_family_of_the_0_32_captures_is_read_or_deliberately_not_read() -> None:
    families = _type_families("0.32-*.prom")
    assert "vllm:lora_requests_info" in families
    assert "vllm:num_preemptions_created" in families
    assert sorted(f for f in families if not accounted_for(f)) == []


def test_the_0_32_captures_carry_only_families_the_0_33_wheel_defines() -> None:
    defined = set(_definitions("0.33-definitions.txt"))
    captured = {
        f
        for f in _type_families("0.32-*.prom")
        if not (f.endswith("_created") and (f[: -len("_created")] + "_total") in defined)
        and not (f.endswith("_created") and f[: -len("_created")] in defined)
    }
    assert captured <= defined


@pytest.mark.parametrize(
    "family",
    [
        "vllm:some_metric_a_future_vllm_adds",
        "vllm:some_metric_a_future_vllm_adds_total",
        "vllm:some_metric_a_future_vllm_adds_created",
        "vllm:num_preemptions",  # the defined name without the _total prometheus_client adds
    ],
)
def test_a_name_neither_read_nor_listed_is_not_accounted_for(family: str) -> None:
    assert not accounted_for(family)


def test_created_companions_follow_their_parent() -> None:
    assert accounted_for("vllm:num_preemptions_created")  # counter, read
    assert accounted_for("vllm:time_to_first_token_seconds_created")  # histogram, read
    assert accounted_for("vllm:mm_cache_hits_created")  # counter, not read
    assert accounted_for("vllm:iteration_tokens_total_created")  # histogram named *_total


def test_no_name_is_both_read_and_not_read() -> None:
    assert set(NOT_READ) & set(BY_SERIES) == set()
    assert all(why.strip() for why in NOT_READ.values())
