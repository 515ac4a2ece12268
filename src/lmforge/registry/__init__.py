"""Model versions, aliases, eval-gated promotion and rollback (`store.py`), the feedback store
(`feedback.py`) and the data flywheel (`flywheel.py`). SQLite files; nothing here knows engines
or HTTP. `lmforge registry --help`, `lmforge flywheel --help`; docs/operations.md."""

from lmforge.registry.feedback import FeedbackStore
from lmforge.registry.store import ModelVersion, Registry, RegistryError

__all__ = ["FeedbackStore", "ModelVersion", "Registry", "RegistryError"]
