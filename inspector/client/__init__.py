"""Sessions on an ``inspector serve`` server, local or remote: the same protocol as the in-process
session, without torch or vLLM in this process."""

from .remote import RemoteSession, connect

__all__ = ["RemoteSession", "connect"]
