"""The replica client: one per process (no client, and no SSL context, built per call)."""

from __future__ import annotations

import http.server
import os
import threading

import httpx

from flywheel.core import vllm_admin


class _Replica(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
        body = b'{"weight_version": "v7"}'
        self.send_response(200 if self.path in ("/health", "/weight_info") else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_one_client_per_process_and_a_new_one_after_a_fork(monkeypatch) -> None:
    first = vllm_admin.client()
    assert vllm_admin.client() is first and isinstance(first, httpx.Client)
    monkeypatch.setattr(os, "getpid", lambda: -1)  # as a forked child sees it
    child = vllm_admin.client()
    assert child is not first and vllm_admin.client() is child


def test_calls_go_through_the_shared_client(monkeypatch) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Replica)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    built: list[object] = []
    real_init = httpx.Client.__init__

    def counting_init(self, *args, **kwargs) -> None:
        built.append(self)
        real_init(self, *args, **kwargs)

    vllm_admin.client()  # made before counting
    monkeypatch.setattr(httpx.Client, "__init__", counting_init)
    try:
        for _ in range(5):
            assert vllm_admin.health(url) and vllm_admin.weight_info(url) == "v7"
        assert not vllm_admin.health(url + "/nowhere")
    finally:
        server.shutdown()
    assert built == []  # no client built per call
