"""The vocabulary table: one entry per concept, newest names first, and the only `vllm:` speller."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import kvtax
from kvtax.engine.vocabulary import BY_SERIES, CONCEPTS, Aggregate, Kind, concept_for

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
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
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
