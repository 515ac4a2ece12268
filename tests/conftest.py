"""Fixtures shared by several test modules."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls gain nothing from threads, and on a busy 2-core box spinning OpenMP workers
    make them ~10x slower; restore the setting for the rest of the session."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory):
    """The tiny random Llama with a freshly trained tokenizer and chat template that the serving tests
    share: built once per session (training the tokenizer is most of its cost). Tests copy it before
    changing anything in it."""
    from lmforge.serve.testing import make_model_with_tokenizer

    d = tmp_path_factory.mktemp("chat-model")
    return make_model_with_tokenizer(d / "model", d / "tok")
