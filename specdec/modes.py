"""The three ways a request can run, with one set of names for the API, the config and the CLI."""
from __future__ import annotations

import enum


class Mode(enum.IntEnum):
    """Values match `specdec.v1.Mode` (0 is MODE_UNSPECIFIED: the server's default)."""

    PIPELINED = 1  # the draft drafts round n+1 while the target verifies round n
    SEQUENTIAL = 2  # draft, then verify
    TARGET_ONLY = 3  # the baseline: no draft

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", "-")

    @classmethod
    def parse(cls, name: str) -> "Mode":
        """'pipelined' | 'sequential' | 'target-only' -> Mode; ValueError naming the choices."""
        for m in cls:
            if m.label == name:
                return m
        raise ValueError(f"unknown mode {name!r}: use {', '.join(LABELS)}")


LABELS = tuple(m.label for m in Mode)
