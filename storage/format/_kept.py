"""``Kept``: the few newest results of a computation that repeats from save to save."""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Kept(Generic[K, V]):
    """A thread-safe map keeping its ``size`` newest entries (the oldest goes first).

    Storage keeps plans, layouts, rule tables and decoded manifests this way: a training job
    saves and reads the same structures again and again, from the caller's and the background
    save threads at once.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: dict[K, V] = {}
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            return self._items.get(key)

    def put(self, key: K, value: V) -> V:
        """Keep ``value`` under ``key`` (dropping the oldest entry when full); returns it."""
        with self._lock:
            if key not in self._items and len(self._items) >= self.size:
                self._items.pop(next(iter(self._items)))
            self._items[key] = value
        return value

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
