"""``inspector serve``: one engine in its own process, shared by clients over ZeroMQ (docs/protocol.md)."""
