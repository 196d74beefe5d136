"""Errors that carry the status code a client should see (ARCHITECTURE.md, "Wire contracts")."""

from __future__ import annotations

from enum import StrEnum


class StatusCode(StrEnum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    OUT_OF_RANGE = "OUT_OF_RANGE"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"


class SpecdecError(Exception):
    """A failure caused by the request or by a peer, never by a bug in specdec itself."""

    def __init__(self, code: StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"


class BindError(OSError):
    """A listen address that cannot be used (taken, or not this host's): a start-up error naming it."""


def invalid(message: str) -> SpecdecError:
    return SpecdecError(StatusCode.INVALID_ARGUMENT, message)


def out_of_range(message: str) -> SpecdecError:
    return SpecdecError(StatusCode.OUT_OF_RANGE, message)


def out_of_step(message: str) -> SpecdecError:
    return SpecdecError(StatusCode.FAILED_PRECONDITION, message)
