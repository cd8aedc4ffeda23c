"""A weighted sum of float32 vectors whose result does not depend on how the terms are
grouped or ordered: worker nodes can each sum their own clients' updates and the server
add the node sums, and the model is the same bits whatever node hosts which client.

A float sum rounds after every addition, so (a + b) + c and a + (b + c) differ in the
last bits. Here each term n_k u_k is cut once, on its own, to a fixed-point grid: its
largest magnitude sets the exponent e (n_k max|u_k| < 2^e), and the term becomes the
integers trunc(n_k u_k 2^(FRACTION_BITS - e)), below 2^FRACTION_BITS in magnitude. Terms
with the same e add as integers (float64 holds them exactly up to 2^53; a bucket moves
into int64 before it could get there), so a bucket's total is the same whatever the
grouping. The result converts each bucket once, in order of e: rounding happens only
there, always the same way.

Precision: each term keeps FRACTION_BITS = 40 bits below its largest element (float64's
sum of 1,000 terms, in comparison, loses about 10 of its 53); an element 2^-17 below its
vector's largest is cut below float32's own 24 bits, far under anything that moves a
trained weight. Cost: three passes over a term (max, min, then scale, cut and add in one
compiled loop) against one for a float64 running sum. A term can be taken back
(``subtract``), exactly, so a node can sum its clients' updates as they come and remove
those that turn out not to count.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

FRACTION_BITS = 40
# Terms are below 2^40 in magnitude, so 2^12 of them sum below 2^52: exact in float64.
_SPILL_EVERY = 1 << (52 - FRACTION_BITS)
# n_k u_k must be exact in float64: 24 bits of float32 mantissa and 29 of n_k.
MAX_COUNT = (1 << 29) - 1
# int64 totals: each term below 2^40, so 2^22 of them per exponent before 2^62.
_MAX_TERMS = 1 << 22

_fold_kernel = None


def _fold() -> Callable[[np.ndarray, np.ndarray, float], None]:
    """fold(partial, update, factor): partial += trunc(update * factor) in float64, element
    by element, in one pass.

    NumPy takes three (scale into a scratch vector, cut, add), and at 1,000 clients a
    round the bucket is out of cache each time: a quarter of a worker node's CPU went
    here. The compiled loop does the same float64 operations (update * factor is exact,
    trunc is exact), so the integers are the same bits. Compiled on a process's first
    addition (about half a second), so a process that never adds never imports numba.
    Not cached on disk: numba's cache is not safe when several processes write it at
    once (numba/numba#4807), as a run's worker nodes would in their first round."""
    global _fold_kernel
    if _fold_kernel is None:
        # numba's import and compilation are start-up seconds, paid only where nodes sum
        import numba

        @numba.njit(nogil=True)
        def kernel(partial, update, factor):  # pragma: no cover - compiled
            for i in range(update.shape[0]):
                partial[i] += np.trunc(np.float64(update[i]) * factor)

        _fold_kernel = kernel
    return _fold_kernel


class _Bucket:
    """The terms of one exponent: a float64 sum of integers, and an int64 one it spills to."""

    __slots__ = ("partial", "count", "total", "terms")

    def __init__(self, size: int) -> None:
        self.partial = np.zeros(size, dtype=np.float64)
        self.count = 0  # terms in ``partial``
        self.total: np.ndarray | None = None  # int64, the spilled terms
        self.terms = 0  # all terms, for the int64 bound

    def spill(self) -> None:
        if self.total is None:
            self.total = np.zeros(self.partial.shape, dtype=np.int64)
        np.add(self.total, self.partial.astype(np.int64), out=self.total)
        self.partial[:] = 0.0
        self.count = 0

    def exact(self) -> np.ndarray:
        """The bucket's integers, as int64."""
        integers = self.partial.astype(np.int64)
        if self.total is not None:
            integers += self.total
        return integers


class ExactSum:
    """sum_k n_k u_k over float32 vectors of one shape, and the weighted mean
    sum_k n_k u_k / sum_k n_k, independent of the order and grouping of the terms
    (``add`` one at a time, ``merge`` another ExactSum's ``state()``)."""

    def __init__(self) -> None:
        self.total = 0  # sum of the counts
        self.terms = 0
        self._size: int | None = None
        self._buckets: dict[int, _Bucket] = {}
        # Non-finite elements (a diverged client): inf and nan add the same in any order.
        self._special: np.ndarray | None = None

    def _check_size(self, size: int) -> None:
        if self._size is None:
            self._size = size
        elif size != self._size:
            raise ValueError(f"an update of {size} values among updates of {self._size}")

    def add(self, update: np.ndarray, n: int) -> None:
        """Add n * update (n: the update's sample count, 0 <= n <= MAX_COUNT)."""
        self._term(update, n, 1)

    def subtract(self, update: np.ndarray, n: int) -> None:
        """Take back an ``add(update, n)``, exactly: the same integers leave its bucket.
        An update with non-finite elements cannot be taken back (inf - inf is nan):
        ValueError, and nothing changes."""
        if not np.isfinite(update).all():
            raise ValueError("an update with non-finite elements cannot be subtracted")
        self._term(update, n, -1)

    def _term(self, update: np.ndarray, n: int, sign: int) -> None:
        if type(n) is not int and not isinstance(n, np.integer):
            raise TypeError(f"a sample count must be an integer, not {n!r}")
        n = int(n)
        if not 0 <= n <= MAX_COUNT:
            raise ValueError(f"a sample count of {n}: counts are in 0..{MAX_COUNT}")
        if update.ndim != 1 or update.dtype != np.float32:
            raise ValueError(f"updates are flat float32 vectors, not {update.dtype} of shape {update.shape}")
        fold = _fold()  # before anything changes: a first compile that fails leaves the sum as it was
        self._check_size(update.shape[0])
        self.total += sign * n
        self.terms += sign
        if n == 0 or update.shape[0] == 0:
            return
        top = max(float(update.max()), -float(update.min()))
        if not math.isfinite(top):
            finite = np.isfinite(update)
            special = np.where(finite, np.float32(0), update).astype(np.float64)
            with np.errstate(invalid="ignore"):  # inf - inf is nan, as in a float sum
                self._special = special if self._special is None else self._special + special
            update = np.where(finite, update, np.float32(0))
            top = max(float(update.max()), -float(update.min()))
        if top == 0.0:
            return
        e = math.frexp(top * n)[1]  # top * n is exact: 24 + 29 bits
        bucket = self._bucket(e)
        # In float64, where n u_k times a power of two is exact; trunc(-x) = -trunc(x), so
        # a subtraction takes back exactly the integers its addition added.
        fold(bucket.partial, update, sign * math.ldexp(float(n), FRACTION_BITS - e))
        bucket.count += 1  # a subtraction counts too: it bounds |partial| as an addition does
        bucket.terms += 1
        if bucket.count == _SPILL_EVERY:
            bucket.spill()

    def _bucket(self, e: int) -> _Bucket:
        bucket = self._buckets.get(e)
        if bucket is None:
            bucket = self._buckets[e] = _Bucket(self._size)
        if bucket.terms >= _MAX_TERMS:
            raise OverflowError(f"more than {_MAX_TERMS} terms of one magnitude in one sum")
        return bucket

    # --- between nodes ----------------------------------------------------------------

    def state(self) -> dict:
        """What ``merge`` takes: the counts, each exponent's integers (int64), the
        non-finite elements. Plain arrays and ints, to travel on the wire."""
        return {"total": self.total, "terms": self.terms, "size": self._size,
                "buckets": [[e, b.terms, b.exact()] for e, b in sorted(self._buckets.items())],
                "special": self._special}

    def merge(self, state: dict) -> None:
        """Add another sum's ``state()``: exactly as if its terms had been added here. A
        malformed state raises before anything is added."""
        size, total, terms = state["size"], state["total"], state["terms"]
        if type(total) is not int or total < 0 or type(terms) is not int or terms < 0:
            raise ValueError(f"a partial sum's counts are not non-negative integers: {total!r}, {terms!r}")
        if size is None:
            return  # no terms, or only empty ones
        if type(size) is not int or (self._size is not None and size != self._size):
            raise ValueError(f"a partial sum of {size!r} values among updates of {self._size}")
        buckets = state["buckets"]
        for e, count, integers in buckets:
            if (type(e) is not int or type(count) is not int or count < 0 or not isinstance(integers, np.ndarray)
                    or integers.dtype != np.int64 or integers.shape != (size,)):
                raise ValueError(f"a partial sum's bucket is malformed: exponent {e!r}, {count!r} terms")
            if (self._buckets[e].terms if e in self._buckets else 0) + count > _MAX_TERMS:
                raise OverflowError(f"more than {_MAX_TERMS} terms of one magnitude in one sum")
        special = state["special"]
        if special is not None and (not isinstance(special, np.ndarray) or special.dtype != np.float64
                                    or special.shape != (size,)):
            raise ValueError("a partial sum's non-finite elements are malformed")
        self._check_size(size)
        self.total += total
        self.terms += terms
        for e, count, integers in buckets:
            bucket = self._bucket(e)
            if bucket.total is None:
                bucket.total = np.zeros(size, dtype=np.int64)
            np.add(bucket.total, integers, out=bucket.total)
            bucket.terms += count
        if special is not None:
            with np.errstate(invalid="ignore"):
                self._special = special.copy() if self._special is None else self._special + special

    # --- the result -------------------------------------------------------------------

    def sum(self) -> np.ndarray:
        """sum_k n_k u_k in float64: each exponent's integers converted once, smallest first."""
        if self._size is None:
            raise ValueError("no updates to sum")
        out = np.zeros(self._size, dtype=np.float64)
        for e in sorted(self._buckets):
            out += self._buckets[e].exact().astype(np.float64) * math.ldexp(1.0, e - FRACTION_BITS)
        if self._special is not None:
            with np.errstate(invalid="ignore"):
                out += self._special
        return out

    def mean(self) -> np.ndarray:
        """The weighted mean as float32."""
        if self._size is None:
            raise ValueError("no updates to average")
        if self.total <= 0:
            raise ValueError("sample counts sum to zero")
        return (self.sum() / self.total).astype(np.float32)
