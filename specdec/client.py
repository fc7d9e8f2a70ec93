"""The client SDK: `Client` (blocking) and `AsyncClient` (asyncio) for the public SpecDec API.

    with specdec.Client("127.0.0.1:50051") as c:
        for chunk in c.generate("Write a haiku about the sea", max_tokens=64):
            print(chunk.text, end="", flush=True)
        result = c.complete("Hello", max_tokens=16, temperature=0.6, seed=1)
        print(result.text, result.stats["acceptance_rate"])

A plain `prompt` string is sent as one user chat message (rendered with the target
tokenizer's chat template); `text=` sends raw text, `messages=` a chat, `token_ids=` ids.
Errors surface as `grpc.RpcError` with the server's status code and message.

A server with TLS: `ca_file=` (the CA that signed its certificate) or `tls=True` (the system's
roots), plus `cert_file=`/`key_file=` when it requires a client certificate (mTLS). With a bearer
token, `token=` sends `authorization: Bearer <token>` on every call.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator, Sequence

import grpc
from google.protobuf.json_format import MessageToDict

from specdec import security
from specdec.modes import Mode
from specdec.v1 import common_pb2, specdec_pb2, specdec_pb2_grpc



@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    stats: dict  # the final summary (see specdec/v1/specdec.proto Summary)
    rounds: list[dict] = field(default_factory=list)  # per-round statistics

    def to_json(self) -> dict:
        return {"prompt_token_ids": self.prompt_token_ids, "token_ids": self.token_ids, "text": self.text,
                "stats": self.stats, "rounds": self.rounds}


def message_to_plain(msg) -> dict:
    """A flat proto message as a dict of Python numbers, strings and lists (int64 stays int)."""
    out = {}
    for f in msg.DESCRIPTOR.fields:
        v = getattr(msg, f.name)
        out[f.name] = v if isinstance(v, (bool, int, float, str, bytes)) else list(v)
    return out


def build_request(prompt: str | None = None, *, text: str | None = None, messages: Sequence[dict] | None = None,
                  token_ids: Sequence[int] | None = None, max_tokens: int = 128, temperature: float | None = None,
                  top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                  stop: Sequence[str] = (), ignore_eos: bool = False, k: int = 0, mode: str | int | None = None,
                  draft_temperature: float | None = None, draft_top_k: int | None = None,
                  draft_top_p: float | None = None, adaptive_k: bool | None = None) -> specdec_pb2.GenerateRequest:
    given = [x is not None for x in (prompt, text, messages, token_ids)]
    if sum(given) != 1:
        raise ValueError("give exactly one of prompt, text, messages or token_ids")
    req = specdec_pb2.GenerateRequest(max_tokens=max_tokens, stop=list(stop), ignore_eos=ignore_eos, k=k)
    if prompt is not None:
        messages = [{"role": "user", "content": prompt}]
    if text is not None:
        req.text = text
    elif messages is not None:
        req.chat.messages.extend(specdec_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
    else:
        req.token_ids.ids.extend(int(t) for t in token_ids)
    if seed is not None:
        req.seed = seed
    if adaptive_k is not None:  # unset = the server's orchestrator.adaptive_k
        req.adaptive_k = adaptive_k
    if isinstance(mode, str):
        req.mode = Mode.parse(mode)
    elif mode is not None:
        req.mode = mode
    _set_sampling(req.sampling, temperature, top_k, top_p)
    if not any(x is not None for x in (temperature, top_k, top_p)):
        req.ClearField("sampling")
    _set_sampling(req.draft_sampling, draft_temperature, draft_top_k, draft_top_p)
    if not any(x is not None for x in (draft_temperature, draft_top_k, draft_top_p)):
        req.ClearField("draft_sampling")
    return req


def _set_sampling(msg: common_pb2.SamplingParams, temperature, top_k, top_p) -> None:
    if temperature is not None:
        msg.temperature = temperature
    if top_k is not None:
        msg.top_k = top_k
    if top_p is not None:
        msg.top_p = top_p


def info_dict(info: specdec_pb2.ServerInfo) -> dict:
    """ServerInfo as a dict with every field, false and zero ones included."""
    return MessageToDict(info, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


class ResultCollector:
    def __init__(self):
        self.tokens: list[int] = []
        self.text: list[str] = []
        self.rounds: list[dict] = []
        self.summary: specdec_pb2.Summary | None = None

    def add(self, chunk: specdec_pb2.GenerateChunk) -> None:
        self.tokens.extend(chunk.token_ids)
        self.text.append(chunk.text)
        if chunk.HasField("round"):
            self.rounds.append(message_to_plain(chunk.round))
        if chunk.HasField("summary"):
            self.summary = chunk.summary

    def result(self) -> GenerationResult:
        s = self.summary or specdec_pb2.Summary()
        stats = message_to_plain(s)
        stats.pop("prompt_token_ids", None)
        stats["mode"] = Mode(s.mode).label if s.mode in tuple(Mode) else "unspecified"
        return GenerationResult(list(s.prompt_token_ids), self.tokens, "".join(self.text), stats, self.rounds)


def sdk_credentials(ca_file: str | None, tls: bool, cert_file: str | None,
                    key_file: str | None) -> grpc.ChannelCredentials | None:
    """The SDK's channel credentials: TLS when given a CA file or tls=True; None = plaintext."""
    return security.channel_credentials(ca_file or "", cert_file or "", key_file or "", system_roots=tls)


class Client:
    def __init__(self, address: str = "127.0.0.1:50051", timeout: float | None = 600.0, *,
                 ca_file: str | None = None, tls: bool = False, cert_file: str | None = None,
                 key_file: str | None = None, token: str | None = None):
        self.channel = security.open_channel(address, sdk_credentials(ca_file, tls, cert_file, key_file), aio=False)
        self.stub = specdec_pb2_grpc.SpecDecStub(self.channel)
        self.timeout = timeout
        self.metadata = security.bearer_metadata(token)

    def generate(self, prompt: str | None = None, **kw) -> Iterator[specdec_pb2.GenerateChunk]:
        """Stream chunks: text delta, token ids and round stats; the last one carries the summary.
        Stopping early (closing the iterator, or leaving the loop and dropping it) cancels the
        request, and the server frees what it held."""
        call = self.stub.Generate(build_request(prompt, **kw), timeout=self.timeout, metadata=self.metadata)
        try:
            yield from call
        finally:
            call.cancel()

    def complete(self, prompt: str | None = None, **kw) -> GenerationResult:
        c = ResultCollector()
        for chunk in self.generate(prompt, **kw):
            c.add(chunk)
        return c.result()

    def generate_text(self, prompt: str | None = None, **kw) -> str:
        return self.complete(prompt, **kw).text

    def info(self) -> dict:
        return info_dict(self.stub.GetInfo(common_pb2.InfoRequest(), timeout=self.timeout, metadata=self.metadata))

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncClient:
    def __init__(self, address: str = "127.0.0.1:50051", timeout: float | None = 600.0, *,
                 ca_file: str | None = None, tls: bool = False, cert_file: str | None = None,
                 key_file: str | None = None, token: str | None = None):
        self.channel = security.open_channel(address, sdk_credentials(ca_file, tls, cert_file, key_file))
        self.stub = specdec_pb2_grpc.SpecDecStub(self.channel)
        self.timeout = timeout
        self.metadata = security.bearer_metadata(token)

    async def generate(self, prompt: str | None = None, **kw) -> AsyncIterator[specdec_pb2.GenerateChunk]:
        call = self.stub.Generate(build_request(prompt, **kw), timeout=self.timeout, metadata=self.metadata)
        try:
            async for chunk in call:
                yield chunk
        finally:
            call.cancel()

    async def complete(self, prompt: str | None = None, **kw) -> GenerationResult:
        c = ResultCollector()
        async for chunk in self.generate(prompt, **kw):
            c.add(chunk)
        return c.result()

    async def generate_text(self, prompt: str | None = None, **kw) -> str:
        return (await self.complete(prompt, **kw)).text

    async def info(self) -> dict:
        return info_dict(await self.stub.GetInfo(common_pb2.InfoRequest(), timeout=self.timeout,
                                                 metadata=self.metadata))

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
