"""The serving tests' fixtures: the transformers-written tiny checkpoint with its tokenizer, exported once with a
static cache (tests/artifacts.py), and its greedy generations alone in this process."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def artifact():
    pytest.importorskip("transformers")
    from artifacts import text_artifact

    return text_artifact("static")


@pytest.fixture(scope="module")
def alone(artifact):
    """``alone(ids, new, stop)``: the text, finish reason and token count of one greedy generation alone."""
    pytest.importorskip("openai")
    from serving import solo

    return solo(artifact)
