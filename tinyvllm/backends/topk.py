"""torch.topk's choice on the CPU (largest, sorted), ties included: the router's top-k as HF transformers picks it.

torch.topk on the CPU breaks ties by no rule on indices: it runs libstdc++'s std::nth_element (introselect) on the
row's (value, index) pairs, then std::sort on the first k - 1, or std::partial_sort (a heap) where k * 64 <= the row's
length, and among equal values returns whichever the algorithm left in front (a row of 8 equal values gives
[6, 5, 4] for k = 3). `topk` reproduces those algorithms step for step on the rows that have a tie among their k + 1
largest values; every other row has one answer, the k largest in descending order, taken from a stable sort.
"""

from __future__ import annotations

import numpy as np

THRESHOLD = 16  # libstdc++'s std::sort: ranges up to this length are insertion-sorted


def topk(values: np.ndarray, k: int) -> np.ndarray:
    """The indices [T, k] of each row's k largest values [T, E], largest first, as torch.topk gives them."""
    order = np.argsort(-values, axis=-1, kind="stable")
    ids = order[:, :k].astype(np.int64)
    top = np.take_along_axis(values, order[:, :k + 1], axis=-1)
    for row in np.flatnonzero((top[:, 1:] == top[:, :-1]).any(axis=-1)):
        ids[row] = _Selection(values[row]).topk(k)
    return ids


class _Selection:
    """One row's (value, index) pairs and libstdc++'s algorithms over them, ordered by value, largest first."""

    def __init__(self, row: np.ndarray) -> None:
        self.q = [(float(v), i) for i, v in enumerate(row)]

    def less(self, x: tuple[float, int], y: tuple[float, int]) -> bool:  # the comparator: x goes before y
        return x[0] > y[0]

    def topk(self, k: int) -> list[int]:
        n = len(self.q)
        if k * 64 <= n:
            self.heap_select(0, k, n)
            self.sort_heap(0, k)
        else:
            self.introselect(0, k - 1, n, 2 * (n.bit_length() - 1))
            self.sort(0, k - 1)
        return [i for _, i in self.q[:k]]

    def introselect(self, first: int, nth: int, last: int, depth: int) -> None:
        while last - first > 3:
            if depth == 0:
                self.heap_select(first, nth + 1, last)
                self.swap(first, nth)
                return
            depth -= 1
            cut = self.partition_pivot(first, last)
            if cut <= nth:
                first = cut
            else:
                last = cut
        self.insertion_sort(first, last)

    def sort(self, first: int, last: int) -> None:
        if last - first > 1:
            self.introsort(first, last, 2 * ((last - first).bit_length() - 1))
            if last - first > THRESHOLD:
                self.insertion_sort(first, first + THRESHOLD)
                for i in range(first + THRESHOLD, last):
                    self.linear_insert(i)
            else:
                self.insertion_sort(first, last)

    def introsort(self, first: int, last: int, depth: int) -> None:
        while last - first > THRESHOLD:
            if depth == 0:
                self.heap_select(first, last, last)
                self.sort_heap(first, last)
                return
            depth -= 1
            cut = self.partition_pivot(first, last)
            self.introsort(cut, last, depth)
            last = cut

    def partition_pivot(self, first: int, last: int) -> int:
        self.median_to_first(first, first + 1, first + (last - first) // 2, last - 1)
        lo, hi, q = first + 1, last, self.q
        while True:
            while self.less(q[lo], q[first]):
                lo += 1
            hi -= 1
            while self.less(q[first], q[hi]):
                hi -= 1
            if not lo < hi:
                return lo
            self.swap(lo, hi)
            lo += 1

    def median_to_first(self, result: int, a: int, b: int, c: int) -> None:
        q, less = self.q, self.less
        if less(q[a], q[b]):
            median = b if less(q[b], q[c]) else c if less(q[a], q[c]) else a
        else:
            median = a if less(q[a], q[c]) else c if less(q[b], q[c]) else b
        self.swap(result, median)

    def insertion_sort(self, first: int, last: int) -> None:
        q = self.q
        for i in range(first + 1, last):
            if self.less(q[i], q[first]):
                q[first:i + 1] = [q[i], *q[first:i]]
            else:
                self.linear_insert(i)

    def linear_insert(self, last: int) -> None:
        q = self.q
        value = q[last]
        while self.less(value, q[last - 1]):
            q[last] = q[last - 1]
            last -= 1
        q[last] = value

    def heap_select(self, first: int, middle: int, last: int) -> None:
        length = middle - first
        for parent in range((length - 2) // 2, -1, -1) if length >= 2 else ():
            self.adjust_heap(first, parent, length, self.q[first + parent])
        for i in range(middle, last):
            if self.less(self.q[i], self.q[first]):
                self.pop_heap(first, middle, i)

    def sort_heap(self, first: int, last: int) -> None:
        while last - first > 1:
            last -= 1
            self.pop_heap(first, last, last)

    def pop_heap(self, first: int, last: int, result: int) -> None:
        value, self.q[result] = self.q[result], self.q[first]
        self.adjust_heap(first, 0, last - first, value)

    def adjust_heap(self, first: int, hole: int, length: int, value: tuple[float, int]) -> None:
        q, top, child = self.q, hole, hole
        while child < (length - 1) // 2:
            child = 2 * (child + 1)
            if self.less(q[first + child], q[first + child - 1]):
                child -= 1
            q[first + hole] = q[first + child]
            hole = child
        if length % 2 == 0 and child == (length - 2) // 2:
            child = 2 * (child + 1)
            q[first + hole] = q[first + child - 1]
            hole = child - 1
        parent = (hole - 1) // 2
        while hole > top and self.less(q[first + parent], value):
            q[first + hole] = q[first + parent]
            hole = parent
            parent = (hole - 1) // 2
        q[first + hole] = value

    def swap(self, i: int, j: int) -> None:
        self.q[i], self.q[j] = self.q[j], self.q[i]
