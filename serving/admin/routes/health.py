"""``GET /health``: liveness and database reachability, the only route without a token."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from serving.admin.deps import DbEngine
from serving.admin.schemas import ErrorPublic

router = APIRouter()


@router.get("/health", name="health", responses={503: {"model": ErrorPublic}})
def health(engine: DbEngine) -> JSONResponse:
    """Liveness and database reachability; the only route without a token."""
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except SQLAlchemyError as err:
        return JSONResponse(status_code=503, content={"status": "unavailable", "database": type(err).__name__})
    return JSONResponse({"status": "ok"})
