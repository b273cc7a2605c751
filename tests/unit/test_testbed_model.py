"""The test bed's model builder when several lanes ask for the model at once (a fresh machine).

The weights and tokenizer are replaced by stand-ins that write one file each: what is checked is
the builder's staging and locking, not transformers.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvtax_dev.testbed import model


def test_two_builders_at_once_both_get_the_whole_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Protection: one builder at a time. Without the lock the second builder removed the first
    # one's staging directory mid-build (seen on a fresh machine: "tiny-llama.partial" gone).
    entered = threading.Event()
    second_started = threading.Event()
    builds = 0

    def tokenizer(directory: Path) -> None:
        nonlocal builds
        builds += 1
        if not entered.is_set():
            entered.set()
            # Give the other builder every chance to start over this one's staging directory.
            second_started.wait(timeout=0.5)
        else:
            second_started.set()
        (directory / "tokenizer.json").write_text("{}")

    def weights(directory: Path, shape: model.ModelShape = model.TINY_SHAPE) -> None:
        (directory / "model.safetensors").write_text("w")

    monkeypatch.setattr(model, "_build_tokenizer", tokenizer)
    monkeypatch.setattr(model, "_build_weights", weights)
    target = tmp_path / "tiny"
    errors: list[BaseException] = []

    def build() -> None:
        try:
            model.make_tiny_model(target)
        except BaseException as exc:  # reported below, with the other builder's outcome
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    threads[0].start()
    assert entered.wait(timeout=10)
    threads[1].start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors, errors
    assert model.is_complete(target)
    assert (target / "tokenizer.json").exists() and (target / "model.safetensors").exists()
    assert builds == 1, "the second builder should have found the first one's model"
