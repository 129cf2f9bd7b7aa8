"""The long-input window split and merge on their own (no model): window layout, spans, and that merging
token outputs gives back one row per input token in order."""

from __future__ import annotations

import pytest
import torch

from polyvec import PoolingParams
from polyvec.engine.long_input import merge_windows, split_windows
from polyvec.engine.request import Request
from polyvec.layers.pooler import Pooler, PoolingSpec

CLS, SEP = 101, 102


def long_request(n_body: int, task: str) -> Request:
    ids = [CLS] + list(range(1000, 1000 + n_body)) + [SEP]
    spec = PoolingSpec(task=task, pooling=("ALL",) if task == "token_embed" else ("MEAN",), use_activation=False)
    return Request(
        request_id="r",
        prompt_token_ids=ids,
        token_type_ids=[0] * len(ids),
        params=PoolingParams(),
        spec=spec,
        num_input_tokens=len(ids),
    )


@pytest.mark.parametrize("overlap", [0, 1, 2, 3])
def test_windows_cover_the_input_and_merge_back_in_order(overlap):
    r = long_request(23, "token_embed")
    windows = split_windows(r, 8, overlap, {CLS, SEP})
    assert windows is r.windows and len(r.window_spans) == len(windows) > 1
    assert r.token_type_ids is None and r.num_input_tokens == 25
    for k, w in enumerate(windows):
        assert w.parent is r and w.request_id == f"r#w{k}" and w.spec == r.spec
        assert w.prompt_token_ids[0] == CLS and w.prompt_token_ids[-1] == SEP and w.num_tokens <= 8
        w.window_output = torch.tensor(w.prompt_token_ids, dtype=torch.float32)[:, None]  # a row is its token id
    merged = merge_windows(r, Pooler(), {CLS, SEP})
    assert merged[:, 0].long().tolist() == r.prompt_token_ids
    assert all(w.window_output is None for w in windows)


def test_sequence_windows_are_raw_and_merge_to_the_token_weighted_mean():
    r = long_request(10, "embed")
    windows = split_windows(r, 8, 0, {CLS, SEP})
    assert [w.num_tokens for w in windows] == [8, 6] and all(w.spec.raw for w in windows)
    windows[0].window_output, windows[1].window_output = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    merged = merge_windows(r, Pooler(), {CLS, SEP})
    assert torch.allclose(merged, torch.tensor([8.0, 6.0]) / 14)


def test_overlap_that_leaves_no_stride_is_rejected():
    with pytest.raises(ValueError, match="window_overlap=6 leaves no room in windows of 6 tokens"):
        split_windows(long_request(20, "embed"), 8, 6, {CLS, SEP})


def test_an_abort_while_windows_are_combined_drops_the_request_quietly(minilm_path):
    """The engine thread combines a long input's windows while the event loop may abort it: the abort landing
    between the check for its group and its removal raised KeyError (a failed request, logged as an error)."""
    import threading

    from polyvec import LLM

    llm = LLM(str(minilm_path), dtype="float32", long_input="window")
    e = llm.engine
    (request,) = e.process([" ".join(["alpha beta gamma delta"] * 200)], None, "embed", ["leaves"])
    assert len(request.windows) > 1

    engine_thread = threading.current_thread()

    class Groups(dict):
        """The abort runs on another thread right when the engine thread first looks the group up."""

        aborted = False

        def _abort_first(self, key):
            if threading.current_thread() is engine_thread and not self.aborted and dict.__contains__(self, key):
                self.aborted = True
                aborting = threading.Thread(target=e.abort_requests, args=({key},))
                aborting.start()
                aborting.join()

        def __contains__(self, key):
            self._abort_first(key)
            return dict.__contains__(self, key) or self.aborted  # the engine saw it there before the abort

        def pop(self, key, *default):
            self._abort_first(key)
            return dict.pop(self, key, *default)

    e._window_groups = Groups(e._window_groups)
    e.add_requests([request])
    while e.has_unfinished_requests():
        assert e.step() == []  # no output for the aborted request, and no KeyError
    assert e._window_groups.aborted
