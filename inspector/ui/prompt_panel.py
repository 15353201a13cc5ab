"""The prompt dock: prompts (one per line, run as one batch), sampling settings, Compare, Generate and Stop."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtGui import QKeySequence
from PySide6.QtWidgets import (QCheckBox, QDoubleSpinBox, QGridLayout, QHBoxLayout, QLabel, QPlainTextEdit,
                               QProgressBar, QPushButton, QSpinBox, QWidget)

from inspector.capture.protocol import Sampling


class PromptPanel(QWidget):
    generateRequested = Signal()
    stopRequested = Signal()

    def __init__(self, parent=None):
        super().__init__(parent)
        self.prompts = QPlainTextEdit()
        self.prompts.setPlaceholderText("One prompt per line; several lines run as one batch. Ctrl+Enter generates.")
        self.prompts.setPlainText("def fibonacci(n):")
        self.prompts.setMaximumHeight(110)
        self.max_tokens = QSpinBox(minimum=1, maximum=100_000, value=32, toolTip="Tokens to generate per prompt")
        self.temperature = QDoubleSpinBox(minimum=0.0, maximum=5.0, value=0.0, singleStep=0.1, decimals=2,
                                          toolTip="0 = greedy")
        self.top_p = QDoubleSpinBox(minimum=0.01, maximum=1.0, value=1.0, singleStep=0.05, decimals=2)
        self.seed = QSpinBox(minimum=-1, maximum=2 ** 31 - 1, value=-1, toolTip="-1: random")
        self.seed.setSpecialValueText("random")
        self.ignore_eos = QCheckBox("Ignore EOS", toolTip="Always generate max tokens, past end-of-sequence")
        self.compare = QCheckBox("Compare", toolTip=(
            "Run each prompt twice in one batch with one seed, once clean and once with the interventions "
            "(changes while it generates reach the intervened run only); the Compare tab sets them side by side"))
        self.generate_button = QPushButton("Generate")
        self.generate_button.setShortcut(QKeySequence("Ctrl+Return"))
        self.stop_button = QPushButton("Stop", enabled=False)
        self.stop_button.setShortcut(QKeySequence("Escape"))
        self.progress = QProgressBar()
        self.progress.setFormat("%v / %m tokens")
        self.progress.setVisible(False)
        grid = QGridLayout()
        grid.setContentsMargins(0, 0, 0, 0)
        for i, (label, w) in enumerate((("Max tokens", self.max_tokens), ("Temperature", self.temperature),
                                        ("Top-p", self.top_p), ("Seed", self.seed))):
            grid.addWidget(QLabel(label), i // 2, (i % 2) * 2)
            grid.addWidget(w, i // 2, (i % 2) * 2 + 1)
        buttons = QHBoxLayout()
        buttons.addWidget(self.compare)
        buttons.addWidget(self.generate_button, 1)
        buttons.addWidget(self.stop_button, 1)
        grid.addWidget(self.ignore_eos, 2, 0, 1, 2)
        grid.addLayout(buttons, 3, 0, 1, 4)
        grid.addWidget(self.progress, 4, 0, 1, 4)
        self.prompts.setMinimumWidth(120)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.prompts, 1)
        layout.addLayout(grid)
        self.generate_button.clicked.connect(self.generateRequested)
        self.stop_button.clicked.connect(self.stopRequested)

    def prompt_list(self) -> list[str]:
        return [line for line in self.prompts.toPlainText().splitlines() if line.strip()]

    def sampling(self) -> Sampling:
        seed = self.seed.value()
        return Sampling(max_tokens=self.max_tokens.value(), temperature=self.temperature.value(),
                        top_p=self.top_p.value(), seed=None if seed < 0 else seed,
                        ignore_eos=self.ignore_eos.isChecked())
