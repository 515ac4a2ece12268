"""`POST /admin/reload`: re-read the registry's aliases and swap the versions served, through the
`EngineClient` (new engine up, then the switch, then the old one drained: in-flight requests finish
on the version they started on, so none fails). Needs the server to run with `--admin-api-key` (the
guard has checked that key, its own and not the inference `--api-key`, and the admin rate; without
one there is no admin at all: 403) and `--registry` (404 otherwise). Knows nothing about the registry's schema: `reloader()` says what should be served.
"""

from __future__ import annotations

import asyncio

from .errors import OpenAIError


class ServingAdmin:
    def __init__(self, st):
        self.st = st  # app.ServerState: api key, reloader, client

    async def reload(self) -> dict:
        st = self.st
        if st.reloader is None:
            raise OpenAIError(404, "this server serves one model folder; reload needs --registry", None, "not_found")
        if not st.client.ready:
            raise OpenAIError(503, st.client.not_ready_reason(), None, "engine_not_ready")
        wanted = await asyncio.to_thread(st.reloader)
        if "champion" not in wanted:
            raise OpenAIError(409, "the registry names no champion for this model; promote a version first",
                              None, "no_champion")
        done = await st.client.reload(wanted)
        return {"changed": done.changed, "models": done.models, "canary_percent": done.canary_percent}
