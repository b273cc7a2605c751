"""``kvtax plan`` against the real vLLM CPU engine of the session (no engine of its own).

The session engine runs with ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB) and then overrides the block
count down to 16; before overriding, vLLM logs the blocks that memory gives
("Overriding num_gpu_blocks=N"). ``kvtax plan`` on the same model directory and the same memory
must predict that N. On CPU the KV space is the pool itself: no weights or activations come
out of it, which is why ``--kv-pool-gib`` is the input here rather than ``--gpu-memory-gib``.
"""

from __future__ import annotations

import json
import re
import struct

import pytest

from kvtax.cli.main import main
from kvtax.tools.plan.weights import weight_bytes
from kvtax_dev.testbed import VllmEngine
from kvtax_dev.testbed.engine import BLOCK_SIZE_TOKENS

pytestmark = pytest.mark.e2e

KV_SPACE_GIB = 1  # VllmEngine's VLLM_CPU_KVCACHE_SPACE


def test_plan_predicts_the_blocks_vllm_sizes_from_the_same_memory(
    vllm_engine: VllmEngine, capsys: pytest.CaptureFixture[str]
) -> None:
    log = vllm_engine.log_path.read_text(errors="replace")
    found = re.search(r"Overriding num_gpu_blocks=(\d+) with num_gpu_blocks_override", log)
    assert found, "vLLM no longer logs the blocks it sized before the override"
    engine_blocks = int(found.group(1))

    code = main(
        [
            "plan",
            "--model",
            str(vllm_engine.model_dir),
            "--kv-pool-gib",
            str(KV_SPACE_GIB),
            "--block-size",
            str(BLOCK_SIZE_TOKENS),
            "--json",
        ]
    )
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    sizing = json.loads(out)["sizing"]
    # 2 layers x K and V x 2 KV heads x 64 x 2 bytes (bf16).
    assert sizing["kv_bytes_per_token"] == 1024
    assert sizing["num_blocks"] == engine_blocks
    assert sizing["kv_tokens"] == engine_blocks * BLOCK_SIZE_TOKENS


def test_weights_from_the_real_checkpoints_header(vllm_engine: VllmEngine) -> None:
    files = sorted(vllm_engine.model_dir.glob("*.safetensors"))
    assert files
    expected = 0
    for path in files:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
        expected += path.stat().st_size - 8 - length
    assert weight_bytes(vllm_engine.model_dir) == expected > 0
