"""The desktop app, as ``inspector`` starts it without a command (or with ``app``): the window is given its
session factory here, by default a server of its own in a child process (``--connect URL``: a remote one;
``--in-process``: the engine in this process), so that ``inspector.ui`` never imports the engine."""

from __future__ import annotations

from .engine_options import engine_session


def launch(argv: list[str]) -> int:
    from inspector.client.local import start_local_server
    from inspector.ui.app import main as app_main

    return app_main(argv[1:] if argv[:1] == ["app"] else argv, start_local_server, engine_session)
