"""A small async client for an OpenAI-compatible judge endpoint (vLLM in production).

A deadline per attempt (``timeout_s`` bounds the whole request, not each socket operation:
a judge that trickles its answer still times out), retries with exponential backoff (on
timeouts, connection errors, HTTP 429 and 5xx), a concurrency limit and an in-process LRU
cache keyed by the content hash of the request (model, prompt, sampling, answer format), so
the same question is asked once.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import httpx

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class JudgeError(RuntimeError):
    """The judge gave no answer. ``retryable``: a later attempt (e.g. a recompute) may succeed."""

    def __init__(self, message: str, retryable: bool):
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True)
class JudgeConfig:
    """Where the judge is and how to talk to it."""

    base_url: str
    model: str | None = None
    api_key: str | None = None
    timeout_s: float = 30.0
    retries: int = 2
    retry_backoff_s: float = 0.5
    concurrency: int = 4
    cache_size: int = 10_000


class JudgeClient:
    """Chat completions against ``{base_url}/v1``, cached, bounded and retried."""

    def __init__(self, config: JudgeConfig):
        self.config = config
        self.model: str | None = config.model
        self.calls = 0
        """Requests actually sent (cache hits excluded), for tests and metrics."""
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._client: httpx.AsyncClient | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _bind(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        """The HTTP client and semaphore of the running loop (new ones for a new loop)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._semaphore is None or self._loop is not loop:
            headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
            self._client = httpx.AsyncClient(
                base_url=self.config.base_url.rstrip("/"), timeout=self.config.timeout_s, headers=headers
            )
            self._semaphore = asyncio.Semaphore(self.config.concurrency)
            self._loop = loop
        return self._client, self._semaphore

    async def resolve_model(self) -> str:
        """The configured model, else the endpoint's first served model."""
        if self.model is None:
            body = await self._request("GET", "/v1/models", None)
            models = body.get("data") or []
            if not models:
                raise JudgeError(f"{self.config.base_url} serves no model", retryable=True)
            self.model = str(models[0]["id"])
        return self.model

    async def complete(self, prompt: str, *, max_tokens: int, temperature: float, regex: str | None) -> str:
        """The judge's answer to one user message (from the cache when asked before)."""
        model = await self.resolve_model()
        payload: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": temperature,
        }
        if regex is not None:
            payload["structured_outputs"] = {"regex": regex}
        key = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        body = await self._request("POST", "/v1/chat/completions", payload)
        try:
            answer = body["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError) as err:
            raise JudgeError(f"malformed chat completion response: {str(body)[:200]}", retryable=True) from err
        self._remember(key, answer)
        return answer

    def _remember(self, key: str, answer: str) -> None:
        if self.config.cache_size <= 0:
            return
        self._cache[key] = answer
        if len(self._cache) > self.config.cache_size:
            self._cache.popitem(last=False)

    async def _request(self, method: str, path: str, payload: dict[str, Any] | None) -> dict[str, Any]:
        """One request with the concurrency limit and retries; the JSON body of a 2xx answer."""
        client, semaphore = self._bind()
        delay = self.config.retry_backoff_s
        last = "no attempt made"
        for attempt in range(self.config.retries + 1):
            if attempt:
                await asyncio.sleep(delay)
                delay *= 2
            try:
                async with semaphore:
                    self.calls += 1
                    async with asyncio.timeout(self.config.timeout_s):
                        response = await client.request(method, path, json=payload)
            except TimeoutError:
                last = f"no answer within {self.config.timeout_s:g}s"
                continue
            except (httpx.TimeoutException, httpx.TransportError) as err:
                last = f"{type(err).__name__}: {err}"
                continue
            if response.status_code in RETRY_STATUSES:
                last = f"HTTP {response.status_code}: {response.text[:200]}"
                continue
            if response.status_code >= 400:
                raise JudgeError(f"HTTP {response.status_code}: {response.text[:200]}", retryable=False)
            return response.json()
        raise JudgeError(f"judge failed after {self.config.retries + 1} attempts: {last}", retryable=True)

    async def aclose(self) -> None:
        """Close the HTTP client."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None
