"""vLLM's tokenizer endpoints: `POST /tokenize` (a prompt, or chat messages rendered exactly as
`/v1/chat/completions` renders them: its template options, its spoof-proof encoding), `POST /detokenize`,
and `GET /tokenizer_info` (what lm-eval's `tokenizer_backend=remote` reads: the special tokens and the chat
template). Answers with the routed version's tokenizer; runs on the tokenize worker, never the event loop.
Knows nothing about the engine beyond `Served`.
"""

from __future__ import annotations

import asyncio

from pydantic import ValidationError

from .errors import bad_request
from .guard import check_text
from .protocol import DetokenizeRequest, TokenizeRequest
from .serving_engine import encode
from .versions import Served


class OpenAIServingTokenization:
    def __init__(self, st, chat):
        self.st, self.chat = st, chat  # chat: the OpenAIServingChat whose rendering /tokenize shares

    def _served(self, model: str | None) -> Served:
        self.st.loras.lookup(model)  # 404 for a model that is not served
        sv = self.st.client.route(None)
        if sv.tokenizer is None:
            raise bad_request("this model has no tokenizer files", "model", "unsupported")
        return sv

    async def tokenize(self, req: TokenizeRequest) -> dict:
        sv = self._served(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("send exactly one of `prompt` and `messages`", "prompt" if req.prompt else "messages")
        chat = None
        if req.prompt is not None:
            check_text(req.prompt, "prompt")
        else:  # the chat endpoint's own checks, in its order
            try:
                chat = req.chat_request()
            except ValidationError as e:
                raise bad_request(f"messages: {e.errors()[0]['msg']}", "messages") from None
            refused = chat.unsupported()
            if refused is not None:
                raise bad_request(f"{refused[0]}: {refused[1]}", refused[0], "unsupported_parameter")
            self.chat.precheck(sv, chat)
        ids = await asyncio.get_running_loop().run_in_executor(self.st.tokenize_pool, self._ids, sv, req, chat)
        out = {"count": len(ids), "max_model_len": sv.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = sv.tokenizer.convert_ids_to_tokens(ids)
        return out

    def _ids(self, sv: Served, req: TokenizeRequest, chat) -> list[int]:
        if chat is None:
            return encode(sv, req.prompt, "prompt", add_special_tokens=req.add_special_tokens is not False)
        ids = self.chat.build_job(sv, chat).prompts[0]
        if req.add_special_tokens and sv.tokenizer.bos_token_id is not None and ids[:1] != [sv.tokenizer.bos_token_id]:
            ids = [sv.tokenizer.bos_token_id] + ids
        return ids

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        sv = self._served(req.model)
        bad = [t for t in req.tokens if t >= sv.vocab_size]
        if bad:
            raise bad_request(f"token ids must be in [0, {sv.vocab_size}): got {bad[:5]}", "tokens")
        text = await asyncio.get_running_loop().run_in_executor(self.st.tokenize_pool, sv.tokenizer.decode, req.tokens)
        return {"prompt": text}

    def tokenizer_info(self) -> dict:
        sv = self._served(None)
        tok = sv.tokenizer
        return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": tok.pad_token, "unk_token": tok.unk_token,
                "chat_template": self.st.chat_template or getattr(tok, "chat_template", None),
                "model_max_length": sv.max_model_len}
