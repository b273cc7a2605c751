"""``kvtax plan`` end to end in-process: the table, --json, --what-if, and one-line errors."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlparse

import pytest

from kvtax.cli.main import main
from kvtax.tools.plan.profile import profile_from_kvtax_page
from tests.unit.test_plan_sizing import LLAMA_31_8B

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"
OVERLOAD = ["--prompt-p50", "41", "--prompt-p95", "41", "--output-p50", "500"]
OVERLOAD += ["--output-p95", "500"]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    code, out, err = run([*argv, "--json"], capsys)
    assert (code, err) == (0, "")
    result: dict[str, Any] = json.loads(out)
    return result


@pytest.fixture
def llama_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_8B))
    # 16 GB of bf16 weights, as the sharded checkpoint's index states it.
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 16_060_522_496}, "weight_map": {}})
    )
    return tmp_path


def test_llama_8b_on_an_80_gib_gpu(llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = run_json(
        [
            "--model",
            str(llama_dir),
            "--gpu-memory-gib",
            "80",
            "--prompt-p50",
            "1000",
            "--prompt-p95",
            "4000",
            "--output-p50",
            "300",
            "--output-p95",
            "2000",
        ],
        capsys,
    )
    s = plan["sizing"]
    assert s["kv_bytes_per_token"] == 128 * 1024
    # 80 x 0.9 - 14.96 (weights) - 2 (overhead) GiB of pool.
    assert s["pool_bytes_per_gpu"] == int(80 * 0.9 * 2**30 - 16_060_522_496 - 2 * 2**30)
    assert s["kv_tokens"] == s["pool_bytes_per_gpu"] // (128 * 1024) // 16 * 16
    assert s["concurrency_at_p95"] == s["kv_tokens"] // 6000
    assert plan["fp8_kv_cache"]["kv_tokens"] == pytest.approx(2 * s["kv_tokens"], abs=16)
    flags = plan["recommended_flags"]
    assert flags["--max-num-seqs"] == int(s["kv_tokens"] * 0.9 // 6000)
    assert flags["--max-model-len"] == 131072


def test_the_table_names_what_it_shows(llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        [
            "--model",
            str(llama_dir / "config.json"),
            "--kv-pool-gib",
            "50",
            "--prompt-p50",
            "1000",
            "--prompt-p95",
            "4000",
            "--output-p50",
            "500",
            "--output-p95",
            "2000",
        ],
        capsys,
    )
    assert code == 0
    assert "128.0 KiB" in out
    assert "409,600" in out
    assert "\nrequests per GPU at p95 (6,000)        68\n" in out
    assert "--max-num-seqs 61" in out


def test_what_if_on_the_testbed_overload(capsys: pytest.CaptureFixture[str]) -> None:
    plan = run_json(
        [
            "--what-if",
            "4,16,64",
            "--num-blocks",
            "16",
            "--block-size",
            "128",
            *OVERLOAD,
            "--requests",
            "64",
            "--concurrency",
            "64",
            "--identical-requests",
            "--tax-target",
            "0.1",
        ],
        capsys,
    )
    w = plan["what_if"]
    rows = {c["max_num_seqs"]: c for c in w["candidates"]}
    assert set(rows) == {4, 16, 64}
    assert rows[4]["tax"] < rows[64]["tax"]
    assert w["recommended_max_num_seqs"] == 4
    assert max(c["relative_throughput"] for c in rows.values()) == 1.0


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--model", "/nonexistent/model"], "--model: no config.json"),
        (["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype", "fp7"], "--dtype"),
        (
            [
                "--layers",
                "32",
                "--kv-heads",
                "8",
                "--head-dim",
                "128",
                "--kv-cache-dtype",
                "int3",
                "--kv-pool-gib",
                "4",
            ],
            "--kv-cache-dtype",
        ),
        (
            ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--gpu-memory-gib", "-80"],
            "--gpu-memory-gib",
        ),
        (
            ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--kv-pool-gib", "-1"],
            "--kv-pool-gib",
        ),
        (["--what-if", "4", "--from-metrics", "http://127.0.0.1:9/metrics"], "--from-metrics"),
        (["--what-if", "4", "--prometheus", "http://127.0.0.1:9"], "--prometheus"),
        (["--what-if", "four", "--num-blocks", "16", *OVERLOAD], "--what-if"),
        (["--what-if", "4", *OVERLOAD], "--num-blocks"),
        (["--what-if", "4", "--num-blocks", "16", "--prompt-p50", "41"], "--prompt-p95"),
    ],
)
def test_bad_input_is_one_line_naming_the_field(
    argv: list[str], field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(argv, capsys)
    assert code == 2
    assert out == ""
    assert err.startswith(f"kvtax plan: {field}")
    assert err.count("\n") == 1


def test_a_missing_config_file_in_a_directory_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(["--model", str(tmp_path)], capsys)
    assert code == 2
    assert err == f"kvtax plan: --model: no config.json at {tmp_path / 'config.json'}\n"


class _Pages(BaseHTTPRequestHandler):
    pages: ClassVar[dict[str, str]] = {}

    def do_GET(self) -> None:
        body = self.pages.get(self.path.split("?")[0])
        if body is None:
            self.send_error(404)
            return
        data = body.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    _Pages.pages = {"/vllm": (FIXTURES / "0.32-after-overload.prom").read_text()}
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Pages)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_what_if_reads_lengths_and_the_pool_from_vllms_metrics(
    server: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The capture after the real overload: 64 prompts of 41 tokens, 64 outputs of 500.
    plan = run_json(
        ["--what-if", "4,64", "--from-metrics", f"{server}/vllm", "--requests", "64"], capsys
    )
    p = plan["profile"]
    assert 20 < p["prompt_p50"] <= 50
    assert 200 < p["output_p50"] <= 500
    # The pool comes from vllm:cache_config_info: 16 blocks of 128.
    assert (plan["what_if"]["num_blocks"], plan["what_if"]["block_size"]) == (16, 128)


def test_a_page_that_is_not_metrics_is_named(
    server: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(
        ["--what-if", "4", "--num-blocks", "16", "--from-metrics", f"{server}/missing"], capsys
    )
    assert code == 2
    assert err.startswith("kvtax plan: --from-metrics: ")
    assert "HTTP 404" in err


def test_kvtax_pages_give_the_sum_so_the_prompt_comes_from_flags() -> None:
    page = (
        'kvtax_request_length_p50_tokens{model_name="m"} 541\n'
        'kvtax_request_length_p95_tokens{model_name="m"} 600\n'
    )
    p = profile_from_kvtax_page(page, "u", prompt_p50=41, prompt_p95=60, model="m")
    assert (p.output_p50, p.output_p95) == (500, 540)
    with pytest.raises(ValueError, match="--prompt-p50"):
        profile_from_kvtax_page(page, "u", prompt_p50=None, prompt_p95=None, model="m")


def _vector(rows: list[tuple[dict[str, str], float]]) -> str:
    result = [{"metric": m, "value": [0, str(v)]} for m, v in rows]
    return json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}})


class _Prometheus(BaseHTTPRequestHandler):
    queries: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        query = parse_qs(urlparse(self.path).query)["query"][0]
        self.queries.append(query)
        if "request_prompt_tokens_bucket" in query:
            body = _vector([({"le": "50.0"}, 90), ({"le": "100.0"}, 100), ({"le": "+Inf"}, 100)])
        elif "request_generation_tokens_bucket" in query:
            body = _vector([({"le": "500.0"}, 50), ({"le": "1000.0"}, 100), ({"le": "+Inf"}, 100)])
        else:
            body = _vector([({}, 12345.0)])
        data = body.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_lengths_from_prometheus_over_a_range(capsys: pytest.CaptureFixture[str]) -> None:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Prometheus)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        plan = run_json(
            [
                "--what-if",
                "4",
                "--num-blocks",
                "16",
                "--block-size",
                "128",
                "--requests",
                "50",
                "--prometheus",
                url,
                "--range",
                "6h",
                "--model-name",
                "m",
            ],
            capsys,
        )
    finally:
        httpd.shutdown()
        httpd.server_close()
    p = plan["profile"]
    # Prometheus' interpolation inside the buckets: 50 of 90 in (0, 50], 95 of 100 in (50, 100].
    assert p["prompt_p50"] == pytest.approx(50 * 50 / 90)
    assert p["prompt_p95"] == pytest.approx(75.0)
    assert p["output_p50"] == pytest.approx(500.0)
    assert p["output_p95"] == pytest.approx(950.0)
    assert any(
        'increase(vllm:request_prompt_tokens_bucket{model_name="m"}[6h])' in q
        for q in _Prometheus.queries
    )
