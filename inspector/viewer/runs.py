"""The runs there are and the one on show: the live run, earlier models' runs, a reopened capture file,
an OpenAI server's captures; a corpus scan for the Dashboard; exporting the run on show.
"""

from __future__ import annotations

import functools
from pathlib import Path

from . import jobs, served
from .app_state import Action, ControllerPart, details_of
from .dashboard import ScanDashboard, open_dashboard
from .feature_labels import LabelBook
from .jobs import Cancelled, TaskState
from .labels import hook_sort_key
from .run_view import RunSource, RunView


class Runs(ControllerPart):
    def __init__(self, app):
        super().__init__(app)
        self.files = app.file_tasks
        self.live = RunView.live({}, {})
        self.shown = self.live
        self.earlier: list[RunView] = []  # live runs of models opened before this one
        self.run_file = None  # the open capture file behind a shown FILE run (inspector.io.RunFile)
        self.labels = LabelBook()  # the features' labels of every SAE shown
        self.scan: ScanDashboard | None = None  # the scan the Dashboard shows
        self.served: served.ServedRun | None = None  # the OpenAI server whose captures are watched
        self._served_task: TaskState | None = None
        self.last_export: str | None = None
        self._export_task: TaskState | None = None

    def show(self, view: RunView) -> None:
        self.shown = view
        self.view.shown_changed()

    def new_run(self) -> None:
        if not self.engine.enabled(Action.NEW_RUN):
            return
        if self.live.total_rows():
            self.view.ask("Start a new run?", "The captures of the current run are dropped (export them first "
                          "to keep them).", self._new_run)
        else:
            self._new_run()

    def _new_run(self) -> None:
        if self.engine.session is not None:
            self.app.engine_tasks.start(jobs.new_run, self.engine.session)
        info, dropped = self.engine.info, self.live
        self.live = RunView.live(info.metadata, info.installed, list(info.catalogue)) if info else RunView.live({}, {})
        self.show(self.live)
        dropped.close()

    def open_capture(self, path: str) -> bool:
        """Reopen an .h5 capture without any model or engine; values stay on disk until viewed."""
        from inspector.io import open_run

        try:
            run_file = open_run(path)
        except Exception as exc:  # noqa: BLE001 - CaptureFileError and anything unexpected: a dialog
            self.view.error(f"Cannot open the capture.\n\n{exc}", title="Open Capture")
            return False
        if self.run_file is not None:
            self.run_file.close()
        self.run_file = run_file
        self.shown = RunView(run_file.run, RunSource.FILE, str(path),
                             sorted(run_file.run.hooks.values(), key=hook_sort_key))
        self.view.capture_opened(str(path))
        self.view.shown_changed()
        self.view.status(f"Opened {path}: {len(run_file.run.requests)} request(s), "
                         f"{len(run_file.run.hooks)} hook point(s).", 8000)
        return True

    def watch_served(self, url: str) -> None:
        """Show the captures of an OpenAI server (``inspector serve --openai``) as they arrive: its
        requests that asked for rows, read while they run and again once they end (a watch of another
        server stops)."""
        self.stop_watching()
        self.served = served.ServedRun(url.strip().rstrip("/"))
        self.show(RunView(self.served.run, RunSource.SERVED, f"OpenAI server {self.served.url}"))
        self.view.status(f"Watching {self.served.url} for captures (requests with inspector_capture)…")
        self._look_at_served()

    def stop_watching(self) -> None:
        if self._served_task is not None:
            self._served_task.cancel()
        self._served_task, self.served = None, None

    def _look_at_served(self) -> None:
        watched = self.served
        self._served_task = self.files.start(
            served.look, watched.url, watched.seen, on_done=functools.partial(self._served_news, watched),
            on_exception=functools.partial(self._served_failed, watched))

    def _served_news(self, watched: served.ServedRun, captures: list[served.ServedCapture]) -> None:
        if watched is not self.served:  # stopped, or another server watched since
            return
        new = [c for c in captures if not any(r.startswith(c.id + "/") for r in watched.run.requests)]
        for capture in captures:
            watched.add(capture)
        if captures:  # a new view of the run (its requests changed): the selection stays, or goes to the newest
            shown = self.shown.run is watched.run
            view = RunView(watched.run, RunSource.SERVED, f"OpenAI server {watched.url}")
            if shown:
                view.selection = self.shown.selection
            if new or view.selection.request not in watched.run.requests:
                view.selection.request = next(reversed(watched.run.requests), None)
                hooks = view.hooks_for(view.selection.request)
                view.selection.hook = view.selection.hook if view.selection.hook in {h.name for h in hooks} else (
                    hooks[0].name if hooks else None)
            if shown:
                self.show(view)
                self.view.status(f"{watched.url}: {len(watched.run.requests)} captured request(s), "
                                 f"{len(watched.running)} running")
        self._look_at_served()

    def _served_failed(self, watched: served.ServedRun, exc: BaseException) -> None:
        if watched is not self.served:
            return
        self.stop_watching()
        self.view.error(f"Stopped watching {watched.url}.\n\n{exc}", details_of(exc), title="Watch an OpenAI Server")

    def open_scan(self, path: str) -> bool:
        """Show the corpus scan in ``path`` on the Dashboard; its top tokens label its SAE's features
        everywhere (the SAE's labels.json, if any, over them)."""
        try:
            scan = open_dashboard(path)
        except (OSError, ValueError) as exc:  # CaptureFileError among them: the message is the reason
            self.view.error(f"Cannot open the scan.\n\n{exc}", title="Open Scan")
            return False
        if scan.sae_path:
            self.labels.add_scan(scan.sae_path, path, scan.names)
            scan.set_names(self.labels.for_sae(scan.sae_path).names)
        self.scan = scan
        self.view.scan_opened(str(path))
        self.view.status(f"Opened the scan {path}: {len(scan.units)} of {scan.state.units} units active.", 8000)
        return True

    def export(self, path: str) -> bool:
        """Write the shown run to ``path`` off the GUI thread, with progress."""
        if self._export_task is not None:
            self.view.error("An export is already running.", title="Export")
            return False
        if not self.shown.run.requests:
            self.view.error("Nothing to export yet: generate first (or open a capture).", title="Export")
            return False
        self._export_task = self.files.start(jobs.export, self.shown.snapshot(), path,
                                             on_progress=self.view.export_progress, on_done=self._exported,
                                             on_exception=self._export_failed)
        self.view.export_progress(0.0)
        return True

    @property
    def exporting(self) -> bool:
        return self._export_task is not None

    def cancel_export(self) -> None:
        if self._export_task is not None:
            self._export_task.cancel()

    def _exported(self, path: Path) -> None:
        self._export_task = None
        self.last_export = str(path)
        self.view.export_progress(None)
        self.view.status(f"Exported to {path}", 10000)

    def _export_failed(self, exc: BaseException) -> None:
        self._export_task = None
        self.view.export_progress(None)
        if isinstance(exc, Cancelled):
            self.view.status("Export cancelled; nothing was written.", 6000)
        else:
            self.view.error(f"Export failed; nothing was written.\n\n{exc}", title="Export")

    def keep_live_as_earlier(self) -> None:
        kept = self.live
        kept.source = RunSource.EARLIER
        kept.label = f"{Path(str(kept.run.metadata.get('model_path', 'model'))).name} (earlier run)"
        self.earlier.append(kept)
        self.live = RunView.live({}, {})
        if self.shown is kept:
            self.shown = self.live
        self.view.shown_changed()
        self.view.status(f"The run captured with {kept.label.removesuffix(' (earlier run)')} is kept under "
                         "View ▸ Earlier Runs (export it to keep it on disk).", 10000)

    def close(self) -> None:
        """The app closes: the runs' scratch files go, the open capture file closes."""
        for view in (self.live, *self.earlier):
            view.close()
        if self.run_file is not None:
            self.run_file.close()
            self.run_file = None
