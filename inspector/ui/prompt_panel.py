"""The prompt dock: prompts (split by the rule chosen above the box, run as one batch), sampling settings,
Compare, Generate and Stop."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtGui import QKeySequence
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDoubleSpinBox, QGridLayout, QHBoxLayout, QLabel,
                               QPlainTextEdit, QProgressBar, QPushButton, QSpinBox, QVBoxLayout, QWidget)

from inspector.core.protocol import Sampling
from inspector.viewer.prompts import PLACEHOLDERS, RULES, describe_split, split_prompts

from .settings import Settings


class PromptPanel(QWidget):
    generateRequested = Signal()
    stopRequested = Signal()

    def __init__(self, settings: Settings, parent=None):
        super().__init__(parent)
        self.settings = settings
        self.prompts = QPlainTextEdit()
        self.prompts.setPlainText("def fibonacci(n):")
        self.prompts.setMaximumHeight(110)
        self.rule_box = QComboBox(toolTip="How the text below becomes prompts (all of them run as one batch)")
        for rule, text in RULES.items():
            self.rule_box.addItem(text, rule)
        self.rule_box.setCurrentIndex(self.rule_box.findData(settings.prompt_rule))
        self.rule_label = QLabel()
        self.rule_label.setStyleSheet("color: rgb(110, 110, 110)")
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
        rule = QHBoxLayout()
        rule.setContentsMargins(0, 0, 0, 0)
        rule.addWidget(self.rule_box)
        rule.addWidget(self.rule_label, 1)
        text = QVBoxLayout()
        text.setContentsMargins(0, 0, 0, 0)
        text.setSpacing(2)
        text.addLayout(rule)
        text.addWidget(self.prompts, 1)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(text, 1)
        layout.addLayout(grid)
        self.generate_button.clicked.connect(self.generateRequested)
        self.stop_button.clicked.connect(self.stopRequested)
        self.rule_box.currentIndexChanged.connect(self._rule_chosen)
        self.prompts.textChanged.connect(self._show_rule)
        self._show_rule()

    def rule(self) -> str:
        return self.rule_box.currentData()

    def prompt_list(self) -> list[str]:
        return split_prompts(self.prompts.toPlainText(), self.rule())

    def _rule_chosen(self, _index: int) -> None:
        self.settings.prompt_rule = self.rule()
        self._show_rule()

    def _show_rule(self) -> None:
        """The rule in force, said where the user types: the placeholder, and what the text gives now."""
        self.prompts.setPlaceholderText(PLACEHOLDERS[self.rule()])
        self.rule_label.setText(describe_split(self.prompt_list(), self.rule()))

    def sampling(self) -> Sampling:
        seed = self.seed.value()
        return Sampling(max_tokens=self.max_tokens.value(), temperature=self.temperature.value(),
                        top_p=self.top_p.value(), seed=None if seed < 0 else seed,
                        ignore_eos=self.ignore_eos.isChecked())
