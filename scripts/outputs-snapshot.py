#!/usr/bin/env python3
"""Write every output kvtax generates into one folder, so two checkouts can be compared byte for
byte (``diff -r``) around a change that must not alter them, such as a restructure.

    python scripts/outputs-snapshot.py OUT_DIR [--kvtax COMMAND] [--fixtures DIR]

It runs only the command line, never kvtax's modules, so the same script measures any revision
(run it from one checkout, and point ``--kvtax`` at another's interpreter and PYTHONPATH):

- ``kvtax rules`` and ``kvtax dashboards generate``, with the built-in settings and a config file;
- ``kvtax docs``;
- ``kvtax plan``: a matrix of models, GPUs, lengths and ``--what-if`` runs, table and ``--json``;
- kvtax's ``/metrics`` after a scripted run: kvtax scrapes a recorded vLLM page served on
  loopback and takes one push. Values that depend on time (rates over a window, ages,
  durations, process figures) are masked; every series name, label set, HELP and TYPE line and
  counter value is kept.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Model configs shaped like real ones (the numbers config.json gives), small enough to inline.
MODELS: dict[str, dict[str, object]] = {
    "llama-8b": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "torch_dtype": "bfloat16",
        "max_position_embeddings": 131072,
    },
    "mixtral": {
        "architectures": ["MixtralForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "vocab_size": 32000,
        "torch_dtype": "bfloat16",
        "max_position_embeddings": 32768,
    },
    "gemma-sliding": {
        "architectures": ["Gemma2ForCausalLM"],
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_attention_heads": 8,
        "num_hidden_layers": 26,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "sliding_window": 4096,
        "vocab_size": 256000,
        "torch_dtype": "bfloat16",
        "max_position_embeddings": 8192,
    },
}

PLAN_RUNS: list[list[str]] = [
    ["{llama-8b}"],
    ["{llama-8b}", "--gpu", "H100-80GB", "--prompt-p95", "4000", "--output-p95", "1000"],
    ["{llama-8b}", "--gpu", "L4", "--prompt-p95", "2000", "--output-p95", "500", "--json"],
    [
        "{mixtral}",
        "--gpu",
        "H100-80GB",
        "--tensor-parallel-size",
        "2",
        "--prompt-p95",
        "8000",
        "--output-p95",
        "500",
        "--kv-cache-dtype",
        "fp8",
    ],
    ["{gemma-sliding}", "--gpu", "A10G", "--prompt-p95", "3000", "--output-p95", "300"],
    [
        "--layers",
        "8",
        "--kv-heads",
        "4",
        "--head-dim",
        "64",
        "--kv-pool-gib",
        "0.05",
        "--prompt-p50",
        "41",
        "--prompt-p95",
        "41",
        "--output-p50",
        "500",
        "--output-p95",
        "500",
        "--what-if",
        "2,4,8,16",
        "--requests",
        "64",
        "--concurrency",
        "16",
        "--seed",
        "7",
    ],
    [
        "--layers",
        "8",
        "--kv-heads",
        "4",
        "--head-dim",
        "64",
        "--kv-pool-gib",
        "0.05",
        "--prompt-p95",
        "800",
        "--output-p95",
        "128",
        "--what-if",
        "2,3,4",
        "--requests",
        "32",
        "--rate",
        "4",
        "--seed",
        "3",
        "--json",
    ],
    ["{llama-8b}", "--gpu", "NOPE-GPU"],  # an error: its message and exit code are outputs too
    ["--prompt-p95", "4000"],
]

RULES_CONFIG = """\
cluster_label: cluster
runbook_url_base: https://runbooks.example/kvtax
release_label: monitoring
severity_overrides: {KvtaxPreemptionTaxHigh: critical}
"""

# Gauges whose value depends on when the page is read; their samples are masked.
TIMED = re.compile(
    r"^(process_|python_gc|kvtax_(scrapes_total|metrics_requests_total|event_loop_|last_)"
    r"|kvtax_\w*(_seconds|_ratio|_per_second|_tokens_per_second)[{ ])"
)


def run(cmd: list[str], out: Path, env: dict[str, str] | None = None) -> None:
    """Run one command; write its stdout, stderr and exit code beside each other."""
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    out.write_text(f"$ exit {done.returncode}\n--- stdout\n{done.stdout}--- stderr\n{done.stderr}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def serve_page(page: bytes) -> tuple[http.server.ThreadingHTTPServer, str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.startswith("/v1/models"):
                body = json.dumps(
                    {"object": "list", "data": [{"id": "tiny-llama", "root": "tiny-llama"}]}
                ).encode()
                kind = "application/json"
            else:
                body, kind = page, "text/plain; version=0.0.4"
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def masked(page: str) -> str:
    lines = []
    for line in page.splitlines():
        if line.startswith("#") or not TIMED.match(line):
            lines.append(line)
        else:
            lines.append(line.rsplit(" ", 1)[0] + " <timed>")
    return "\n".join(lines) + "\n"


def scripted_metrics(kvtax: list[str], fixtures: Path, out: Path) -> None:
    page = (fixtures / "vllm" / "0.32-after-overload.prom").read_bytes()
    server, url = serve_page(page)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [
        *kvtax,
        "serve",
        f"--vllm.url={url}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--scrape.interval=1s",
        "--push.token=snapshot",
        "--log.level=error",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        text = ""
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{base}/metrics", timeout=2) as r:
                    text = r.read().decode()
                if re.search(r"^kvtax_vllm_up(\{[^}]*\})? 1", text, re.M):
                    break
            except OSError as error:
                if proc.poll() is not None:
                    why = proc.stderr.read() if proc.stderr else ""
                    raise SystemExit(f"kvtax serve ended: {why}") from error
            time.sleep(0.2)
        push = json.dumps(
            {
                "model": "tiny-llama",
                "delivered_tokens": 120,
                "prompt_tokens": 40,
                "requests": {"completed": 2},
            }
        ).encode()
        request = urllib.request.Request(
            f"{base}/api/v1/delivered",
            data=push,
            method="POST",
            headers={"Authorization": "Bearer snapshot", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=5) as r:
            r.read()
        time.sleep(2.5)  # two scrapes after the push
        with urllib.request.urlopen(f"{base}/metrics", timeout=5) as r:
            out.write_text(masked(r.read().decode()))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        server.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="Folder to write into (created).")
    parser.add_argument(
        "--kvtax",
        default=f"{sys.executable} -c 'import sys; from kvtax.cli import main; sys.exit(main())'",
        help="How to run kvtax (default: this interpreter's kvtax.cli).",
    )
    parser.add_argument(
        "--fixtures",
        type=Path,
        default=ROOT / "tests" / "fixtures",
        help="The recorded vLLM pages (default: this checkout's tests/fixtures).",
    )
    args = parser.parse_args()
    kvtax = shlex.split(args.kvtax)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    models = out / "_models"
    for name, config in MODELS.items():
        (models / name).mkdir(parents=True, exist_ok=True)
        (models / name / "config.json").write_text(json.dumps(config))
    config = out / "_rules-config.yaml"
    config.write_text(RULES_CONFIG)
    env = {**os.environ, "COLUMNS": "100"}

    print("rules, dashboards, docs", file=sys.stderr)
    run([*kvtax, "rules", "--out", str(out / "rules")], out / "rules.log", env)
    run(
        [*kvtax, "rules", "--out", str(out / "rules-config"), "--config", str(config)],
        out / "rules-config.log",
        env,
    )
    run(
        [*kvtax, "dashboards", "generate", "--out", str(out / "dashboards")],
        out / "dashboards.log",
        env,
    )
    run(
        [
            *kvtax,
            "dashboards",
            "generate",
            "--out",
            str(out / "dashboards-config"),
            "--config",
            str(config),
        ],
        out / "dashboards-config.log",
        env,
    )
    run([*kvtax, "docs", "--out", str(out / "docs")], out / "docs.log", env)
    for n, argv in enumerate(PLAN_RUNS):
        print(f"plan {n + 1}/{len(PLAN_RUNS)}", file=sys.stderr)
        resolved = [str(models / a.strip("{}")) if a.startswith("{") else a for a in argv]
        run([*kvtax, "plan", *resolved], out / f"plan-{n:02d}.txt", env)
    print("/metrics of a scripted run", file=sys.stderr)
    scripted_metrics(kvtax, args.fixtures, out / "metrics.txt")
    # The model paths differ between two snapshot folders; they are not an output.
    for path in [*out.glob("plan-*.txt"), *out.glob("*.log")]:
        path.write_text(path.read_text().replace(str(models), "MODELS").replace(str(out), "OUT"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
