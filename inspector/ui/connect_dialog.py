"""File ▸ Connect to Server…: a server's address, and the key files when the server wants keys."""

from __future__ import annotations

from PySide6.QtWidgets import (QDialog, QDialogButtonBox, QFormLayout, QHBoxLayout, QLabel, QLineEdit,
                               QPushButton, QWidget)

from inspector.net.keys import ClientKeys, client_keys

from .file_dialogs import open_file

DEFAULT_URL = "tcp://127.0.0.1:5557"


class ConnectDialog(QDialog):
    def __init__(self, url: str = DEFAULT_URL, parent=None):
        super().__init__(parent)
        self.setWindowTitle("Connect to Server")
        self.url = QLineEdit(url, placeholderText="tcp://HOST:PORT or ipc://PATH")
        self.client_key = QLineEdit(placeholderText="NAME.key_secret (only for a server with keys)")
        self.server_key = QLineEdit(placeholderText="server.key (only for a server with keys)")
        self.problem = QLabel("")
        self.problem.setWordWrap(True)
        self._browsed: dict[QPushButton, QLineEdit] = {}
        form = QFormLayout(self)
        form.addRow("Server", self.url)
        form.addRow("Your key pair", self._with_browse(self.client_key, "Your key pair (NAME.key_secret)"))
        form.addRow("Server's key", self._with_browse(self.server_key, "The server's public key (server.key)"))
        form.addRow(QLabel("A server on another machine: reach it through an SSH tunnel to its 127.0.0.1 port, "
                           "or with the key files its owner made (docs/serving.md: Use a GPU server).", wordWrap=True))
        form.addRow(self.problem)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self._accept)
        buttons.rejected.connect(self.reject)
        form.addRow(buttons)
        self.keys: ClientKeys | None = None

    def _with_browse(self, edit: QLineEdit, title: str) -> QWidget:
        row = QWidget()
        layout = QHBoxLayout(row)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(edit, 1)
        browse = QPushButton("Browse…", toolTip=title)
        browse.clicked.connect(self._browse)
        layout.addWidget(browse)
        self._browsed[browse] = edit
        return row

    def _browse(self) -> None:
        button = self.sender()
        path = open_file(self, button.toolTip())
        if path:
            self._browsed[button].setText(path)

    def _accept(self) -> None:
        if self.check():
            self.accept()

    def check(self) -> bool:
        """Whether the entries make a connection (the reason shows if not)."""
        url, client, server = (e.text().strip() for e in (self.url, self.client_key, self.server_key))
        try:
            if not url.startswith(("tcp://", "ipc://")):
                raise ValueError("the server's address starts with tcp:// or ipc://")
            if bool(client) != bool(server):
                raise ValueError("give both key files, or neither")
            self.keys = client_keys(client, server) if client else None
        except ValueError as e:
            self.problem.setText(f"<span style='color:#b01e1e'>{e}</span>")
            return False
        return True
