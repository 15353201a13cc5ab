"""An HDF5 file that appears under its name only once it is finished: written as a hidden temp file
beside the target and renamed onto it (atomically) at the end, so that an abort, an error, a full disk
or a crash never leaves a file under the target's name. Any I/O error removes the temp file and raises
``CaptureFileError``. The capture writer builds on it; the rules live here, apart from what it writes.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path

import h5py

from .format import CaptureFileError, os_reason
from .latching_file import LatchingFile


# HDF5's paged file space: metadata is kept in pages and written a page at a time, instead of in
# thousands of small writes between the chunks (6,415 in a batch-32 capture of 32 hooks), which kept the
# chunks' writes from being joined into one call (``WriteBehind``: 8,380 calls became 558 there). Raw
# chunks of a page or more (a capture's are about 256 KiB) bypass the page buffer. Small pages keep a
# small file small: a file takes at least two.
PAGE_BYTES = 64 << 10
PAGE_BUFFER_BYTES = 32 << 20


def _cannot_create(path: Path, reason: str) -> CaptureFileError:
    return CaptureFileError(f"cannot create capture file {path}: {reason}", path, reason)


def check_target(path: str | os.PathLike) -> None:
    """Raise CaptureFileError if a capture file cannot be created at ``path`` (checked before a long
    generation, so that it is not lost for a typo)."""
    final = Path(os.path.abspath(os.fspath(path)))
    parent = final.parent
    if final.is_dir():
        raise _cannot_create(final, "a directory of that name exists")
    if not parent.exists():
        raise _cannot_create(final, f"the directory {parent} does not exist")
    if not parent.is_dir():
        raise _cannot_create(final, f"{parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise _cannot_create(final, f"the directory {parent} is not writable")


class FinishedOrDropped:
    """A file being written, as a ``with`` block: finished (``close``) if the block ends well, else
    dropped (``abort``), so that no half-written file is left under its name."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.close()
        else:
            self.abort()
        return False


class AtomicFile(FinishedOrDropped):
    """The temp file's life: ``_create_temp`` (in the subclass's constructor, once its arguments are
    checked), writes inside ``_guard``, then ``_finish`` (rename onto ``path``) or ``abort``.
    ``_file`` is the open ``h5py.File`` while the state is "open"."""

    def __init__(self, path: str | os.PathLike, fsync: bool):
        self._state = "init"
        self._file = None
        self._io: LatchingFile | None = None
        self._tmp: Path | None = None
        self.path = Path(os.path.abspath(os.fspath(path)))
        self._fsync = fsync

    def _create_temp(self) -> None:
        final, parent = self.path, self.path.parent

        def fail(reason: str, exc: BaseException | None = None):
            raise _cannot_create(final, reason) from exc

        check_target(final)
        tmp = parent / f".{final.name}.{secrets.token_hex(4)}.partial"
        try:
            self._io = LatchingFile(tmp)
        except OSError as exc:
            fail(os_reason(exc), exc)
        self._tmp = tmp
        try:
            # no chunk cache: full chunks go straight to disk instead of piling up, dirty, per dataset;
            # metadata in pages (``PAGE_BYTES``), written as whole pages when evicted or at the end
            self._file = h5py.File(self._io, "w", rdcc_nbytes=0, libver=("v110", "v110"), fs_strategy="page",
                                   fs_page_size=PAGE_BYTES, page_buf_size=PAGE_BUFFER_BYTES)
            _widen_metadata_cache(self._file)
            error = self._io.error
        except Exception as exc:  # noqa: BLE001 - any failure here means "cannot create"
            error = self._io.error or exc  # the latched OS error (e.g. disk full) says more than HDF5's
        if error is not None:
            self._discard()
            fail(os_reason(error), error)
        self._state = "open"

    def _drop_datasets(self) -> None:
        """Let go of every h5py object the subclass holds, so that the file can close."""

    def _discard(self) -> None:
        """Close and delete the temp file; safe after failed writes (see LatchingFile)."""
        if self._io is not None:
            self._io.discard()  # from now on HDF5 writes into memory: closing cannot fail
        self._drop_datasets()
        if self._file is not None:
            try:
                self._file.close()
            except Exception:  # noqa: BLE001 - already failing; the temp file goes anyway
                pass
            self._file = None
        if self._io is not None:
            self._io.close()
            self._io = None
        if self._tmp is not None:
            try:
                os.unlink(self._tmp)
            except OSError:
                pass

    def _check_open(self) -> None:
        if self._state != "open":
            what = {"closed": "closed", "aborted": "aborted", "failed": "stopped after an earlier error"}
            reason = f"the writer was {what.get(self._state, self._state)}"
            raise CaptureFileError(f"cannot write {self.path}: {reason}", self.path, reason)

    def _fail(self, error: BaseException, doing: str, cause: BaseException | None = None):
        reason = os_reason(error)
        if not re.search(r"space|too large|quota", reason):
            try:
                if shutil.disk_usage(self.path.parent).free == 0:
                    reason = f"no space left on device ({reason})"
            except OSError:
                pass
        self._discard()
        self._state = "failed"
        raise CaptureFileError(f"{reason} while writing {self.path} ({doing}); nothing was saved",
                               self.path, reason) from (cause or error)

    @contextmanager
    def _guard(self, doing: str):
        """Run file operations; any error (raised, or latched by the file object) removes the temp file."""
        self._check_open()
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - any error leaves the file unusable: remove it
            latched = self._io.error if self._io is not None else None
            self._fail(latched or exc, doing, exc)
        if self._io is not None and self._io.error is not None:
            self._fail(self._io.error, doing)

    def _finish(self) -> None:
        """Close the file and flush it to disk (``fsync``): inside ``_guard``, once everything is
        written; ``_rename`` follows."""
        self._file.close()
        self._file = None
        self._io.finish(fsync=self._fsync)

    def _rename(self) -> None:
        """Put the finished file under its name (after ``_finish``)."""
        with self._guard("renaming the finished file"):
            os.replace(self._tmp, self.path)
            self._io = None
            if self._fsync:
                try:
                    fd = os.open(self.path.parent, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                except OSError:
                    pass  # some filesystems cannot fsync a directory
        self._state = "closed"

    def abort(self) -> None:
        """Drop everything: the temp file is removed, nothing appears at ``path``. Idempotent."""
        if self._state in ("open", "init"):
            self._discard()
            self._state = "aborted"

    def __del__(self):
        try:
            if getattr(self, "_state", None) in ("open", "init"):
                self.abort()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


def _widen_metadata_cache(f: h5py.File) -> None:
    """A metadata cache of 32 MiB from the start (HDF5 starts at 2 and grows it slowly): a capture of
    many requests and hooks makes thousands of groups and datasets, and every entry the small cache
    evicts is written out early and again later. About 5% of the writer's time at 256 requests."""
    config = f.id.get_mdc_config()
    config.set_initial_size, config.initial_size, config.min_size = True, 32 << 20, 32 << 20
    config.max_size = max(config.max_size, 32 << 20)
    f.id.set_mdc_config(config)
