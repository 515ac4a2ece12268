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
