"""Help ▸ First Steps (a short page for a new user), the docs of the source checkout (README.md and
docs/, opened with the desktop's viewer) and About."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QObject, Qt, QUrl
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QMessageBox, QTextBrowser, QVBoxLayout

CHECKOUT = Path(__file__).resolve().parents[2]  # README.md and docs/ are here in a source checkout
FIRST_STEPS = """<h3>First steps</h3>
<ol>
<li><b>Open a model</b>: File ▸ Open Model… (a Hugging Face directory), or File ▸ Open Demo Model to try
the app at once. The status bar says when the engine is ready.</li>
<li><b>Tick hook points</b> in the Model dock: the layers' outputs to capture (the filter and the glob box
find them by name). In compiled mode press Apply &amp; restart; in eager mode they apply at once.</li>
<li><b>Generate</b>: type a prompt in the Prompt dock (one per line for a batch) and press Generate
(Ctrl+Enter). The views grow token by token.</li>
<li><b>Read a heatmap</b>: the Heatmap tab shows the selected hook point (the Hook box), tokens across and
features down; hover for a value, click a token to select it in every view. Layers shows every layer at
once, Lens what each layer predicts comes next.</li>
<li><b>Intervene</b>: in the Interventions dock press Add and set the row's Scale or Bias (a new row does
nothing until then); it applies from the next forward, even mid-generation. Tick Compare beside Generate
to run each prompt clean and intervened side by side (Compare tab).</li>
<li><b>Export</b>: File ▸ Export… writes the run to an HDF5 file; File ▸ Open Capture… shows it again
later, without a model.</li>
</ol>
<p>More: Help ▸ README and Help ▸ Docs open the documentation of the source checkout ({where}).</p>"""


def doc_files(root: Path = CHECKOUT) -> list[tuple[str, Path]]:
    """(title, file) of the checkout's docs: the README, then docs/*.md but for the dated run reports."""
    readme = root / "README.md"
    docs = sorted(p for p in (root / "docs").glob("*.md") if not p.name.startswith("gpu-run"))
    return [("README", readme)] * readme.is_file() + [(p.stem.replace("-", " ").capitalize(), p) for p in docs]


class HelpMenu(QObject):
    """A QObject child of the window: the signals it is connected to never outlive it."""

    def __init__(self, window, menu):
        super().__init__(window)
        self.window = window
        self.first_steps: QDialog | None = None
        menu.addAction("&First Steps…", self.show_first_steps)
        docs = doc_files()
        self.readme_action = menu.addAction("&README")
        self.readme_action.setEnabled(bool(docs) and docs[0][0] == "README")
        if self.readme_action.isEnabled():
            self.readme_action.setData(str(docs.pop(0)[1]))
        self.docs_menu = menu.addMenu("&Docs")
        for title, path in docs:
            self.docs_menu.addAction(title).setData(str(path))
        self.docs_menu.setEnabled(bool(docs))
        menu.triggered.connect(self._doc_triggered)
        menu.addSeparator()
        menu.addAction("&About", self.about)

    def _doc_triggered(self, action) -> None:
        if action.data():
            QDesktopServices.openUrl(QUrl.fromLocalFile(action.data()))

    def show_first_steps(self) -> QDialog:
        if self.first_steps is None:
            dialog = self.first_steps = QDialog(self.window, windowTitle="First Steps")
            text = QTextBrowser(openExternalLinks=True)
            where = CHECKOUT if (CHECKOUT / "README.md").is_file() else "not found next to the installed app"
            text.setHtml(FIRST_STEPS.format(where=where))
            buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
            buttons.rejected.connect(dialog.reject)
            layout = QVBoxLayout(dialog)
            layout.addWidget(text)
            layout.addWidget(buttons)
            dialog.resize(620, 520)
            dialog.setWindowModality(Qt.WindowModality.NonModal)
        self.first_steps.show()
        return self.first_steps

    def about(self) -> None:
        QMessageBox.about(self.window, "About Activation Inspector",
                          "<b>Activation Inspector</b><br>Look inside an LLM while vLLM serves it.<br>"
                          "New here? Help ▸ First Steps.")
