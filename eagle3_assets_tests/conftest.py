from pathlib import Path

import pytest

from .tiny import make_tiny_llama, make_tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    """A tiny random Llama with a character tokenizer and chat template: a complete target folder."""
    d = make_tiny_llama(tmp_path_factory.mktemp("target"))
    make_tiny_tokenizer().save_pretrained(d)
    return d
