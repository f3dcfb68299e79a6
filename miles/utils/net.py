"""Network helpers shared by every layer (no Ray, no torch): a free TCP port on this host."""

from __future__ import annotations

import socket


def free_port(host: str = "") -> int:
    """A TCP port free on `host` right now ("" = every interface): bound, read, released.

    Another process may take it before the caller binds it; every caller binds it at once."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
