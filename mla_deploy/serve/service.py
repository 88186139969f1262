"""What the server serves: one artifact's engine, tokenizer and :class:`~mla_deploy.generate.batching.ContinuousBatcher`
on an engine thread, each request a stream of text pieces (:meth:`Service.generate`, a :class:`TextRequest` per
choice), and the metrics.

The HTTP layer (:mod:`mla_deploy.serve.app`) knows nothing of engines; this module knows nothing of HTTP except
:class:`~mla_deploy.serve.protocol.ApiError`, the error a request gets.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Sequence

from ..errors import ArtifactError, BusyError, CacheCapacityError, InputError, RuntimeMissingError
from ..generate.batching import ContinuousBatcher, SequenceEvent
from ..generate.constrain import Grammars
from ..generate.sampling import SamplingConfig
from ..generate.text import StopText
from ..generate.tool_calls import prepare_messages, tool_syntax
from .protocol import ApiError

#: OpenAI's ``finish_reason`` of each way a sequence ends with a reply
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


@dataclass(frozen=True)
class ServeOptions:
    """How ``mla-deploy serve`` runs (every field a command-line option).

    Attributes:
        host, port: where it listens (127.0.0.1 unless told otherwise).
        max_batch: sequences decoded together (rows of the cache).
        max_cache_length: rows each sequence may hold, prompt plus new tokens (None: the artifact's capacity);
            every decode step attends over all of them.
        threads: the engine's intra-op threads (None: ONNX Runtime's default). provider: ``cpu`` or ``cuda``.
        use_engine: open the artifact's pre-built CPU engine when it has one (``mla-deploy build --target cpu``).
        cuda: ONNX Runtime's CUDA provider options (:class:`~mla_deploy.ort.cuda.CudaOptions`; None: its defaults).
        api_key: when set, ``/v1/*`` requires ``Authorization: Bearer KEY``.
        model_name: the model's id in the API (None: the artifact's name).
        max_queue: requests waiting for a row before new ones get 429.
        request_timeout: seconds a request may take before it is ended (408).
        max_body_bytes: the largest request body (413 past it).
        grace: seconds in-flight requests get to finish at SIGTERM/SIGINT before they are cancelled.
        client_timeout: seconds a client has to send a request's headers, then its body, and that a connection may
            stay idle between requests.
        max_header_bytes: the largest request line and headers (the connection is answered 400 and closed past it).
        prefill_chunk: the most prompt tokens prefilled between two decode steps of the running batch (0: a prompt
            whole, holding the batch meanwhile; None, ``--prefill-chunk auto``: as many as take about 0.4 of a decode
            step, sized from the measured costs: :mod:`~mla_deploy.generate.chunk_budget`).
        prefix_cache_mb: the prefix cache's budget of host memory, in MiB (0: no prefix cache).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 8
    max_cache_length: int | None = None
    threads: int | None = None
    provider: str = "cpu"
    use_engine: bool = True
    cuda: object = None
    api_key: str | None = None
    model_name: str | None = None
    max_queue: int = 256
    request_timeout: float = 600.0
    max_body_bytes: int = 4 << 20
    grace: float = 30.0
    client_timeout: float = 15.0
    max_header_bytes: int = 64 << 10
    prefill_chunk: int | None = 64
    prefix_cache_mb: int = 512


@dataclass(frozen=True)
class TokenEntry:
    """One token's log probability as the API reports it: ``text`` (its bytes as UTF-8, a partial character's bytes
    escaped as ``\\xNN``), ``bytes``, ``logprob`` (None: the prompt's first token, which nothing predicts), ``top``:
    ``(text, bytes, logprob)`` of the most likely tokens at its position, most likely first, and ``offset``: where its
    text begins in the reply's text, in characters."""

    text: str
    bytes: bytes
    logprob: float | None
    top: tuple = ()
    offset: int = 0


@dataclass(frozen=True)
class Piece:
    """New text of a request, the tokens made so far, and OpenAI's ``finish_reason`` on the last piece;
    ``logprobs``: the entries of the tokens since the previous piece, where the request asked for them."""

    text: str
    tokens: int
    finish_reason: str | None = None
    logprobs: tuple[TokenEntry, ...] = ()


class Service:
    """An artifact served: open its engine and tokenizer, run the batcher on its own thread.

    Args:
        artifact: the export directory (static cache, with its tokenizer files).
        options: :class:`ServeOptions`.
    Raises:
        ArtifactError: no tokenizer in the artifact. As :class:`~mla_deploy.ort.engine.OrtEngine` and
            :class:`~mla_deploy.generate.batching.ContinuousBatcher` (a concat cache has no rows to batch in).
    """

    def __init__(self, artifact: str | Path, options: ServeOptions):
        from ..ort.engine import OrtEngine

        self.options = options
        self.tokenizer = _tokenizer(artifact)  # before the engine: opening a full-size one takes seconds
        # no spinning: the engine's threads share the cores with the event loop that brings the requests
        self.engine = OrtEngine(artifact, options.provider, options.threads, use_engine=options.use_engine,
                                spin=False, cuda=options.cuda)
        self.model_name = options.model_name or self.engine.manifest.name
        self.created = int(time.time())
        self.instance = f"{socket.gethostname()}:{os.getpid()}"  # which process answered (/health), one of many
        self.batcher = ContinuousBatcher(self.engine, options.max_batch, options.max_cache_length, options.max_queue,
                                         _chunk(options.prefill_chunk), options.prefix_cache_mb << 20)
        self._token_texts: dict[int, tuple[str, bytes]] = {}  # log probability entries' token texts, by id
        self.capacity = self.batcher.capacity
        # no text of more characters than this can fit in a row, whatever it says: the cheap check that comes
        # before a tokenizer is handed megabytes it would hold the interpreter and a gigabyte of memory for
        self.max_prompt_chars = self.capacity * _longest_token(self.tokenizer)
        # response_format and forced tool calls: the grammar library is loaded on the first such request
        self.grammars = Grammars(self.tokenizer, self.engine.vocab_size, self.tokenizer.eos_ids)
        vocabulary = self.tokenizer.backend.get_vocab(with_added_tokens=True)
        self.tool_syntax = tool_syntax(vocabulary)
        special = {t.content for t in self.tokenizer.backend.get_added_tokens_decoder().values() if t.special}
        # the text of a reply read for calls keeps the syntax's tokens where they are special tokens
        self.calls_need_special = self.tool_syntax.start in special
        # tokenizing runs here, off the event loop, two prompts at a time at most
        self._tokenizing = ThreadPoolExecutor(2, thread_name_prefix="mla-deploy-tokenize")
        self.metrics = None  # set by the app (mla_deploy.serve.metrics.Metrics)
        self._thread = threading.Thread(target=self.batcher.run, name="mla-deploy-engine", daemon=True)
        self.stopping = False

    @staticmethod
    def check(artifact: str | Path, options: ServeOptions) -> str:
        """What :class:`Service` refuses of ``artifact`` and ``options`` that can be told without opening the engine
        (a driver that starts replicas elsewhere calls it first); returns the model's id in the API.

        Raises: ArtifactError: no artifact, a broken manifest, no tokenizer. CacheCapacityError: a concat cache.
            InputError: ``max_batch``, ``max_queue`` or ``max_cache_length`` out of range, or a cache larger than
            this machine's memory.
        """
        from ..artifact.check import check_artifact

        manifest = check_artifact(artifact, verify_hashes=False, check_graphs=False)
        _tokenizer(artifact)
        if not manifest.layout.in_place:
            raise CacheCapacityError(f"{artifact} has a {manifest.layout.mode} cache, which has no rows to batch in: "
                                     f"export it with --cache-mode static to serve it")
        capacity = manifest.capacity
        if min(options.prefill_chunk or 0, options.prefix_cache_mb) < 0:
            raise InputError(f"--prefill-chunk and --prefix-cache-mb must be >= 0, got {options.prefill_chunk} and "
                             f"{options.prefix_cache_mb}")
        if min(options.max_batch, options.max_queue) < 1 or (options.max_cache_length or 1) < 1:
            raise InputError(f"max_batch, max_queue and max_cache_length must be >= 1, got {options.max_batch}, "
                             f"{options.max_queue} and {options.max_cache_length}")
        if capacity and options.max_cache_length and options.max_cache_length > capacity:
            raise InputError(f"a row of {options.max_cache_length} tokens per sequence exceeds the artifact's cache "
                             f"capacity {capacity} (its max_cache_length)")
        from ..generate.batching import check_cache_memory

        check_cache_memory(options.max_batch, options.max_cache_length or capacity or 1, manifest.config,
                           4 if manifest.precision == "fp32" else 2)
        return options.model_name or manifest.name

    def start(self) -> None:
        self._thread.start()

    def problem(self) -> str | None:
        """Why this service cannot take requests (None: it can): shutting down, or its engine thread has died."""
        if self.stopping:
            return "the server is shutting down"
        if self._thread.ident is not None and not self._thread.is_alive():
            return "the engine thread has stopped"
        return None

    def stop(self, grace: float | None = None) -> None:
        """Accept nothing more, let the running requests finish for ``grace`` seconds, then cancel the rest."""
        self.stopping = True
        self.batcher.close()
        self._thread.join(self.options.grace if grace is None else grace)
        if self._thread.is_alive():
            self.batcher.close(cancel=True)
            self._thread.join(5)
        self._tokenizing.shutdown(wait=False, cancel_futures=True)

    def cancel_all(self) -> None:
        """Accept nothing more and end every waiting and running request now (each gets its 503)."""
        self.stopping = True
        self.batcher.close(cancel=True)

    # a request ------------------------------------------------------------------------------------------------
    async def prompt_ids(self, prompt) -> list[int]:
        """A completion prompt's ids: a string encoded with the tokenizer (off the event loop), or ids as given.

        Raises: ApiError: 400 a text too long for a row, an id outside the vocabulary.
        """
        if isinstance(prompt, str):
            self._check_length(len(prompt), "prompt")
            return await self._off_loop(self.tokenizer.encode, prompt, release_gil=True)
        vocab = self.engine.vocab_size
        outside = next((i for i in prompt if not 0 <= i < vocab), None)
        if outside is not None:  # before NumPy, which cannot hold an id past int64
            raise ApiError(400, f"token id {outside} is outside the vocabulary (0..{vocab - 1})", param="prompt")
        return list(prompt)

    async def chat_ids(self, messages: Sequence[dict], tools: list | None = None) -> list[int]:
        """The ids of a conversation through the artifact's chat template, with the generation prompt (rendered and
        tokenized off the event loop); ``tools`` (OpenAI's function definitions) are handed to the template, or
        told in the system message where it does not render them
        (:func:`~mla_deploy.generate.tool_calls.prepare_messages`). Raises: ApiError: 400 no template, a
        conversation too long for a row."""
        # every string a message holds counts (a template may render a name or a tool call id too), and the tools
        self._check_length(sum(len(v) for m in messages for v in m.values() if isinstance(v, str)) +
                           len(json.dumps(tools or [], ensure_ascii=False)) +
                           sum(len(json.dumps(m.get("tool_calls") or [])) for m in messages), "messages")
        template = self.tokenizer.chat_template or ""
        messages = prepare_messages(messages, tools, self.tool_syntax, self.tokenizer.template_reads("tools"),
                                    "tool_calls" in template)
        try:
            return await self._off_loop(self.tokenizer.chat_ids, messages, release_gil=True, tools=tools)
        except InputError as exc:
            raise ApiError(400, str(exc), param="messages") from None

    async def constraints(self, schema: dict | None, param: str, n: int = 1) -> list:
        """``n`` new :class:`~mla_deploy.generate.constrain.Constraint` s (one per choice: each holds its own grammar
        state) holding a reply to JSON valid under ``schema`` (None: any JSON object); the grammar is compiled off
        the event loop, once per schema.

        Raises: ApiError: 400 the grammar library is not installed, or the schema cannot be used."""
        try:
            grammar = await self._off_loop(self.grammars.compile, schema)
        except (InputError, RuntimeMissingError) as exc:
            raise ApiError(400, str(exc), param=param) from None
        return [grammar.start() for _ in range(n)]

    def _check_length(self, characters: int, param: str) -> None:
        if characters > self.max_prompt_chars:
            raise ApiError(400, f"the {param} is {characters} characters, more than the {self.max_prompt_chars} "
                                f"that {self.capacity} tokens of this tokenizer can hold; this server holds at most "
                                f"{self.capacity} per sequence", param=param, code="context_length_exceeded")

    async def _off_loop(self, function, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing,
                                                                lambda: function(*args, **kwargs))

    def max_new_tokens(self, prompt_length: int, asked: int | None) -> int:
        """``asked``, or what the cache leaves after the prompt; refused when it cannot fit (400)."""
        room = self.batcher.room(prompt_length)
        if room < 1:
            raise ApiError(400, f"the prompt is {prompt_length} tokens; this server holds at most {self.capacity} "
                                f"per sequence", code="context_length_exceeded")
        if asked is None:
            return room
        if asked > room:
            raise ApiError(400, f"max_tokens {asked} and the prompt's {prompt_length} tokens exceed the "
                                f"{self.capacity} tokens a sequence may hold (at most {room} new tokens for this "
                                f"prompt)", param="max_tokens", code="context_length_exceeded")
        return asked

    @staticmethod
    def sampling(temperature: float, top_p: float, top_k: int | None, seed: int | None) -> SamplingConfig:
        """The request's token choice: temperature 0 is greedy (``top_p``/``top_k`` then do not apply)."""
        if temperature == 0:
            return SamplingConfig()
        return SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)

    def generate(self, ids: list[int], max_new_tokens: int, sampling: SamplingConfig, stops: Sequence[str],
                 n: int = 1, top_logprobs: int | None = None, prompt_logprobs: bool = False,
                 constraints: Sequence | None = None, keep_special: bool = False) -> list["TextRequest"]:
        """Submit ``n`` choices of one prompt now (so a refusal comes before any reply is sent), sharing its prefill;
        iterate each returned :class:`TextRequest` for its text. Call from the event loop's thread. Choice ``i``
        samples with ``sampling.choice(i)`` (its own seed derived from the request's); ``top_logprobs``: each token's
        log probability and that many most likely tokens (None: none); ``prompt_logprobs``: the prompt's too (the
        first request's :attr:`TextRequest.prompt_entries`); ``constraints``: None, or each choice's token mask
        (:meth:`constraints`); ``keep_special``: the text keeps
        special tokens (not the end-of-sequence).

        Raises: ApiError: 400 a bad prompt or ``n`` past the rows of the batch, 429 the queue is full, 503 shutting
            down.
        """
        loop = asyncio.get_running_loop()
        queues: list[asyncio.Queue[SequenceEvent]] = [asyncio.Queue() for _ in range(n)]
        if self.stopping:
            raise ApiError(503, "the server is shutting down", type="server_error")
        try:
            tickets = self.batcher.submit_choices(
                ids, max_new_tokens, [sampling.choice(i) for i in range(n)], self.tokenizer.eos_ids,
                [lambda event, q=q: _deliver(loop, q, event) for q in queues], top_logprobs, prompt_logprobs,
                constraints)
        except BusyError as exc:
            raise ApiError(429, str(exc), type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"}) from None
        except (InputError, CacheCapacityError) as exc:
            raise ApiError(400, str(exc), param="n" if n > 1 and str(exc).startswith("n ") else None) from None
        return [TextRequest(self, ticket, queue, stops, keep_special, counts_prompt=i == 0)
                for i, (ticket, queue) in enumerate(zip(tickets, queues))]

    def token_text(self, token: int) -> tuple[str, bytes]:
        """``(text, bytes)`` of ``token`` as a log probability entry names it (:class:`TokenEntry`)."""
        known = self._token_texts.get(token)
        if known is None:
            raw = self.tokenizer.token_bytes(token)
            known = self._token_texts[token] = (raw.decode("utf-8", errors="backslashreplace"), raw)
        return known

    def entry(self, logprob, offset: int) -> TokenEntry:
        """The :class:`TokenEntry` of a batcher's :class:`~mla_deploy.generate.logprobs.TokenLogprob`."""
        text, raw = self.token_text(logprob.token)
        top = tuple((*self.token_text(i), value) for i, value in logprob.top)
        return TokenEntry(text, raw, logprob.logprob, top, offset)

    def prompt_entries(self, ids: Sequence[int], logprobs: Sequence) -> list[TokenEntry]:
        """The entries of a prompt's tokens (``echo``): the first without a log probability, then ``logprobs`` (one
        per later token); offsets in the prompt's decoded text."""
        detokenizer, offset, out = self.tokenizer.detokenizer(), 0, []
        for i, token in enumerate(ids):
            if i == 0:
                text, raw = self.token_text(int(token))
                out.append(TokenEntry(text, raw, None, (), 0))
            else:
                out.append(self.entry(logprobs[i - 1], offset))
            offset += len(detokenizer.push(int(token)))
        return out


def _chunk(prefill_chunk: int | None):
    """The batcher's ``prefill_chunk`` for ``--prefill-chunk`` (None: the time-budgeted chunk; 0: a prompt whole)."""
    from ..generate.chunk_budget import AUTO

    return AUTO if prefill_chunk is None else prefill_chunk or None


def _tokenizer(artifact: str | Path):
    """The artifact's tokenizer. Raises: ArtifactError: it has none."""
    from ..generate.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(artifact)
    if tokenizer is None:
        raise ArtifactError(f"{artifact} has no tokenizer files; export it with --hf from a checkpoint that has them "
                            f"to serve text")
    return tokenizer


def _longest_token(tokenizer) -> int:
    """The most characters one token of ``tokenizer`` stands for (its longest vocabulary entry, added tokens
    included): a text of ``n`` characters is at least ``n / this`` tokens. (A byte-level vocabulary spells each byte
    as one character, and a character is at least one byte, so the bound holds there too.)"""
    return max(1, max((len(entry) for entry in tokenizer.backend.get_vocab(with_added_tokens=True)), default=1))


def _deliver(loop, events: asyncio.Queue, event: SequenceEvent) -> None:
    """Hand ``event`` from the engine's thread to the request's queue on ``loop`` (dropped once the loop has closed:
    the server is gone, and so is the request)."""
    try:
        loop.call_soon_threadsafe(events.put_nowait, event)
    except RuntimeError:
        pass


class TextRequest:
    """One submitted request: iterate it (``async for``) for its :class:`Piece` s; the last has its
    ``finish_reason``. Leaving the iteration early, or :meth:`cancel`, ends the request and frees its row.

    Raises (while iterated): ApiError: 408 past the request timeout, 500 the engine failed, 503 shutting down.
    """

    def __init__(self, service: Service, ticket, events: asyncio.Queue, stops: Sequence[str],
                 keep_special: bool = False, counts_prompt: bool = True):
        self.service, self.ticket, self.events, self.stops = service, ticket, events, stops
        self.keep_special = keep_special
        # the usage counts a prompt once, however many choices share it
        self.prompt_tokens, self.tokens = ticket.prompt_length if counts_prompt else 0, 0
        #: the prompt's log probabilities (as the batcher reports them with the first token), where asked
        self.prompt_logprobs: tuple | None = None

    def cancel(self) -> None:
        self.ticket.cancel("cancelled")

    async def __aiter__(self) -> AsyncIterator[Piece]:
        service, ticket = self.service, self.ticket
        loop = asyncio.get_running_loop()
        detokenizer, stop = service.tokenizer.detokenizer(not self.keep_special), StopText(self.stops)
        timeout = service.options.request_timeout
        deadline, done = ticket.submitted - time.perf_counter() + loop.time() + timeout, False
        last = ticket.submitted  # the time of the previous token (the submission before the first)
        produced, entries = 0, []  # characters of text so far; log probability entries not yet in a piece
        try:
            while not done:
                try:
                    event = await asyncio.wait_for(self.events.get(), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    raise ApiError(408, f"the request took longer than {timeout:g} s", type="timeout_error",
                                   code="timeout") from None
                if event.finished == "error":
                    raise ApiError(500, f"the engine failed: {event.error}", type="server_error")
                if event.token is None:  # ended without a token: cancelled at shutdown
                    raise ApiError(503, "the server is shutting down", type="server_error")
                self.tokens += 1
                now = time.perf_counter()
                if service.metrics is not None:
                    service.metrics.token(now - last, first=self.tokens == 1)
                last = now
                if event.prompt_logprobs is not None:
                    self.prompt_logprobs = event.prompt_logprobs
                if event.logprob is not None:
                    entries.append(service.entry(event.logprob, produced))
                shown_token = not (self.keep_special and event.token in ticket.eos_ids)
                text = (detokenizer.push(event.token) if shown_token else "") + \
                    (detokenizer.flush() if event.finished else "")
                produced += len(text)
                shown, hit = stop.feed(text)
                if hit:
                    ticket.cancel("stop")
                    done = True
                    yield Piece(shown, self.tokens, "stop", tuple(entries))
                elif event.finished:
                    done = True
                    yield Piece(shown + stop.flush(), self.tokens, FINISH[event.finished], tuple(entries))
                elif shown:
                    yield Piece(shown, self.tokens, logprobs=tuple(entries))
                    entries = []
        finally:
            if not done:
                ticket.cancel("cancelled")
