"""Builds the tiny random-weight Llama that the testbed engine serves.

There is no model hub on the machines this runs on, so the model is made locally: a
2-layer Llama with random weights and a byte-level BPE tokenizer trained on a short
built-in text. Its output is gibberish, but vLLM's scheduling, KV accounting, preemption
and metrics are all real, which is all the testbed needs.

This module runs only inside the vLLM virtual environment: transformers, tokenizers and
torch are imported inside :func:`make_tiny_model`, so merely importing it (for example
from the sidecar's own venv, which has none of them) costs nothing.

Usage: ``python -m kvtax_dev.testbed.model DIR`` prints DIR once the model is complete.
"""

from __future__ import annotations

import fcntl
import importlib
import json
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

# Bump when anything below changes what is written, so cached copies are rebuilt.
RECIPE_VERSION = "1"
MARKER_NAME = ".kvtax-tiny-model"

SEED = 0
VOCAB_SIZE = 512
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"


@dataclass(frozen=True)
class ModelShape:
    """The Llama's size and stored dtype. The defaults are the tiny testbed model; other
    shapes (kvtax_dev.testbed.prefill_model) are recorded in the build marker."""

    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    # The CPU attention kernels reject head_dim 16; 64 is supported.
    head_dim: int = 64
    dtype: str = "bfloat16"


TINY_SHAPE = ModelShape()

# A plain, line-per-turn template: the model is random, so the format only has to be
# well formed for vLLM's chat endpoint, not meaningful.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Training text for the tokenizer. Any English-ish prose will do; it only has to give the
# BPE trainer enough pairs to fill the vocabulary so prompts tokenize to a stable length.
_CORPUS = """\
The scheduler admits requests while the key value cache has free blocks. When a running
request needs a new block and none is free, the scheduler preempts the most recent request:
its blocks are freed and it goes back to the waiting queue. When it is resumed, the engine
computes the prompt and every token generated so far again. That work is the recompute tax.
A small cache and many long generations make the tax large; a large cache makes it vanish.
Operators watch the cache usage, the number of running and waiting requests, the time to
first token, the inter token latency and the end to end latency of each request. They count
tokens that were generated, tokens that were computed twice, and requests that finished.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.
One two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen.
Monday Tuesday Wednesday Thursday Friday Saturday Sunday January February March April May.
Please write a long story about a lighthouse keeper who counts the ships that pass at night,
the storms that come in from the sea, and the letters that never arrive at the island.
"""


def _build_tokenizer(directory: Path) -> None:
    """Train a byte-level BPE on the built-in corpus and save it as a fast HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS_TOKEN, EOS_TOKEN, PAD_TOKEN],
        # The full byte alphabet keeps every possible input encodable, however the
        # corpus is chosen; that is what makes the tokenizer "byte-level".
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeating the corpus does not change the merges, it only makes pair counts larger
    # than ties would be among the rarer pairs; the trainer is deterministic either way.
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    # Prepend BOS on encode, as Llama tokenizers do, so /v1/completions prompts get one.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(directory))


def _build_weights(directory: Path, shape: ModelShape = TINY_SHAPE) -> None:
    """Save a random-weight Llama whose shapes the vLLM CPU attention kernels accept."""
    # Imported by name: torch has no stubs and lives only in the engine venv.
    torch = importlib.import_module("torch")
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(directory))
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype=shape.dtype,
    )
    model = LlamaForCausalLM(config).to(getattr(torch, shape.dtype))
    model.save_pretrained(str(directory), safe_serialization=True)


def _marker(shape: ModelShape) -> dict[str, object]:
    data: dict[str, object] = {"recipe": RECIPE_VERSION, "seed": SEED}
    if shape != TINY_SHAPE:
        data["shape"] = asdict(shape)
    return data


def is_complete(directory: Path, shape: ModelShape | None = None) -> bool:
    """True when ``directory`` holds a complete build of the current recipe (and, when
    ``shape`` is given, of that shape)."""
    marker = directory / MARKER_NAME
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    if not (isinstance(data, dict) and data.get("recipe") == RECIPE_VERSION):
        return False
    return shape is None or data.get("shape") == _marker(shape).get("shape")


def make_tiny_model(directory: Path, shape: ModelShape = TINY_SHAPE) -> Path:
    """Write the tiny Llama (weights, config, tokenizer) into ``directory``; return it.

    Idempotent: a marker file written last records a complete build, so a directory left
    half-written by an interrupted run is rebuilt rather than trusted.
    """
    directory = Path(directory).expanduser().resolve()
    if is_complete(directory, shape):
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time: the suite's lanes start engines at once on a fresh machine, and
    # two builders sharing the staging directory removed each other's half-written model.
    with (directory.parent / (directory.name + ".lock")).open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_complete(directory, shape):  # built by the one we waited for
            return directory
        # Build beside the target and rename at the end, so a concurrent reader never sees a
        # directory that has a tokenizer but no weights.
        staging = directory.with_name(directory.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        _build_tokenizer(staging)
        _build_weights(staging, shape)
        (staging / MARKER_NAME).write_text(json.dumps(_marker(shape)) + "\n")
        shutil.rmtree(directory, ignore_errors=True)
        staging.rename(directory)
    return directory


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: ``python -m kvtax_dev.testbed.model DIR``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m kvtax_dev.testbed.model DIR", file=sys.stderr)
        return 2
    print(make_tiny_model(Path(args[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
