"""HDF5 capture files (h5py)."""
