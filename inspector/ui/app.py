"""``inspector`` (the GUI): ``main(argv, session_factory)`` creates the QApplication and the window,
then boots a model through ``session_factory`` (``inspector.cli`` passes the in-process engine).

    inspector                      # opens the window at once, boots the built-in demo model
    inspector PATH                 # a Hugging Face model directory, or an .h5 capture to reopen
    inspector --model PATH --mode eager --hooks 'blocks.*.hook_resid_post,blocks.*.hook_mlp_out'
    inspector --capture run.h5 --no-model
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from inspector.core.protocol import SessionFactory
from inspector.core.resources import icon_path


_collector = None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="inspector [app]", description="The desktop app: look inside an LLM while "
                                "vLLM serves it. (Headless: inspector capture|hooks --help.)")
    p.add_argument("path", nargs="?", help="a model directory to boot, or an .h5 capture to open")
    p.add_argument("--model", help='model directory, or "demo" (default: the built-in demo model)')
    p.add_argument("--mode", choices=("compiled", "eager"), help="engine mode (default: the last one used)")
    p.add_argument("--hooks", help="comma-separated hook names, aliases or globs to capture at boot")
    p.add_argument("--tensor-parallel-size", type=int, metavar="N",
                   help="split the model over N GPUs (default: the last one chosen, Engine ▸ Tensor Parallel Size)")
    p.add_argument("--capture", help="an .h5 capture to open")
    p.add_argument("--no-model", action="store_true", help="do not boot any model")
    p.add_argument("--settings-dir", help="keep settings in this directory (also $INSPECTOR_SETTINGS_DIR)")
    p.add_argument("--connect", metavar="URL", help="use the engine of an inspector server instead of one of its own")
    p.add_argument("--client-key", help="with --connect: your key pair (NAME.key_secret), for a server with keys")
    p.add_argument("--server-key", help="with --connect: the server's public key (server.key)")
    p.add_argument("--in-process", action="store_true",
                   help="run the engine in the app's own process (for comparisons; the default is a child server)")
    return p


def _install_excepthook(window_getter) -> None:
    """Unexpected exceptions in slots become a dialog; the app keeps running."""
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        previous(exc_type, exc, tb)  # the traceback still goes to stderr (and to test harnesses)
        window = window_getter()
        if window is not None and not issubclass(exc_type, KeyboardInterrupt):
            try:
                text = "".join(traceback.format_exception(exc_type, exc, tb))
                window.error(f"Unexpected error: {exc_type.__name__}: {exc}\n\nThe app keeps running; "
                              "please report this.", text, title="Internal error")
            except Exception:  # noqa: BLE001
                pass

    sys.excepthook = hook


def gui_environment() -> None:
    """Engine defaults for an engine next to a GUI (in this process, or the app's child server, which
    inherits them); the user's own settings win.

    The CPU backend's OpenMP threads spin at barriers: with one per core, the GUI thread has to
    preempt one of them whenever it paints, and every engine step waits for it. So leave one core
    to the GUI (figures: docs/performance-notes.md)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores - 1)))
    # The in-process engine thread runs Python between forwards; a thread waiting for the GIL waits up
    # to the switch interval (5 ms by default) each time, and a repaint needs the GIL many times.
    sys.setswitchinterval(float(os.environ.get("INSPECTOR_SWITCH_INTERVAL", "0.001")))


def create_app(argv: list[str] | None = None):
    """The QApplication, with garbage collection moved to the GUI thread: a collection that runs on
    another thread (the engine's, a socket's) and finds a Qt object in a cycle deletes it there, and Qt
    crashes. What exists by then (modules, the Qt bindings, pyqtgraph) lives as long as the app, so it
    is frozen out of the collector's scans: a full collection over it blocked the GUI for ~20 ms."""
    global _collector
    import gc

    import numpy.ma  # noqa: F401 - np.percentile imports it lazily: ~35 ms in the first live frame
    import pyqtgraph  # noqa: F401 - imported before the freeze
    from PySide6.QtWidgets import QApplication
    from pyqtgraph.util.garbage_collector import GarbageCollector

    app = QApplication.instance() or QApplication([sys.argv[0] if sys.argv else "inspector", *(argv or [])])
    _collector = _collector or GarbageCollector(interval=0.1)  # often, so each collection is short
    gc.freeze()
    app.setOrganizationName("ActivationInspector")
    app.setApplicationName("inspector")
    app.setApplicationDisplayName("Activation Inspector")
    from PySide6.QtGui import QIcon

    for size in (0, 256):
        icon = icon_path(size)
        if icon.is_file():
            app.setWindowIcon(QIcon(str(icon)))
            break
    return app


def main(argv: list[str], session_factory: SessionFactory, in_process: SessionFactory | None = None) -> int:
    """The app; ``argv`` excludes the program name. ``session_factory`` makes its engines (``in_process``
    instead with --in-process)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    keys = None
    if args.tensor_parallel_size is not None and args.tensor_parallel_size < 1:
        parser.error(f"--tensor-parallel-size must be at least 1, got {args.tensor_parallel_size}")
    if bool(args.client_key) != bool(args.server_key) or (args.client_key and not args.connect):
        parser.error("--connect with both --client-key and --server-key, or without keys")
    if args.client_key:
        from inspector.net.keys import client_keys

        try:
            keys = client_keys(args.client_key, args.server_key)
        except ValueError as e:
            parser.error(str(e))
    from .settings import configure_storage

    if args.settings_dir:
        os.environ["INSPECTOR_SETTINGS_DIR"] = args.settings_dir
    configure_storage()
    gui_environment()
    app = create_app()
    import pyqtgraph as pg

    pg.setConfigOptions(antialias=False, imageAxisOrder="col-major")
    from .main_window import MainWindow

    window = MainWindow(in_process if args.in_process and in_process else session_factory)
    if args.tensor_parallel_size is not None:
        window.settings.tensor_parallel_size = args.tensor_parallel_size
    previous_hook = sys.excepthook
    _install_excepthook(lambda: window)
    window.show()

    model, capture = args.model, args.capture
    if args.path:
        if args.path.endswith((".h5", ".hdf5")):
            capture = capture or args.path
        else:
            model = model or args.path
    hooks = [h.strip() for h in args.hooks.split(",") if h.strip()] if args.hooks else None
    if capture:
        window.open_capture(capture)
    if args.connect:
        window.connect(args.connect, keys)
    elif not args.no_model and not (capture and not model):
        window.open_model(model or "demo", mode=args.mode, hooks=hooks)
    elif args.mode:
        window.tree.set_mode(args.mode)
    try:
        return app.exec()
    finally:
        sys.excepthook = previous_hook
        if window.isVisible():  # app.quit() from elsewhere: still save settings and stop the engine
            window.close()
