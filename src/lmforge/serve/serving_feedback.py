"""`POST /v1/feedback`: a user's score for one completion (thumbs -1/+1 or 1-5 stars), an optional
comment and corrected answer, stored beside the exchange in the feedback store (PII masked by the
store). With `--log-requests` the exchange may still be queued for the writer process when the
feedback arrives: the handler waits for that id's write (`ExchangeLog.wait_written`), so feedback
on a completion that just finished finds it. An unknown id is a 404. The score feeds the
`/metrics` histogram and, through the `EngineClient`, the canary guard of the version that answered.
Knows nothing about engines.
"""

from __future__ import annotations

import asyncio

from .errors import OpenAIError
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
        if st.exchange_log is not None:  # the exchange may still be queued for the writer process
            await asyncio.to_thread(st.exchange_log.wait_written, fb.id)
        for text, field_name in ((fb.comment, "comment"), (fb.correction, "correction")):
            if text:
                check_text(text, field_name)
        known = await asyncio.to_thread(st.feedback.add_feedback, fb.id, fb.score, fb.comment, fb.correction)
        if not known:
            raise OpenAIError(404, f"no completion with id {fb.id!r} is known to this server", "id", "not_found")
        label = st.exchange_log.version_of(fb.id) if st.exchange_log else None
        low = fb.score < 0 or 1 <= fb.score <= 2
        st.metrics.observe_feedback(label or "unknown", fb.score, low)
        if label:
            st.client.score(label, low)
        return {"id": fb.id, "status": "recorded"}
