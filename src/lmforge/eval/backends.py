"""What a task asks of a model, and the models that answer: the real one and test mocks.

A backend answers three questions, all in text, so tasks never see token ids:

    loglikelihood([(context, continuation), ...]) -> [sum log p(continuation | context), ...]
    rolling_nll([text, ...])                      -> [(NLL in nats of the whole text, tokens), ...]
    generate([prompt, ...], max_tokens=, stop=, temperature=, n=, seed=, chat=) -> [[n texts], ...]

With `chat=True` a prompt is the user turn of a conversation, rendered with the model's chat
template and the generation prompt (no `<|begin_of_text|>`: SFT trains on the template alone);
a model without a template gets the plain prompt.

`TransformerBackend` scores log-likelihoods with `lmforge.model.Transformer` (batched, one
forward per batch) and generates with the engine (`lmforge.engine.LLM`) when it is installed,
else with a slow reference loop (full forward per token, no KV cache). Every text starts with
`<|begin_of_text|>`, so the first token of a document is predicted too. `MockBackend` answers
from the suites' own answer key (always right, or always wrong) for tests.

This module knows nothing about suites' files or metrics.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import math
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

from lmforge.tasks.reasoning import DEFAULT_FORMAT
from lmforge.track.io import sha256_file

MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")


class Backend(Protocol):
    def loglikelihood(self, requests: list[tuple[str, str]]) -> list[float]: ...

    def rolling_nll(self, texts: list[str]) -> list[tuple[float, int]]: ...

    def generate(self, prompts: list[str], *, max_tokens: int, stop: list[str], temperature: float = 0.0,
                 n: int = 1, seed: int | None = None, chat: bool = False) -> list[list[str]]: ...

    def info(self) -> dict[str, Any]: ...


def model_hash(model_dir: str | Path) -> str:
    """sha256 over the files that decide the model's outputs (config, weights, tokenizer), by name."""
    root = Path(model_dir)
    files = sorted({*(root / f for f in MODEL_FILES if (root / f).is_file()), *root.glob("*.safetensors")})
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + sha256_file(f).encode())
    return h.hexdigest()


def truncate_at_stop(text: str, stop: Iterable[str]) -> tuple[str, bool]:
    """Cut `text` before the earliest stop string (vLLM's default: the stop string is not kept)."""
    cut = min((i for s in stop if (i := text.find(s)) >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def _check_executor(executor: str, replicas: int, engine: str) -> None:
    if executor not in ("local", "ray"):
        raise ValueError(f"--executor {executor!r}: choose local or ray")
    if replicas < 1 or (replicas > 1 and executor != "ray"):
        raise ValueError(f"--replicas {replicas}: at least 1, and more than 1 needs --executor ray")
    if executor == "ray" and engine != "llm":
        raise ValueError("--executor ray generates with the engine: use --engine llm (or auto)")


def a8_model(model_dir: str | Path, dtype: str = "float32") -> Any:
    """The model on CPU with every quantized linear on the int8-activation kernel (the engine's
    `quant_activations="int8"`), for log-likelihoods and NLLs; a ValueError when it cannot run here."""
    import torch  # deferred: as in TransformerBackend

    from lmforge.engine import kernels
    from lmforge.engine.model_runner import linear_backend
    from lmforge.quant import load_pretrained
    from lmforge.quant.linear import swap_backend

    model = load_pretrained(model_dir, dtype=dtype, device="cpu")
    backend = linear_backend(model, torch.device("cpu"), False, kernels.load(), quant_activations="int8")
    swap_backend(model, backend, next(p.dtype for p in model.parameters() if p.is_floating_point()))
    return model


@contextlib.contextmanager
def _count_finished(engine: Any, n: int, advance: Callable[[int], None], every_s: float = 0.5) -> Iterator[None]:
    """While `n` requests run on `engine` (an `LLMEngine` that held none before), advance by those that
    finished, every `every_s` from a watcher thread: the engine's own loop is left as it is (its
    `requests` holds the unfinished ones; reading its length from another thread is safe)."""
    stop, reported = threading.Event(), [0]

    def report() -> None:
        done = n - len(engine.requests)
        if done > reported[0]:
            advance(done - reported[0])
            reported[0] = done

    def watch() -> None:
        while not stop.wait(every_s):
            report()

    thread = threading.Thread(target=watch, name="eval-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
    advance(n - reported[0])  # the call returned: every request finished


class TransformerBackend:
    """A model folder in HF layout (weights + tokenizer) on CPU or GPU."""

    def __init__(self, model_dir: str | Path, dtype: str = "auto", device: str = "auto", batch_size: int = 16,
                 engine: str = "auto", executor: str = "local", replicas: int = 1, ray_address: str | None = None,
                 quant_activations: str = "none"):
        # deferred: torch and lmforge.model load only when a backend is built (importing lmforge.eval is cheap)
        import torch

        from lmforge.model import resolve_device
        from lmforge.model.checkpoint import dtype_name, read_hf_config, resolve_dtype
        from lmforge.tokenizer import STOP_TOKENS, load_tokenizer

        if engine not in ("auto", "llm", "simple"):
            raise ValueError(f"engine must be auto, llm or simple, got {engine!r}")
        if engine == "auto":
            engine = "llm" if importlib.util.find_spec("lmforge.engine.llm") else "simple"
        _check_executor(executor, replicas, engine)
        if quant_activations not in ("none", "int8"):
            raise ValueError(f"quant_activations must be none or int8, got {quant_activations!r}")
        if quant_activations == "int8" and (engine != "llm" or executor != "local"):
            raise ValueError("quant_activations=int8 runs on lmforge's engine in this process: use --engine llm "
                             "and --executor local")
        self.quant_activations = quant_activations
        self.executor, self.replicas, self.ray_address = executor, replicas, ray_address
        self.model_dir, self.dtype, self.batch_size, self.engine = Path(model_dir), dtype, batch_size, engine
        self.device = resolve_device(device)
        self._model = None  # loaded on first log-likelihood: generation through the engine loads its own
        self.tok = load_tokenizer(model_dir)
        self.bos = self.tok.bos_token_id
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        self.stop_ids = {i for t in STOP_TOKENS if (i := self.tok.convert_tokens_to_ids(t)) is not None}
        cfg = read_hf_config(model_dir)
        self.max_len = int(cfg.get("max_position_embeddings", 2048))
        self.resolved_dtype = dtype_name(resolve_dtype(dtype, cfg.get("torch_dtype") or cfg.get("dtype")))
        self._llm = None
        self._torch = torch
        self.progress: Any = None  # a `track.progress.Progress` the scoring loops advance (`lmforge eval`'s)

    def _expect(self, n: int) -> None:
        """A call of `n` requests begins: the progress total grows by them."""
        if self.progress is not None:
            self.progress.total = (self.progress.total or 0) + n

    def _advance(self, n: int) -> None:
        if self.progress is not None:
            self.progress.advance(n)

    @property
    def model(self) -> Any:
        if self._model is None:
            from lmforge.quant import load_pretrained  # deferred: loads torch (see __init__)

            if self.quant_activations == "int8":
                self._model = a8_model(self.model_dir, self.dtype).eval()
            else:
                self._model = load_pretrained(self.model_dir, dtype=self.dtype, device=self.device).eval()
        return self._model

    def info(self) -> dict[str, Any]:
        gen = ("lmforge.engine.LLM" if self.engine == "llm"
               else "reference loop (full forward per token, no KV cache)")
        if self.executor == "ray":
            gen = f"lmforge.engine.batch on Ray ({self.replicas} replicas)"
        return {"backend": "transformer", "generation": gen, "dtype": self.resolved_dtype,
                **({"quant_activations": "int8"} if self.quant_activations == "int8" else {}),
                "device": str(self.device), "batch_size": self.batch_size, "max_len": self.max_len,
                "bos": self.bos is not None}

    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def _prefix(self) -> list[int]:
        return [self.bos] if self.bos is not None else []

    # ---- log-likelihoods --------------------------------------------------------------------------

    def _pair_ids(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """lm-eval's split: trailing spaces of the context move to the continuation, the pair is
        encoded as one string, and the continuation is what follows the context's own tokens."""
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        ctx, whole = self._encode(context), self._encode(context + continuation)
        cont = whole[len(ctx):] if whole[:len(ctx)] == ctx else self._encode(continuation)
        return self._prefix() + ctx, cont

    def _score(self, rows: list[tuple[list[int], int]]) -> list[float]:
        """Sum of log p over the last `n_scored` tokens of each row (each row at most max_len + 1 tokens)."""
        torch = self._torch
        out: list[float] = [0.0] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        self._expect(len(rows))
        for b in range(0, len(order), self.batch_size):
            idx = order[b:b + self.batch_size]
            T = max(len(rows[i][0]) for i in idx) - 1
            inp_BT = torch.full((len(idx), T), self.pad, dtype=torch.long)
            for r, i in enumerate(idx):
                ids = rows[i][0][:-1]
                inp_BT[r, :len(ids)] = torch.tensor(ids)  # right padding: causal rows never see it
            with torch.inference_mode():
                logits_BTV = self.model(inp_BT.to(self.device))
            for r, i in enumerate(idx):
                ids, n_scored = rows[i]
                end = len(ids) - 1
                logp_SV = torch.log_softmax(logits_BTV[r, end - n_scored:end].float(), dim=-1)  # (S, V)
                target_S = torch.tensor(ids[end - n_scored + 1:], device=logp_SV.device)
                out[i] = logp_SV.gather(1, target_S[:, None]).sum().item()
            self._advance(len(idx))
        return out

    def loglikelihood(self, requests: list[tuple[str, str]]) -> list[float]:
        rows = []
        for context, continuation in requests:
            ctx, cont = self._pair_ids(context, continuation)
            rows.append(((ctx + cont)[-(self.max_len + 1):], len(cont)))
        return self._score(rows)

    def rolling_nll(self, texts: list[str]) -> list[tuple[float, int]]:
        """Every token of each text scored once, in windows of at most max_len input tokens: the
        first window predicts up to max_len tokens, each later one max_len // 2 new tokens with the
        tokens before them as context (HF's strided perplexity). Without a BOS token the first
        token of a text is context only."""
        L, stride = self.max_len, max(1, self.max_len // 2)
        rows, owner = [], []
        for d, text in enumerate(texts):
            ids = self._prefix() + self._encode(text)
            pos, N = 1, len(ids)  # ids[pos] is the next token to score
            while pos < N:
                end = min(N, pos + (L if pos == 1 else stride))
                rows.append((ids[max(0, end - L - 1):end], end - pos))
                owner.append(d)
                pos = end
        scores = self._score(rows)
        totals = [[0.0, 0] for _ in texts]
        for d, s, (_, n) in zip(owner, scores, rows):
            totals[d][0] -= s
            totals[d][1] += n
        return [(nll, n) for nll, n in totals]

    # ---- generation -------------------------------------------------------------------------------

    def prompt_ids(self, prompt: str, chat: bool = False) -> list[int]:
        """BOS + the prompt, or (chat, with a template) the rendered user turn + generation prompt."""
        if chat and getattr(self.tok, "chat_template", None):
            text = self.tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                add_generation_prompt=True)
            return self._encode(text)
        return self._prefix() + self._encode(prompt)

    def generate(self, prompts: list[str], *, max_tokens: int, stop: list[str], temperature: float = 0.0,
                 n: int = 1, seed: int | None = None, chat: bool = False) -> list[list[str]]:
        ids = [self.prompt_ids(p, chat) for p in prompts]
        self._expect(len(ids))
        if self.engine == "llm":
            return self._generate_llm(ids, max_tokens, stop, temperature, n, seed)
        outs = []
        for i, p in enumerate(ids):
            outs.append(self._generate_one(p, max_tokens, stop, temperature, n, None if seed is None else seed + i))
            self._advance(1)
        return outs

    def _generate_llm(self, ids: list[list[int]], max_tokens: int, stop: list[str], temperature: float,
                      n: int, seed: int | None) -> list[list[str]]:
        from lmforge.engine import LLM, SamplingParams  # deferred: the engine loads torch

        if self._llm is None and self.executor == "local":
            self._llm = LLM(str(self.model_dir), dtype=self.dtype, device=str(self.device),
                            quant_activations=self.quant_activations)
        max_tokens = min(max_tokens, self.max_len - max(len(i) for i in ids))  # long outputs: cut to the context
        params = [dict(temperature=temperature, max_tokens=max_tokens, stop=list(stop), n=n,
                       seed=None if seed is None else seed + i) for i in range(len(ids))]
        if self.executor == "ray":
            outs = self._generate_ray(ids, params)
            self._advance(len(ids))
            return outs
        with _count_finished(self._llm.llm_engine, len(ids), self._advance):
            outputs = self._llm.generate(ids, [SamplingParams(**p) for p in params], use_tqdm=False)
        return [[c.text for c in o.outputs] for o in outputs]

    def _generate_ray(self, ids: list[list[int]], params: list[dict[str, Any]]) -> list[list[str]]:
        """The same requests through `lmforge generate`'s Ray path (`replicas` engines on Ray actors, input
        order kept, greedy outputs those of one process), by way of a temporary prompt file."""
        from lmforge.engine.batch import generate_file  # deferred: the engine loads torch

        with tempfile.TemporaryDirectory() as tmp:
            src, dst = Path(tmp) / "prompts.jsonl", Path(tmp) / "out.jsonl"
            src.write_text("".join(json.dumps({"custom_id": str(i), "prompt": p, **kw}) + "\n"
                                   for i, (p, kw) in enumerate(zip(ids, params))))
            generate_file(self.model_dir, src, dst, executor="ray", replicas=self.replicas,
                          ray_address=self.ray_address, engine_kwargs={"dtype": self.dtype, "device": str(self.device)})
            records = [json.loads(line) for line in dst.read_text().splitlines()]
        return [[c["text"] for c in r["choices"]] for r in records]

    def _generate_one(self, prompt_ids: list[int], max_tokens: int, stop: list[str], temperature: float,
                      n: int, seed: int | None) -> list[str]:
        torch = self._torch
        gen = torch.Generator(device=self.device)
        gen.manual_seed(0 if seed is None else seed)
        texts = []
        for _ in range(n):
            ids = list(prompt_ids)[-self.max_len:]
            new: list[int] = []
            for _ in range(max_tokens):
                with torch.inference_mode():
                    logits_V = self.model(torch.tensor([ids[-self.max_len:]], device=self.device))[0, -1].float()
                if temperature == 0:
                    nxt = int(logits_V.argmax())
                else:
                    probs_V = torch.softmax(logits_V / temperature, dim=-1)
                    nxt = int(torch.multinomial(probs_V, 1, generator=gen))
                if nxt in self.stop_ids:
                    break
                ids.append(nxt)
                new.append(nxt)
                text, stopped = truncate_at_stop(self.tok.decode(new, skip_special_tokens=True), stop)
                if stopped:
                    break
            texts.append(truncate_at_stop(self.tok.decode(new, skip_special_tokens=True), stop)[0])
        return texts


class MockBackend:
    """Answers from the suites' answer key: always right (`correct=True`) or always wrong.

    Perplexity: every byte costs exactly one bit (bits_per_byte == 1.0), one token per byte."""

    def __init__(self, suites: list, correct: bool = True):
        self.correct = correct
        self.answers = {it["prompt"]: it["answer"] for s in suites if s.kind in ("generate", "stability")
                        for it in s.items}
        self.right = {(it["prompt"], s.settings["target_delimiter"] + it["choices"][it["answer"]])
                      for s in suites if s.kind == "choice" for it in s.items}

    def info(self) -> dict[str, Any]:
        return {"backend": "mock", "correct": self.correct}

    def loglikelihood(self, requests: list[tuple[str, str]]) -> list[float]:
        return [(0.0 if self.correct else -100.0) if pair in self.right else (-100.0 if self.correct else 0.0)
                for pair in requests]

    def rolling_nll(self, texts: list[str]) -> list[tuple[float, int]]:
        return [(len(t.encode()) * math.log(2), len(t.encode())) for t in texts]

    def generate(self, prompts: list[str], *, max_tokens: int, stop: list[str], temperature: float = 0.0,
                 n: int = 1, seed: int | None = None, chat: bool = False) -> list[list[str]]:
        def right(p: str) -> str:  # chat suites score the reasoning format's answer line
            return DEFAULT_FORMAT.render("", self.answers[p]) if chat else f" {self.answers[p]}"

        return [[right(p) if self.correct else " I do not know"] * n for p in prompts]
