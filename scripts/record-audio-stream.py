#!/usr/bin/env python3
"""Record vLLM's speech-to-text streams as test fixtures, with vLLM's own stream generator.

The CPU build here serves no audio model, so no engine can answer /v1/audio/transcriptions. This
drives vLLM's own generator of those streams (``OpenAIServingTranscription.
transcription_stream_generator``, and the translation one) with engine outputs written here: the
words of a short sentence, one token each, and one token whose text is empty (vLLM counts it in
the usage and sends no chunk for it), as a Whisper-like model's detokenizer gives them. What it
writes is what vLLM writes to a client, byte for byte, for each of the usage options:

- ``apis/<version>-transcription.sse`` and ``-translation.sse``: with ``stream_include_usage``
  and ``stream_continuous_usage_stats``, what kvtax asks for;
- ``apis/<version>-transcription-plain.sse``: with neither, what a client asking for no usage
  gets from vLLM directly.

Run it with vLLM's Python (the testbed's venv), from the repository root::

    ~/.cache/kvtax/vllm-venv/bin/python scripts/record-audio-stream.py [--out tests/fixtures/vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import types
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import vllm
from vllm.entrypoints.generate.base.protocol import RequestResponseMetadata
from vllm.entrypoints.speech_to_text.transcription.protocol import TranscriptionRequest
from vllm.entrypoints.speech_to_text.transcription.serving import OpenAIServingTranscription
from vllm.entrypoints.speech_to_text.translation.protocol import TranslationRequest
from vllm.entrypoints.speech_to_text.translation.serving import OpenAIServingTranslation
from vllm.model_executor.models.interfaces import StreamingTranscriptionPostProcessor

ROOT = Path(__file__).resolve().parents[1]
# The sentence a model would transcribe, a token per entry; "" is a token with no text.
TOKENS = ["Hello", " there", "", ",", " this", " is", " a", " test", "."]
PROMPT_TOKENS = 4


async def _outputs() -> AsyncIterator[Any]:
    """Engine outputs as vLLM's AsyncLLM yields them for one stream (delta mode)."""
    for i, text in enumerate(TOKENS):
        last = i == len(TOKENS) - 1
        output = types.SimpleNamespace(
            text=text,
            token_ids=[1000 + i],
            finish_reason="stop" if last else None,
            stop_reason=None,
        )
        yield types.SimpleNamespace(
            prompt_token_ids=list(range(PROMPT_TOKENS)) if i == 0 else None, outputs=[output]
        )


def _serving(cls: type) -> Any:
    """The serving object, with what its stream generator reads and nothing of a model."""
    serving = cls.__new__(cls)
    serving.enable_force_include_usage = False
    serving.streaming_post_processor_cls = StreamingTranscriptionPostProcessor
    serving.model_cls = types.SimpleNamespace(get_num_audio_tokens=lambda *args: None)
    serving.asr_config = serving.model_config = None
    serving.task_type = "transcribe" if cls is OpenAIServingTranscription else "translate"
    return serving


async def _record(kind: str, usage: bool) -> bytes:
    request_cls = TranscriptionRequest if kind == "transcription" else TranslationRequest
    request = request_cls.model_construct(
        model="whisper",
        stream=True,
        stream_include_usage=usage,
        stream_continuous_usage_stats=usage,
    )
    if kind == "transcription":
        serving = _serving(OpenAIServingTranscription)
        generate = serving.transcription_stream_generator
    else:
        serving = _serving(OpenAIServingTranslation)
        generate = serving.translation_stream_generator
    stream = generate(
        request, [_outputs()], "trsc-1", RequestResponseMetadata(request_id="trsc-1"), 1.0, " "
    )
    return b"".join([chunk.encode() async for chunk in stream])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "vllm")
    args = parser.parse_args()
    prefix = ".".join(vllm.__version__.split(".")[:2])
    apis = args.out / "apis"
    apis.mkdir(parents=True, exist_ok=True)
    for name, kind, usage in (
        ("transcription", "transcription", True),
        ("translation", "translation", True),
        ("transcription-plain", "transcription", False),
    ):
        path = apis / f"{prefix}-{name}.sse"
        path.write_bytes(asyncio.run(_record(kind, usage)))
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
