"""A harvest's corpus: plain text (one document a line), JSONL with a "text" field, or a local Hugging
Face ``datasets`` directory. Read through once before anything is harvested, so that a bad line stops
the harvest before a shard is written, and so that the corpus has a fingerprint a resumed harvest is
checked against."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator


class CorpusError(ValueError):
    """The corpus cannot be read: names the file (and line)."""


@dataclass(frozen=True)
class Corpus:
    path: Path
    kind: str  # "text", "jsonl" or "datasets"
    documents: int
    sha256: str  # of the file's bytes; of a datasets directory, its data files'

    @classmethod
    def open(cls, path) -> "Corpus":
        path = Path(path)
        if not path.exists():
            raise CorpusError(f"{path}: no such file or directory")
        if path.is_dir():
            return _datasets_corpus(path)
        kind = "jsonl" if path.suffix in (".jsonl", ".ndjson") else "text"
        digest, count = hashlib.sha256(), 0
        with path.open("rb") as f:
            for number, line in enumerate(f, 1):
                digest.update(line)
                count += _document(path, kind, number, line) is not None
        if not count:
            raise CorpusError(f"{path} holds no documents")
        return cls(path, kind, count, digest.hexdigest())

    def texts(self) -> Iterator[str]:
        """The documents, in order (empty lines are not documents)."""
        if self.kind == "datasets":
            for batch in _dataset(self.path).select_columns(["text"]).iter(batch_size=1024):
                yield from (text for text in batch["text"] if text and text.strip())
            return
        with self.path.open("rb") as f:
            for number, line in enumerate(f, 1):
                text = _document(self.path, self.kind, number, line)
                if text is not None:
                    yield text


def _document(path: Path, kind: str, number: int, line: bytes) -> str | None:
    try:
        text = line.decode("utf-8-sig" if number == 1 else "utf-8")  # a byte order mark may open the file
    except UnicodeDecodeError as e:
        raise CorpusError(f"{path}, line {number}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not text.strip():
        return None
    if kind == "text":
        return text.rstrip("\r\n")
    try:
        record = json.loads(text)
    except ValueError as e:
        raise CorpusError(f"{path}, line {number}: not JSON ({e})") from None
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise CorpusError(f"{path}, line {number}: a JSON object with a \"text\" field expected")
    return record["text"]


def _dataset(path: Path):
    try:
        import datasets
    except ImportError:
        raise CorpusError(f"{path}: a datasets directory needs the Hugging Face datasets package "
                          "(pip install datasets)") from None
    try:
        data = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds; the message names the problem
        raise CorpusError(f"{path}: not a dataset saved with datasets' save_to_disk ({type(e).__name__}: {e})") from None
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise CorpusError(f"{path}: a dataset with splits {sorted(data)} and no 'train' split")
        data = data["train"]
    if "text" not in data.column_names:
        raise CorpusError(f"{path}: the dataset has no 'text' column (it has {', '.join(data.column_names)})")
    if getattr(data.features["text"], "dtype", None) not in ("string", "large_string"):
        raise CorpusError(f"{path}: the dataset's 'text' column holds {data.features['text']}, not strings")
    return data


def _datasets_corpus(path: Path) -> Corpus:
    data = _dataset(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(file.relative_to(path).as_posix().encode())
        with file.open("rb") as f:
            while block := f.read(1 << 24):
                digest.update(block)
    if not len(data):
        raise CorpusError(f"{path} holds no documents")
    return Corpus(path, "datasets", len(data), digest.hexdigest())
