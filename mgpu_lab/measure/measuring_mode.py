"""The base of mgpu_lab's measuring instruments: a ``TorchDispatchMode`` left to run eagerly.

torch wraps each ``TorchDispatchMode`` subclass's ``__torch_dispatch__`` in
``torch._disable_dynamo`` (so that ``torch.compile`` does not trace into it), and that
wrapper imports ``torch._dynamo`` on its first call: about a second of CPU in every
fresh process, and in every rank that ``launch()`` forks from one that had not imported
it yet (four ranks measuring their collectives: 3.6 s of CPU instead of 0.2 s). The
instruments here watch eager code only, so they say "do not wrap me" through torch's
own switch, ``_should_skip_dynamo`` (a torch without it ignores the method).
"""
from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["MeasuringMode"]


class MeasuringMode(TorchDispatchMode):
    """A ``TorchDispatchMode`` whose ``__torch_dispatch__`` torch leaves unwrapped."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False
