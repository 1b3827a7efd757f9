"""The environment variables mpidl honours: read once, here, and nowhere else.

=========================  ==============================================================
variable                   what it does
=========================  ==============================================================
``MPIDL_RANKS_PER_NODE``   EMULATED nodes: group ``K`` consecutive world ranks into one
                           node (:class:`~mpidl.distributed.topology.Topology`), for a
                           launcher that puts every rank on one machine. Same as
                           ``--ranks-per-node`` / ``Topology(ranks_per_node=K)``.
``MPIDL_CUDA_AWARE_MPI``   ``1`` / ``0``: the MPI can (not) read GPU memory; unset: asked
                           of the MPI (:func:`~mpidl.distributed.channel.mpi_is_cuda_aware`).
``MPIDL_KERNELS``          ``reference`` | ``cpu`` | ``cuda``: force one kernel family
                           everywhere (to debug a suspected kernel bug; :mod:`mpidl.kernels`;
                           in code, for a block: ``with kernels.use(family)``, which wins).
``MPIDL_CONV_ALGORITHM``   ``im2col`` | ``winograd``: the convolution algorithm of every
                           ``Conv2d`` built without an explicit ``algorithm`` (in code:
                           ``Conv2d(..., algorithm=...)``).
``MPIDL_ULFM``             ``1`` / ``0``: the MPI does (not) give ULFM fault tolerance,
                           overriding the detection (an MPI mpidl does not know).
=========================  ==============================================================

:data:`SETTINGS` is read from ``os.environ`` when this module is first imported: the same
on every rank of a job (the launcher passes one environment), and constant afterwards. A
malformed value is kept and refused, with a message that names the variable, where it is
used (so every rank refuses it alike, before any collective). Nothing here changes the
process: it only reads.

The product reads these variables here and nowhere else, and reads them through
``settings.SETTINGS`` at the time of use (``from mpidl import settings``, not ``from
mpidl.settings import SETTINGS``), so that a test can give one test other values without
touching the environment: ``monkeypatch.setattr(settings, "SETTINGS",
Settings.from_environ({"MPIDL_KERNELS": "reference"}))`` (the ``mpidl_settings`` fixture of
tests/conftest.py). Changing ``os.environ`` after the import changes nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

__all__ = ["Settings", "SETTINGS", "ENVIRONMENT"]

#: every variable of the table above
ENVIRONMENT = ("MPIDL_RANKS_PER_NODE", "MPIDL_CUDA_AWARE_MPI", "MPIDL_KERNELS", "MPIDL_CONV_ALGORITHM",
               "MPIDL_ULFM")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _switch(name: str, text: str) -> bool | None:
    text = text.strip().lower()
    if not text:
        return None
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ValueError(f"environment variable {name} must be 1 or 0, got {text!r}")


def _choice(name: str, text: str, choices: tuple[str, ...]) -> str | None:
    text = text.strip().lower()
    if not text:
        return None
    if text not in choices:
        raise ValueError(f"environment variable {name} must be one of {', '.join(choices)}, got {text!r}")
    return text


@dataclass(frozen=True)
class Settings:
    """The raw values (``""`` when unset); each property parses and checks its own."""

    raw: Mapping[str, str]

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> "Settings":
        return cls({name: environ.get(name, "") for name in ENVIRONMENT})

    @property
    def ranks_per_node(self) -> int | None:
        """``MPIDL_RANKS_PER_NODE`` as an integer >= 1, or None when unset."""
        text = self.raw["MPIDL_RANKS_PER_NODE"].strip()
        if not text:
            return None
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(f"environment variable MPIDL_RANKS_PER_NODE must be an integer >= 1, got {text!r}")
        return value

    @property
    def cuda_aware_mpi(self) -> bool | None:
        return _switch("MPIDL_CUDA_AWARE_MPI", self.raw["MPIDL_CUDA_AWARE_MPI"])

    @property
    def kernels(self) -> str | None:
        return _choice("MPIDL_KERNELS", self.raw["MPIDL_KERNELS"], ("reference", "cpu", "cuda"))

    @property
    def conv_algorithm(self) -> str | None:
        return _choice("MPIDL_CONV_ALGORITHM", self.raw["MPIDL_CONV_ALGORITHM"], ("im2col", "winograd"))

    @property
    def ulfm(self) -> bool | None:
        return _switch("MPIDL_ULFM", self.raw["MPIDL_ULFM"])


#: this process's settings, read once
SETTINGS = Settings.from_environ()
