"""torch's ``GraphPickler`` for the step graphs ``passes/shared.py`` stores, with one difference:
a fake view's base is stored without its fake mode too. torch drops the view's own mode and sets
both when loading; a base that keeps its mode does not pickle (its converter's weak caches), as
in the graphs a full recompute (``ac=full``) leaves under expert parallelism. Its own module:
importing torch's pickler imports Inductor (seconds), which only storing and loading need."""

from __future__ import annotations

import dataclasses

from torch._subclasses.fake_tensor import FakeTensor
from torch.fx._graph_pickler import GraphPickler, _TensorPickleData


class _TensorData(_TensorPickleData):
    def __init__(self, describer, t) -> None:
        super().__init__(describer, t)
        if self.metadata.base is not None:
            self.metadata = dataclasses.replace(self.metadata, base=dataclasses.replace(self.metadata.base, fake_mode=None))


class Pickler(GraphPickler):
    def reducer_override(self, obj):
        if isinstance(obj, FakeTensor):
            return _TensorData.reduce_helper(self, obj)
        return super().reducer_override(obj)
