"""HDF5 capture files (h5py)."""

from inspector.io.hdf5 import (FORMAT_NAME, FORMAT_VERSION, CaptureFileError, CaptureWriter, H5Array,
                               LazyHookRows, RunFile, open_run, read_run, write_run)

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "CaptureFileError", "CaptureWriter", "H5Array", "LazyHookRows",
           "RunFile", "open_run", "read_run", "write_run"]
