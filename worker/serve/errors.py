"""How a route of ``probeguard serve`` refuses a request (each API renders it its way)."""

from __future__ import annotations

__all__ = ["ApiError"]


class ApiError(Exception):
    """A refusal: its HTTP status, a message for the caller, and what the dialects need."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        retry_after_s: float | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s
        self.close = close  # answer with `Connection: close` (the body was not all read)
