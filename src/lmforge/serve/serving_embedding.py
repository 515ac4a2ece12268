"""`POST /v1/embeddings` (vLLM's `OpenAIServingEmbedding`, OpenAI's shape): each input's embedding is the
served model's final normed hidden state at its last token, L2-normalized (vLLM's default pooling for a
decoder-only model used as an embedder: `PoolingType.LAST`, normalize), computed by the engine in the same
scheduled prefill as generation (`engine.PoolingParams`). `encoding_format` float or base64 (little-endian
float32, what the `openai` client asks for by default); `dimensions` is refused unless it is the model's
hidden size (a decoder's vector cannot be shortened meaningfully). Knows nothing about the engine's internals.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid

import numpy as np

from lmforge.engine import PoolingParams

from .engine_client import EngineRequest
from .errors import bad_request
from .guard import check_text
from .protocol import EmbeddingRequest
from .serving_engine import check_prompt, encode, engine_error, truncate
from .versions import Served


class OpenAIServingEmbedding:
    def __init__(self, st):
        self.st = st

    async def __call__(self, req: EmbeddingRequest) -> dict:
        if self.st.loras.lookup(req.model) is not None:  # 404 for a model that is not served
            raise bad_request("embeddings are served for the base model only, not a LoRA adapter", "model")
        sv = self.st.client.route(req.user)
        inputs = req.inputs()
        if not inputs:
            raise bad_request("input is an empty list", "input")
        for x in inputs:
            if isinstance(x, str):
                check_text(x, "input")
        ids = await asyncio.get_running_loop().run_in_executor(self.st.tokenize_pool, self._ids, sv, req, inputs)
        rid = f"embd-{uuid.uuid4().hex}"
        params = PoolingParams()  # the engine truncates again by the same rule: already done, nothing changes
        try:
            vectors = await asyncio.gather(*(self._embed(sv, EngineRequest(f"{rid}-{i}", x, params))
                                             for i, x in enumerate(ids)))
        except Exception as e:
            raise engine_error(e) from None
        if req.dimensions is not None and req.dimensions != len(vectors[0]):
            raise bad_request(f"dimensions={req.dimensions}: this model's embeddings have {len(vectors[0])} "
                              "dimensions and cannot be shortened", "dimensions")
        data = [{"object": "embedding", "index": i, "embedding": _encoded(v, req.encoding_format)}
                for i, v in enumerate(vectors)]
        tokens = sum(len(x) for x in ids)
        return {"id": rid, "object": "list", "created": int(time.time()), "model": self.st.served_model_name,
                "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    def _ids(self, sv: Served, req: EmbeddingRequest, inputs: list) -> list[list[int]]:
        out = []
        for x in inputs:
            if isinstance(x, str):
                if sv.tokenizer is None:
                    raise bad_request("this model has no tokenizer: send input as token ids", "input")
                x = encode(sv, x, "input")
            x = truncate(sv, list(x), req.truncate_prompt_tokens)
            check_prompt(sv, x, 1, "input")
            out.append(x)
        return out

    async def _embed(self, sv: Served, request: EngineRequest) -> list[float]:
        async for out in self.st.client.generate(sv, request):
            if out.finished:
                return out.embedding
        raise RuntimeError("the engine ended an embedding request without its vector")


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector
