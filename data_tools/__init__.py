"""Data tools: converters from real formats to the mpidl HDF5 layout, and the synthetic scene.

Installed as ``mpidl.data_tools``; run as ``python -m mpidl.data_tools SUBCOMMAND ...``
(see :mod:`mpidl.data_tools.__main__`). The layout itself is documented in :mod:`mpidl.data`.

Modules: ``layout`` (atomic writer, training statistics), ``sources`` (reading .mat v5/v7.3,
.npy, .npz), ``splits`` (stratified random and spatial-block splits), ``hsi`` (cube ->
patches), ``images`` (image folders), ``synthetic`` (the generated scene), ``info``.
"""
