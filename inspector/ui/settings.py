"""Persistent settings (QSettings, INI format): window geometry/state, colour map, models.

``INSPECTOR_SETTINGS_DIR`` (or ``configure_storage(path)``) moves the storage, so tests and
portable installs never touch the user's real settings.
"""

from __future__ import annotations

import os
from pathlib import Path

from PySide6.QtCore import QByteArray, QSettings

from inspector.core.colormaps import DEFAULT_COLORMAP
from inspector.viewer.prompts import LINES, RULES

ORG = "ActivationInspector"
APP = "inspector"
ENV_VAR = "INSPECTOR_SETTINGS_DIR"
MAX_RECENT = 8


def configure_storage(path: str | os.PathLike | None = None) -> None:
    """INI files everywhere; under ``path`` (or $INSPECTOR_SETTINGS_DIR) when given."""
    QSettings.setDefaultFormat(QSettings.Format.IniFormat)
    path = path or os.environ.get(ENV_VAR)
    if path:
        Path(path).mkdir(parents=True, exist_ok=True)
        QSettings.setPath(QSettings.Format.IniFormat, QSettings.Scope.UserScope, str(path))


class Settings:
    def __init__(self):
        self._q = QSettings(QSettings.Format.IniFormat, QSettings.Scope.UserScope, ORG, APP)

    @property
    def file_name(self) -> str:
        return self._q.fileName()

    def sync(self) -> None:
        self._q.sync()

    # ---- plain values ----
    def _str(self, key: str, default: str = "") -> str:
        v = self._q.value(key, default)
        return default if v is None else str(v)

    def _int(self, key: str, least: int) -> int:
        """A whole number of at least ``least`` (``least`` where unset or not a number)."""
        try:
            return max(least, int(self._str(key, str(least))))
        except ValueError:
            return least

    def _list(self, key: str) -> list[str]:
        v = self._q.value(key, [])
        if v is None or v == "":
            return []
        if isinstance(v, str):
            return [v]
        return [str(x) for x in v]

    @property
    def colormap(self) -> str:
        return self._str("view/colormap", DEFAULT_COLORMAP) or DEFAULT_COLORMAP

    @colormap.setter
    def colormap(self, name: str) -> None:
        self._q.setValue("view/colormap", name)

    @property
    def engine_mode(self) -> str:
        mode = self._str("engine/mode", "compiled")
        return mode if mode in ("compiled", "eager") else "compiled"

    @engine_mode.setter
    def engine_mode(self, mode: str) -> None:
        self._q.setValue("engine/mode", mode)

    @property
    def tensor_parallel_size(self) -> int:
        return self._int("engine/tensor_parallel_size", 1)

    @tensor_parallel_size.setter
    def tensor_parallel_size(self, size: int) -> None:
        self._q.setValue("engine/tensor_parallel_size", str(int(size)))

    @property
    def feature_clamps(self) -> int:
        return self._int("engine/feature_clamps", 0)

    @feature_clamps.setter
    def feature_clamps(self, count: int) -> None:
        self._q.setValue("engine/feature_clamps", str(int(count)))

    @property
    def prompt_rule(self) -> str:
        """How the prompt box's text is split into prompts (a rule of ``inspector.viewer.prompts``)."""
        rule = self._str("prompt/rule", LINES)
        return rule if rule in RULES else LINES

    @prompt_rule.setter
    def prompt_rule(self, rule: str) -> None:
        self._q.setValue("prompt/rule", rule)

    @property
    def last_model(self) -> str:
        return self._str("models/last", "")

    @property
    def recent_models(self) -> list[str]:
        return self._list("models/recent")

    def add_recent_model(self, path: str) -> None:
        path = str(path)
        recent = [p for p in self.recent_models if p != path]
        self._q.setValue("models/recent", [path, *recent][:MAX_RECENT])
        self._q.setValue("models/last", path)

    @property
    def recent_captures(self) -> list[str]:
        return self._list("captures/recent")

    def add_recent_capture(self, path: str) -> None:
        path = str(path)
        recent = [p for p in self.recent_captures if p != path]
        self._q.setValue("captures/recent", [path, *recent][:MAX_RECENT])

    @property
    def last_server(self) -> str:
        return self._str("servers/last", "tcp://127.0.0.1:5557")

    @last_server.setter
    def last_server(self, url: str) -> None:
        self._q.setValue("servers/last", url)

    @property
    def last_dir(self) -> str:
        return self._str("files/last_dir", str(Path.home()))

    @last_dir.setter
    def last_dir(self, path: str) -> None:
        self._q.setValue("files/last_dir", str(path))

    # ---- window ----
    def save_window(self, geometry: QByteArray, state: QByteArray) -> None:
        self._q.setValue("window/geometry", geometry)
        self._q.setValue("window/state", state)

    def window_geometry(self) -> QByteArray | None:
        v = self._q.value("window/geometry")
        return v if isinstance(v, QByteArray) and not v.isEmpty() else None

    def window_state(self) -> QByteArray | None:
        v = self._q.value("window/state")
        return v if isinstance(v, QByteArray) and not v.isEmpty() else None
