"""The gateway's ``POST /v1/traces``: OTLP/HTTP trace exports, mapped to session events.

An OpenTelemetry exporter posts an ``ExportTraceServiceRequest``, protobuf
(``application/x-protobuf``) or OTLP's JSON (``application/json``), gzip- or
deflate-compressed or not (``Content-Encoding``), with the project's write key in
``Authorization: Bearer <key>``. Its spans become events (:mod:`ingest.otlp`), produced to the
events topic as ``/v1/events`` produces them, and the answer comes after Kafka acknowledged them:

- 200 with an ``ExportTraceServiceResponse`` in the request's encoding; spans that could not be
  mapped are counted in its ``partial_success`` (``rejected_spans``, ``error_message``), the
  others are kept;
- 400: a body that is not an export (or not valid gzip); 413: a body, compressed or not, over
  ``ingest.max_body_bytes``; 415: another content type or encoding; 503: Kafka did not
  acknowledge (retry: event ids are derived from the spans, so a retry is not doubled). These
  answer a ``google.rpc.Status`` in the request's encoding (its JSON form also has ``detail``);
- 401 / 403 as ``/v1/events`` (a JSON ``{"detail"}``).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from google.rpc.status_pb2 import Status
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTracePartialSuccess,
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from ingest import metrics
from ingest.limits import Limits
from ingest.otlp import ExportMapping, map_export

PATH = "/v1/traces"
PROTOBUF, JSON = "application/x-protobuf", "application/json"
GRPC_CODES = {400: 3, 413: 8, 415: 3, 503: 14}
"""google.rpc.Code of each refusal: INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE."""
_ID_FIELDS = ("traceId", "trace_id", "spanId", "span_id", "parentSpanId", "parent_span_id")


def content_type(header: str | None) -> str:
    """``protobuf`` or ``json`` from a ``Content-Type``, else raise 415."""
    media = (header or "").split(";", 1)[0].strip().lower()
    if media == PROTOBUF:
        return "protobuf"
    if media == JSON:
        return "json"
    raise HTTPException(415, f"Content-Type {media or '(none)'!r} is not supported: send {PROTOBUF} or {JSON}")


def inflate(body: bytes, encoding: str | None, limit: int) -> bytes:
    """The body decompressed per ``Content-Encoding`` (gzip, deflate, identity), refusing more than ``limit`` bytes."""
    encoding = (encoding or "identity").strip().lower()
    if encoding == "identity":
        return body
    if encoding not in ("gzip", "deflate"):
        raise HTTPException(415, f"Content-Encoding {encoding!r} is not supported: send gzip, deflate or none")
    inflater = zlib.decompressobj(31 if encoding == "gzip" else 15)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as err:
        raise HTTPException(400, f"body is not valid {encoding} data: {err}") from None
    if len(out) > limit:
        raise HTTPException(413, f"decompressed body is over the limit ingest.max_body_bytes = {limit}")
    if not inflater.eof:
        raise HTTPException(400, f"body is truncated {encoding} data")
    return out


def decode_export(body: bytes, kind: str) -> ExportTraceServiceRequest:
    """An ``ExportTraceServiceRequest`` from protobuf bytes or OTLP JSON, else raise 400 saying why."""
    request = ExportTraceServiceRequest()
    if kind == "protobuf":
        try:
            request.ParseFromString(body)
        except DecodeError as err:
            raise HTTPException(400, f"body is not a protobuf ExportTraceServiceRequest: {err}") from None
        return request
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise HTTPException(400, f"body is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise HTTPException(400, 'body must be a JSON object {"resourceSpans": [...]} (OTLP JSON)')
    _hex_ids_to_base64(data)
    try:
        json_format.ParseDict(data, request, ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError, TypeError, RecursionError) as err:
        raise HTTPException(400, f"body is not an OTLP JSON ExportTraceServiceRequest: {err}") from None
    return request


def _hex_ids_to_base64(data: dict[str, Any]) -> None:
    """OTLP JSON writes trace and span ids as hex, where protobuf's JSON mapping expects base64: convert in place."""
    for r, resource_spans in enumerate(_list(data, "resourceSpans", "resource_spans")):
        for s, scope_spans in enumerate(_list(resource_spans, "scopeSpans", "scope_spans")):
            for n, span in enumerate(_list(scope_spans, "spans")):
                where = f"resourceSpans[{r}].scopeSpans[{s}].spans[{n}]"
                _convert_ids(span, where)
                for k, link in enumerate(_list(span, "links")):
                    _convert_ids(link, f"{where}.links[{k}]")


def _list(node: Any, *names: str) -> list[Any]:
    if not isinstance(node, dict):
        return []
    for name in names:
        if isinstance(node.get(name), list):
            return node[name]
    return []


def _convert_ids(node: Any, where: str) -> None:
    if not isinstance(node, dict):
        return
    for name in _ID_FIELDS:
        value = node.get(name)
        if isinstance(value, str):
            try:
                raw = bytes.fromhex(value)
            except ValueError:
                raise HTTPException(400, f"{where}.{name}: {value[:40]!r} is not a hex-encoded id") from None
            node[name] = json_format.base64.b64encode(raw).decode("ascii")


def encode(message: Any, kind: str) -> bytes:
    """A protobuf message in the request's encoding."""
    if kind == "protobuf":
        return message.SerializeToString()
    return json_format.MessageToJson(message, indent=None).encode("utf-8")


def export_response(mapping: ExportMapping) -> ExportTraceServiceResponse:
    """The answer to an export: partial success when spans were rejected, else empty."""
    response = ExportTraceServiceResponse()
    if mapping.rejected:
        response.partial_success.CopyFrom(
            ExportTracePartialSuccess(rejected_spans=len(mapping.rejected), error_message=mapping.error_message())
        )
    return response


def refusal(exc: HTTPException, kind: str) -> Response:
    """A refusal as the OTLP/HTTP spec asks: a ``google.rpc.Status`` in the request's encoding."""
    status = Status(code=GRPC_CODES.get(exc.status_code, 2), message=str(exc.detail))
    if kind == "protobuf":
        return Response(encode(status, kind), status_code=exc.status_code, media_type=PROTOBUF, headers=exc.headers)
    content = {**json_format.MessageToDict(status), "detail": exc.detail}
    return JSONResponse(content, status_code=exc.status_code, headers=exc.headers)


def count(mapping: ExportMapping) -> None:
    """Count what became of an export's spans."""
    if mapping.mapped_spans:
        metrics.OTLP_SPANS.labels(outcome="mapped").inc(mapping.mapped_spans)
    if mapping.rejected:
        metrics.OTLP_SPANS.labels(outcome="rejected").inc(len(mapping.rejected))
        for rejected in mapping.rejected:
            metrics.OTLP_REJECTED.labels(reason=rejected.reason).inc()


REQUEST_BODY = {
    "required": True,
    "content": {
        JSON: {
            "schema": {
                "type": "object",
                "description": "An OTLP ExportTraceServiceRequest in OTLP's JSON encoding (ids in hex).",
                "properties": {"resourceSpans": {"type": "array", "items": {"type": "object"}}},
            }
        },
        PROTOBUF: {"schema": {"type": "string", "format": "binary"}},
    },
}


def register(
    app: FastAPI,
    *,
    settings: Any,
    keys: Any,
    producer: Callable[[], Any],
    topic: str,
    limits: Limits,
) -> None:
    """Add ``POST /v1/traces`` to the gateway ``app`` (``keys``: its :class:`~ingest.gateway.KeyStore`;
    ``producer``: returns its producer, made when the app starts)."""
    from ingest.gateway import produce, read_body  # here: the gateway imports this module

    ingest = settings.ingest
    session_attribute = ingest.otlp.session_attribute

    @app.post(
        PATH,
        status_code=200,
        response_class=Response,
        responses={
            200: {"description": "ExportTraceServiceResponse, with partial_success when spans were rejected."},
            400: {"description": "Not an ExportTraceServiceRequest (google.rpc.Status naming why)."},
            401: {"description": "Missing, unknown or revoked write key."},
            413: {"description": "Body over ingest.max_body_bytes, compressed or not."},
            415: {"description": "Content-Type or Content-Encoding not supported."},
            503: {"description": "Kafka did not acknowledge; retry."},
        },
        openapi_extra={"requestBody": REQUEST_BODY},
    )
    async def post_traces(request: Request) -> Response:
        """Accept an OTLP trace export: its GenAI and OpenInference spans become session events."""
        key = await run_in_threadpool(keys.authenticate, request.headers.get("authorization"))
        kind = "json"
        try:
            kind = content_type(request.headers.get("content-type"))
            body = await read_body(request, ingest.max_body_bytes)
            body = inflate(body, request.headers.get("content-encoding"), ingest.max_body_bytes)
            export = decode_export(body, kind)
            mapping = await run_in_threadpool(
                map_export, export, key.project, session_attribute=session_attribute, limits=limits
            )
            if mapping.events:
                await run_in_threadpool(produce, producer(), topic, mapping.events)
        except HTTPException as exc:
            metrics.OTLP_REQUESTS.labels(status=str(exc.status_code)).inc()
            return refusal(exc, kind)
        count(mapping)
        metrics.OTLP_REQUESTS.labels(status="200").inc()
        if mapping.events:
            metrics.GATEWAY_ACCEPTED.labels(project=key.project).inc(len(mapping.events))
        media = PROTOBUF if kind == "protobuf" else JSON
        return Response(encode(export_response(mapping), kind), media_type=media)
