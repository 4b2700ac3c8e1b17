"""Where the data loader was, and every random-number state, so that a resumed run draws what the
uninterrupted run drew, mid-epoch or at an epoch boundary.

Each process draws from torch's, Python's and numpy's global generators (and CUDA's): dropout,
augmentation in ``__getitem__``, and the loader itself: every ``iter(loader)`` draws the seed of
its workers, and a shuffling ``RandomSampler`` without a ``generator`` draws its order's seed at
the first batch. A loader or sampler built with ``generator=g`` draws from ``g`` instead. In the
uninterrupted run these draws interleave with the model's; a resumed run must make them in the
same order from the same states. :class:`LoaderPosition` follows one loader's iterators (given
to ``TrainState(..., dataloader=loader)``) and keeps, per rank:

- the batches the current epoch's iterator has yielded, and the generators' states *just before
  that iterator was made*;
- at a save, the generators' states *now*; with ``torchdata``'s ``StatefulDataLoader``, its own
  ``state_dict()`` (the sampler's position, the workers' seeds and the datasets' states).

After a load, the next ``iter(loader)`` continues the saved epoch: the generators are put back as
they were when the saved run made that epoch's iterator (so it draws the same seeds), the batches
already seen are skipped (a plain loader without workers advances its sampler only and reads
nothing; a plain loader with workers reads them again, the only way to advance its workers; a
``StatefulDataLoader`` restores its position and reads nothing), and then the generators are put
back as they were at the save. A checkpoint taken after the epoch's last batch resumes at the next
epoch (``TrainState.epoch`` counts finished epochs: ``for epoch in range(state.epoch, E)``), its
generators restored before that epoch's iterator is made.

What cannot continue exactly, said once at save time: draws inside worker processes of a
``StatefulDataLoader`` or of ``persistent_workers=True`` (workers are seeded when they start and
their generators are not saved: a resumed worker starts its stream again).
"""
from __future__ import annotations

import random
import warnings
from typing import Any, Dict, List, Optional

import torch


# --------------------------------------------------------------------------- global RNG states

def rng_state() -> Dict[str, Any]:
    """This process's random-number state (torch CPU, this rank's CUDA device, ``random``,
    numpy when installed), as tensors and plain numbers so that ``weights_only`` loads it."""
    state: Dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(), "cuda": None}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np
    except ImportError:
        return state
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {"name": name, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore what ``rng_state()`` returned."""
    torch.set_rng_state(state["torch"].cpu())
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())
    if state.get("numpy") is not None:
        import numpy as np
        n = state["numpy"]
        np.random.set_state((n["name"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"],
                             n["cached_gaussian"]))


# --------------------------------------------------------------------------- the loader's position

_TRACKED: Dict[type, type] = {}


def _tracked_iter(self):
    position = self.__dict__.get("_mgpu_lab_position")
    make = super(type(self), self).__iter__  # type(self) is the tracked subclass: the loader's own __iter__
    return make() if position is None else position.iterate(make)


def stateful(loader) -> bool:
    """torchdata's ``StatefulDataLoader`` (or anything with the same two methods)."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


class LoaderPosition:
    """Follows ``loader``'s iterators for ``owner`` (a TrainState: its ``epoch`` counts finished epochs)."""

    def __init__(self, loader, owner):
        if not hasattr(loader, "__iter__"):
            raise TypeError(f"dataloader= takes a torch DataLoader (or torchdata's StatefulDataLoader), "
                            f"got {type(loader).__name__}")
        cls = type(loader)
        base = cls.__mro__[1] if cls in _TRACKED.values() else cls
        if base not in _TRACKED:  # a subclass whose __iter__ reports to this object; isinstance holds
            _TRACKED[base] = type(base.__name__, (base,), {"__iter__": _tracked_iter, "__module__": base.__module__,
                                                           "__qualname__": base.__qualname__})
        loader.__class__ = _TRACKED[base]
        loader.__dict__["_mgpu_lab_position"] = self
        self.loader, self.owner, self.stateful = loader, owner, stateful(loader)
        self.epoch = owner.epoch                            # the epoch of the current iterator
        self.batches = 0                                    # yielded by the current epoch's iterator
        self.epoch_rng: Optional[Dict[str, Any]] = None     # the generators as that iterator was made
        self.resume: Optional[Dict[str, Any]] = None        # what load() put back, for the next iter()
        self._warned = False

    # ------------------------------------------------------------------ generators
    def _generators(self) -> List[torch.Generator]:
        found: List[torch.Generator] = []
        for obj in (self.loader, getattr(self.loader, "sampler", None), getattr(self.loader, "batch_sampler", None),
                    getattr(getattr(self.loader, "batch_sampler", None), "sampler", None)):
            g = getattr(obj, "generator", None)
            if isinstance(g, torch.Generator) and all(g is not h for h in found):
                found.append(g)
        return found

    def snapshot(self) -> Dict[str, Any]:
        return {"global": rng_state(), "generators": [g.get_state() for g in self._generators()]}

    def put_back(self, snap: Dict[str, Any]) -> None:
        set_rng_state(snap["global"])
        for g, s in zip(self._generators(), snap["generators"]):
            g.set_state(s)

    # ------------------------------------------------------------------ iterating
    def iterate(self, make):
        resume, self.resume = self.resume, None
        if resume is not None and resume["epoch_rng"] is not None:
            self.put_back(resume["epoch_rng"])       # the seeds this epoch's iterator drew in the saved run
        elif resume is not None:
            self.put_back(resume["now"])             # a new epoch: its iterator draws after the save
        epoch = self.epoch = self.owner.epoch
        self.epoch_rng, self.batches = self.snapshot(), 0
        it = iter(make())
        if resume is not None and resume["epoch_rng"] is not None:
            skip = resume["batches"]
            if not self.stateful:
                fast = (getattr(self.loader, "num_workers", 1) == 0 and hasattr(it, "_next_index")
                        and getattr(it, "_dataset_kind", None) == 0)  # _DatasetKind.Map: indices only, no reads
                for _ in range(skip):
                    it._next_index() if fast else next(it)
            self.batches = skip
            self.put_back(resume["now"])
        for batch in it:
            self.batches += 1
            yield batch
        self.owner.epoch = epoch + 1

    # ------------------------------------------------------------------ saving and loading
    def state(self) -> Dict[str, Any]:
        """This rank's part of the checkpoint (its global RNG is saved beside it)."""
        if self.resume is not None:  # saved again before iterating since the load: what was loaded
            return self.resume["saved"]
        self._warn_inexact()
        length = self._len()
        done = length is not None and self.batches >= length  # no len: resume skips to the end if that was it
        state = {"epoch_done": done, "next_epoch": self.epoch + 1 if done else self.epoch, "batches": 0,
                 "epoch_rng": None, "loader": None, "len": length,
                 "generators": [g.get_state() for g in self._generators()]}
        if not done and self.epoch_rng is not None:  # else the next draw is the next epoch's iterator's
            state.update(batches=self.batches, epoch_rng=self.epoch_rng,
                         loader=self.loader.state_dict() if self.stateful else None)
        return state

    def _len(self) -> Optional[int]:
        try:
            return len(self.loader)
        except TypeError:  # an iterable dataset without __len__
            return None

    def load(self, saved: Dict[str, Any], global_rng: Dict[str, Any]) -> bool:
        """Put back this rank's part; False (nothing put back) when the loader's epoch has another
        length than the saved one's (another batch plan or number of data-parallel ranks)."""
        if saved.get("len") != self._len():
            return False
        self.resume = {"saved": saved, "batches": saved["batches"], "epoch_rng": saved["epoch_rng"],
                       "now": {"global": global_rng, "generators": saved["generators"]}}
        if self.stateful and saved["loader"] is not None:
            self.loader.load_state_dict(saved["loader"])
        return True

    def _warn_inexact(self) -> None:
        workers = getattr(self.loader, "num_workers", 0) > 0
        if self._warned or not workers or not (self.stateful or getattr(self.loader, "persistent_workers", False)):
            return
        self._warned = True
        kind = type(self.loader).__name__ + (" with persistent_workers=True" if not self.stateful else "")
        warnings.warn(f"TrainState.save: a {kind} and {self.loader.num_workers} workers: random draws inside the "
                      "workers (augmentation from torch's, random's or numpy's global generator in __getitem__) will "
                      "not continue bit for bit after a resume (a worker's generators are seeded when it starts and "
                      "are not saved). Model, optimizer, data order and the main process's draws are exact; for "
                      "exact augmentation draw it from a torch.Generator seeded by the sample's index and epoch",
                      stacklevel=3)
