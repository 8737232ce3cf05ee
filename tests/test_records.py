"""Guard records: one consistent record per buffer whatever the calls, incomplete records named."""
from __future__ import annotations

import pytest
import torch

import kvwrite
from conftest import DEVICE, KERNEL_BACKENDS
from kvwrite import errors as E
from kvwrite.errors import ErrorBuffer, IncompleteRecord, OutOfBoundsWrite

BACKENDS = ["torch"] + KERNEL_BACKENDS


def _store(capacity: int, loc: list[int], errors: ErrorBuffer, backend: str) -> None:
    """A guarded store_kv of len(loc) tokens into a pool of `capacity` rows (pages of 1)."""
    n = len(loc)
    k = torch.randn(n, 1, 16, device=DEVICE)
    kc = torch.zeros(capacity, 1, 1, 16, device=DEVICE)
    vc = torch.zeros_like(kc)
    kvwrite.store_kv(k, k, kc, vc, torch.tensor(loc, device=DEVICE), check="guard",
                     errors=errors, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_calls_bad_at_the_same_token_leave_the_first_calls_record(backend):
    # call A: loc 20 into capacity 8; call B: loc 2**32 + 7 into capacity 256; both token 0.
    # Per-slot minima alone would report loc 7 (B's low half, A's high half), capacity 8.
    errors = ErrorBuffer(DEVICE)
    _store(8, [20], errors, backend)
    _store(256, [2 ** 32 + 7], errors, backend)
    err = errors.error()
    assert (err.token_index, err.loc, err.limit, err.page, err.count) == (0, 20, 8, 20, 2)
    assert errors.tensor[E.EPOCH].item() == 2 and errors.tensor[E.DONE].item() == 0
    # the same calls in the other order: B's record, A counted
    errors.reset()
    _store(256, [2 ** 32 + 7], errors, backend)
    _store(8, [20], errors, backend)
    err = errors.error()
    assert (err.token_index, err.loc, err.limit, err.count) == (0, 2 ** 32 + 7, 256, 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_clean_call_before_the_bad_ones_changes_nothing(backend):
    errors = ErrorBuffer(DEVICE)
    _store(8, [1, 2, -1], errors, backend)
    assert errors.error() is None
    _store(8, [3, 9, 12], errors, backend)     # tokens 1 and 2 bad: the lowest, 1, is kept
    _store(16, [40, 1, 2], errors, backend)    # token 0 bad: a later call, counted only
    err = errors.error()
    assert (err.token_index, err.loc, err.limit, err.count) == (1, 9, 8, 3)
    assert errors.tensor[E.EPOCH].item() == 3


def _slots(**values: int) -> list[int]:
    s = [E.EMPTY] * E.NUM_SLOTS
    s[E.COUNT], s[E.EPOCH], s[E.DONE] = 0, 0, 0
    for name, v in values.items():
        s[getattr(E, name)] = v
    return s


def _full(token: int, loc: int, capacity: int, **more: int) -> list[int]:
    fields = dict(LOC_LO=loc, LOC_HI=loc >> 32, TARGET_LO=loc, TARGET_HI=loc >> 32,
                  LIMIT_LO=capacity, LIMIT_HI=capacity >> 32, POOL_PAGE_SIZE=1, META=0)
    return _slots(COUNT=1, OWNER=0, **{k: (token << 32) | (v & 0xFFFFFFFF) for k, v in fields.items()},
                  **more)


def test_a_partial_record_is_reported_as_incomplete_not_an_index_error():
    # what a reader not ordered after a running store can see: COUNT added, fields not yet
    buf = ErrorBuffer("cpu")
    buf.tensor.copy_(torch.tensor(_slots(COUNT=3)))
    err = buf.error()
    assert isinstance(err, IncompleteRecord) and isinstance(err, OutOfBoundsWrite)
    assert err.count == 3 and "incomplete" in str(err) and "stream" in str(err)
    with pytest.raises(IncompleteRecord, match="3 bad token"):
        buf.raise_if_any()
    # owner claimed, some fields written
    s = _full(0, 20, 8)
    s[E.LIMIT_LO] = E.EMPTY
    buf.tensor.copy_(torch.tensor(s))
    assert isinstance(buf.error(), IncompleteRecord)
    # every field written, but by two tokens (the lower one still folding in)
    s = _full(5, 20, 8)
    s[E.LOC_LO] = (2 << 32) | 30
    buf.tensor.copy_(torch.tensor(s))
    err = buf.error()
    assert isinstance(err, IncompleteRecord) and "[2, 5]" in str(err)
    # page-table kinds need their context slots too
    s = _full(0, 20, 8)
    s[E.META] = E.KIND_TABLE_PAGE << 8
    buf.tensor.copy_(torch.tensor(s))
    assert isinstance(buf.error(), IncompleteRecord)
    # complete: decoded
    buf.tensor.copy_(torch.tensor(_full(4, 20, 8)))
    err = buf.error()
    assert type(err) is OutOfBoundsWrite and (err.token_index, err.loc, err.limit) == (4, 20, 8)


def test_reset_clears_owner_epoch_and_done():
    buf = ErrorBuffer("cpu")
    buf.tensor.copy_(torch.tensor(_full(0, 20, 8, EPOCH=5, DONE=2)))
    buf.reset()
    s = buf.tensor.tolist()
    assert s[E.COUNT] == s[E.EPOCH] == s[E.DONE] == 0 and s[E.OWNER] == E.EMPTY
    assert buf.error() is None


def test_raise_if_any_takes_the_stream_it_is_ordered_after():
    class Stream:
        synced = 0

        def synchronize(self):
            self.synced += 1

    buf, stream = ErrorBuffer("cpu"), Stream()
    buf.raise_if_any(stream=stream)
    assert stream.synced == 1


def test_default_record_first_needed_inside_graph_capture_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=r"before the capture.*default_errors\('cuda:7'\)"):
        kvwrite.default_errors("cuda:7")
    assert torch.device("cuda", 7) not in E._default
    kvwrite.default_errors("cpu")   # CPU records are never captured
