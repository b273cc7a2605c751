"""A real guidellm run against the real vLLM CPU engine through kvtax's proxy, recorded by kvtax.

Starts the testbed engine (16 KV blocks = 2,048 tokens, ``max_num_seqs`` 64) and ``kvtax serve``
with its proxy in front of it; starts ``kvtax annotate --record`` on the engine's /metrics; runs
guidellm 0.8.1 (its own venv, ``scripts/setup-guidellm.sh``) at rising concurrency against the
proxy, with 40-token prompts and fixed-length outputs (guidellm sends ``ignore_eos``), so that
two requests fit the pool with room to spare and four must preempt. Then it stops the recording and
writes, in ``--out``:

- ``guidellm-report.json.gz``: guidellm's own JSON report, as written;
- ``recording.jsonl.gz``: kvtax's recording of the engine's counters during the run;
- ``command.txt``: the exact guidellm and kvtax command lines;

and annotates the report with ``kvtax annotate`` into ``--results``.

guidellm's bundled transformers (5.24) cannot load the tiny model's tokenizer config (written by
5.19 as ``TokenizersBackend``): the run hands guidellm a copy of the tokenizer whose config
names ``PreTrainedTokenizerFast`` instead. The tokenizer itself is the same file.

Run from the repository root, under the end-to-end lock (about 4 minutes)::

    flock /tmp/kvtax-e2e.lock .venv/bin/python -m bench.tools.guidellm_run
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvtax_dev import dev_env, repo_root
from kvtax_dev.testbed import VllmEngine
from kvtax_dev.testbed.sidecar import KvtaxProcess


def guidellm_venv() -> Path:
    script = repo_root() / "scripts" / "setup-guidellm.sh"
    out = subprocess.run([str(script)], check=True, capture_output=True, text=True).stdout
    return Path(out.strip().splitlines()[-1])


def tokenizer_copy(model_dir: Path, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "config.json"):
        shutil.copy(model_dir / name, into / name)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config.pop("backend", None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (into / "tokenizer_config.json").write_text(json.dumps(config))
    return into


def guidellm_command(
    venv: Path,
    *,
    target: str,
    model: str,
    tokenizer: Path,
    streams: str,
    seconds: float,
    prompt: int,
    output: int,
    report: Path,
) -> list[str]:
    return [
        str(venv / "bin" / "guidellm"),
        "run",
        "--backend",
        f"kind=openai_http,target={target},model={model},request_format=/v1/completions",
        "--tokenizer",
        f"kind=hf_auto,model={tokenizer}",
        "--profile",
        "kind=concurrent",
        "--override",
        "profile.streams",
        streams,
        "--data",
        f"kind=synthetic_text,prompt_tokens={prompt},output_tokens={output}",
        "--constraint",
        f"kind=max_duration,seconds={seconds:g}",
        "--output",
        f"kind=json,path={report}",
        "--disable-console-interactive",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures/guidellm"))
    parser.add_argument("--results", type=Path, default=Path("bench/results/guidellm"))
    parser.add_argument("--streams", default="1,2,4,6")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--output-tokens", type=int, default=500)
    args = parser.parse_args(argv)
    venv = guidellm_venv()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvtax-guidellm-"))
    raw_report = work / "guidellm-report.json"
    recording = args.out / "recording.jsonl.gz"
    with (
        VllmEngine(log_path=work / "engine.log") as engine,
        KvtaxProcess(engine.url, proxy=True, log_path=work / "kvtax.log") as kvtax,
    ):
        assert kvtax.proxy_url is not None
        tokenizer = tokenizer_copy(engine.model_dir, work / "tokenizer")
        record_cmd = [
            sys.executable,
            "-m",
            "kvtax.cli.main",
            "annotate",
            "--record",
            str(recording),
            "--metrics-url",
            f"{engine.url}/metrics",
            "--interval",
            "0.5",
        ]
        run_cmd = guidellm_command(
            venv,
            target=kvtax.proxy_url,
            model=engine.model_name,
            tokenizer=tokenizer,
            streams=args.streams,
            seconds=args.seconds,
            prompt=args.prompt_tokens,
            output=args.output_tokens,
            report=raw_report,
        )
        recorder = subprocess.Popen(record_cmd, env=dev_env(os.environ), stderr=subprocess.DEVNULL)
        try:
            time.sleep(1.5)
            print("running:", shlex.join(run_cmd), file=sys.stderr, flush=True)
            with (work / "guidellm.log").open("w") as log:
                subprocess.run(run_cmd, check=True, cwd=work, stdout=log, stderr=subprocess.STDOUT)
            time.sleep(1.5)
        finally:
            recorder.send_signal(signal.SIGINT)
            recorder.wait(timeout=30)
    report = args.out / "guidellm-report.json.gz"
    report.write_bytes(gzip.compress(raw_report.read_bytes(), mtime=0))
    (args.out / "command.txt").write_text(
        "# kvtax recording (engine /metrics, while guidellm ran):\n"
        + shlex.join(record_cmd)
        + "\n# guidellm 0.8.1, through kvtax's proxy:\n"
        + shlex.join(run_cmd)
        + "\n"
    )
    annotate = [
        sys.executable,
        "-m",
        "kvtax.cli.main",
        "annotate",
        str(report),
        "--recording",
        str(recording),
        "--out",
        str(args.results),
    ]
    subprocess.run(annotate, check=True, env=dev_env(os.environ))
    print(f"wrote {report}, {recording}, {args.results}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
