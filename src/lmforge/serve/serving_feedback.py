"""`POST /v1/feedback`: a user's score for one completion (thumbs -1/+1 or 1-5 stars), an optional
comment and corrected answer, stored beside the exchange in the feedback store (PII masked by the
store). With `--log-requests` the exchange may still be queued for the writer process when the
feedback arrives: the handler waits for that id's write (`ExchangeLog.wait_written`), so feedback
on a completion that just finished finds it.

The score is read by the store's one scale rule (`lmforge.registry.feedback.normalize_score`,
`is_low`) before anything is stored: a score outside it (0, 0.5, 2.5) is a 400 naming `score`, and
the `/metrics` histogram and the canary guard of the version that answered classify it exactly as
the store and the flywheel do (a thumbs-up is never low). An unknown id is a 404; an exchange that
already has `MAX_FEEDBACK_PER_EXCHANGE` rows is a 409 (its latest score counts; re-scoring it in a
loop changes nothing). The guard is given the exchange's id, so it counts each exchange's latest
score once, as the store's `stats()` does. Knows nothing about engines.
"""

from __future__ import annotations

import asyncio

from lmforge.registry import RegistryError
from lmforge.registry.feedback import FeedbackLimitError, is_low, normalize_score

from .errors import OpenAIError, bad_request
from .guard import check_text
from .protocol import FeedbackRequest


class ServingFeedback:
    def __init__(self, st):
        self.st = st  # app.ServerState: feedback store, exchange log, metrics, client

    async def __call__(self, fb: FeedbackRequest) -> dict:
        st = self.st
        if st.feedback is None:
            raise OpenAIError(404, "feedback is not enabled on this server (start it with --log-requests)", None,
                              "not_found")
        try:
            _, _, normalized = normalize_score(fb.score)
        except RegistryError as e:
            raise bad_request(str(e), "score") from None
        if st.exchange_log is not None:  # the exchange may still be queued for the writer process
            await asyncio.to_thread(st.exchange_log.wait_written, fb.id)
        for text, field_name in ((fb.comment, "comment"), (fb.correction, "correction")):
            if text:
                check_text(text, field_name)
        try:
            known = await asyncio.to_thread(st.feedback.add_feedback, fb.id, fb.score, fb.comment, fb.correction)
        except FeedbackLimitError as e:
            raise OpenAIError(409, str(e), "id", "feedback_limit") from None
        if not known:
            raise OpenAIError(404, f"no completion with id {fb.id!r} is known to this server", "id", "not_found")
        label = st.exchange_log.version_of(fb.id) if st.exchange_log else None
        low = is_low(normalized)
        st.metrics.observe_feedback(label or "unknown", fb.score, low, fb.id)
        if label:
            st.client.score(label, low, fb.id)  # the guard keeps each exchange's latest score once
        return {"id": fb.id, "status": "recorded"}
