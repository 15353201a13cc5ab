"""The window's menu bar: its actions, the recent models and captures, the earlier runs, and the dialogs
its items open (each hands what the user chose to the window)."""

from __future__ import annotations

from PySide6.QtCore import QObject
from PySide6.QtGui import QKeySequence
from PySide6.QtWidgets import QInputDialog, QMessageBox

from .connect_dialog import ConnectDialog
from .file_dialogs import open_directory, open_file, save_file
from .help_menu import HelpMenu


class Menus(QObject):
    """A QObject child of the window: the signals it is connected to never outlive it."""

    def __init__(self, window):
        super().__init__(window)
        self.window = w = window
        m = w.menuBar().addMenu("&File")
        self.act_open_model = m.addAction("Open &Model…", self.open_model_dialog, QKeySequence("Ctrl+M"))
        self.act_demo = m.addAction("Open &Demo Model", self._open_demo)
        self.act_connect = m.addAction("Co&nnect to Server…", self.connect_dialog)
        self.recent_models_menu = m.addMenu("Recent Models")
        self.recent_models_menu.triggered.connect(self._recent_model_triggered)
        m.addSeparator()
        m.addAction("Open &Capture…", self.open_capture_dialog, QKeySequence.StandardKey.Open)
        self.recent_captures_menu = m.addMenu("Recent Captures")
        self.recent_captures_menu.triggered.connect(self._recent_capture_triggered)
        m.addAction("Open S&can…", self.open_scan_dialog)
        m.addAction("&Watch an OpenAI Server…", self.watch_served_dialog)
        m.addAction("&Export…", self.export_dialog, QKeySequence("Ctrl+E"))
        m.addSeparator()
        self.act_new_run = m.addAction("&New Run", w.controller.runs.new_run)
        m.addSeparator()
        m.addAction("&Quit", w.close, QKeySequence.StandardKey.Quit)
        e = w.menuBar().addMenu("&Engine")
        self.act_restart = e.addAction("&Restart Engine", w.restart_engine)
        self.act_stop = e.addAction("&Stop Generation", w.controller.generating.stop)
        e.addAction("&Tensor Parallel Size…", self.choose_tensor_parallel_size)
        e.addAction("Room for &Feature Clamps…", self.choose_feature_clamps)
        e.addSeparator()
        self.act_attach_sae = e.addAction("Attach &SAE…", self.attach_sae_dialog)
        self.act_attach_demo_sae = e.addAction("Attach &Demo SAE", w.attach_demo_sae)
        self.act_attach_demo_sae.setToolTip("The SAE shipped for the demo model, its features labelled by a scan")
        v = w.menuBar().addMenu("&View")
        v.addAction("Show &Live Run", w.show_live)
        self.earlier_menu = v.addMenu("Earlier Runs")
        self.earlier_menu.triggered.connect(self._earlier_triggered)
        v.addSeparator()
        for dock in (w.tree_dock, w.interventions_dock, w.prompt_dock):
            v.addAction(dock.toggleViewAction())
        self.help = HelpMenu(w, w.menuBar().addMenu("&Help"))
        self.rebuild_recent()
        self.rebuild_runs()

    # Slots are bound methods returning None: never lambdas capturing the window (PySide keeps them alive
    # past the window, and the interpreter's exit then deletes Qt objects in an order Qt cannot handle).
    def _open_demo(self, *_) -> None:
        self.window.open_model("demo")

    def _recent_model_triggered(self, action) -> None:
        self.window.open_model(action.data())

    def _recent_capture_triggered(self, action) -> None:
        self.window.open_capture(action.data())

    def _earlier_triggered(self, action) -> None:
        runs = self.window.controller.runs
        runs.show(runs.earlier[action.data()])

    def choose_tensor_parallel_size(self) -> None:
        w = self.window
        size, ok = QInputDialog.getInt(
            w, "Tensor Parallel Size", "Split the model over this many GPUs (vLLM's tensor parallelism; on a\n"
            "CPU, as many groups of cores). It applies when a model is opened or the engine restarts.",
            w.settings.tensor_parallel_size, 1, 64)
        if ok:
            w.set_tensor_parallel_size(size)

    def choose_feature_clamps(self) -> None:
        w = self.window
        count, ok = QInputDialog.getInt(
            w, "Room for Feature Clamps", "How many SAE features may be clamped to a value at once, per hook\n"
            "(Features tab ▸ Steer ▸ clamp to). The room costs every forward of a compiled engine\n"
            "(a few percent of a decode step); 0: none. It applies when a model is opened or the engine restarts.",
            w.settings.feature_clamps, 0, 64)
        if ok:
            w.settings.feature_clamps = count
            w.status(f"Room for {count} feature clamps per hook: applies when a model is opened or the engine "
                     "restarts", 8000)

    def open_model_dialog(self) -> None:
        path = open_directory(self.window, "Open Model (a Hugging Face directory)")
        if path:
            self.window.open_model(path)

    def connect_dialog(self) -> None:
        w = self.window
        dialog = ConnectDialog(w.settings.last_server, w)
        dialog.accepted.connect(self._connect_accepted)
        dialog.open()

    def _connect_accepted(self) -> None:
        dialog = self.sender()
        self.window.connect(dialog.url.text().strip(), dialog.keys)

    def server_unreachable(self, url: str, reason: str) -> None:
        """Engine ▸ Restart Engine while the server is gone: connect to it again, or choose another."""
        why = reason if url in reason else f"the server at {url} is unreachable ({reason})"
        box = QMessageBox(QMessageBox.Icon.Warning, "Server unreachable",
                          f"Cannot restart the engine: {why}.\n\nEverything captured so far is kept. Reconnect once "
                          "the server is back, or choose another server.", QMessageBox.StandardButton.Cancel, self.window)
        box.setDefaultButton(box.addButton("Reconnect", QMessageBox.ButtonRole.AcceptRole))
        box.addButton("Other Server…", QMessageBox.ButtonRole.ActionRole)
        box.buttonClicked.connect(self._unreachable_answered)
        self.window.show_box(box)

    def _unreachable_answered(self, button) -> None:
        role = self.sender().buttonRole(button)
        if role is QMessageBox.ButtonRole.AcceptRole:
            self.window.controller.engine.reconnect()
        elif role is QMessageBox.ButtonRole.ActionRole:
            self.connect_dialog()

    def attach_sae_dialog(self) -> None:
        path = open_directory(self.window, "Attach SAE (a SAELens directory)")
        if path:
            self.window.attach_sae(path)

    def open_capture_dialog(self) -> None:
        path = open_file(self.window, "Open Capture", "Captures (*.h5 *.hdf5);;All files (*)")
        if path:
            self.window.open_capture(path)

    def watch_served_dialog(self) -> None:
        w = self.window
        url, ok = QInputDialog.getText(w, "Watch an OpenAI Server",
                                       "The address of `inspector serve --openai` (its requests that ask for\n"
                                       "inspector_capture are shown as they arrive):",
                                       text=w.controller.runs.served.url if w.controller.runs.served else
                                       "http://127.0.0.1:8000")
        if ok and url.strip():
            w.watch_served(url)

    def open_scan_dialog(self) -> None:
        path = open_file(self.window, "Open Scan", "Scans (*.h5 *.hdf5);;All files (*)")
        if path:
            self.window.open_scan(path)

    def export_dialog(self) -> None:
        path = save_file(self.window, "Export Run (HDF5)", "capture.h5", "Captures (*.h5)")
        if path:
            self.window.export(path if path.endswith((".h5", ".hdf5")) else path + ".h5")

    def rebuild_recent(self) -> None:
        w = self.window
        for menu, paths in ((self.recent_models_menu, w.settings.recent_models),
                            (self.recent_captures_menu, w.settings.recent_captures)):
            menu.clear()
            for path in paths:
                menu.addAction(path).setData(path)
            menu.setEnabled(bool(paths))

    def rebuild_runs(self) -> None:
        earlier = self.window.controller.runs.earlier
        self.earlier_menu.clear()
        for i, view in enumerate(earlier):
            self.earlier_menu.addAction(f"{view.label}: {len(view.request_ids())} request(s)").setData(i)
        self.earlier_menu.setEnabled(bool(earlier))
