"""The app's file dialogs, all starting in one remembered folder: the last one a file or directory was
chosen in (``Settings.last_dir``; at first the user's home), whichever dialog chose it."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtWidgets import QFileDialog, QWidget

from .settings import Settings


def start_folder() -> str:
    """Where the next dialog opens: the remembered folder, or the home directory if it is gone."""
    folder = Settings().last_dir
    return folder if Path(folder).is_dir() else str(Path.home())


def _remember(path: str) -> str:
    if path:
        Settings().last_dir = str(Path(path).parent)
    return path


def open_file(parent: QWidget, title: str, filters: str = "All files (*)") -> str:
    """A file to open ("" if cancelled)."""
    return _remember(QFileDialog.getOpenFileName(parent, title, start_folder(), filters)[0])


def save_file(parent: QWidget, title: str, name: str, filters: str) -> str:
    """Where to write a file, offered as ``name`` in the remembered folder ("" if cancelled)."""
    return _remember(QFileDialog.getSaveFileName(parent, title, str(Path(start_folder()) / name), filters)[0])


def open_directory(parent: QWidget, title: str) -> str:
    """A directory (a model, an SAE) to open ("" if cancelled); the folder holding it is remembered."""
    return _remember(QFileDialog.getExistingDirectory(parent, title, start_folder()))
