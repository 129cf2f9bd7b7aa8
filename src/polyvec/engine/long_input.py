"""Inputs longer than max_model_len (long_input="window"; vLLM's enable_chunked_processing): the split into
window requests, which run like any other (a decoder's in chunks), and the merge of their results once the last
one finishes."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

import torch

from ..layers.pooler import Pooler, PoolingSpec
from .request import Request


def split_windows(request: Request, max_model_len: int, overlap: int, special_ids: Collection[int]) -> list[Request]:
    """Cut an over-long input into windows of max_model_len tokens, each with the input's leading
    and closing special tokens ([CLS] ... [SEP]); consecutive windows share `overlap` tokens.

    Window k covers content tokens [s_k, s_k + W) with W = max_model_len - specials and s_k = k (W - overlap).
    For token outputs, content token t comes from the window where it is farthest from an edge: window k
    keeps [s_k + overlap // 2, s_{k+1} + overlap // 2) (the first from 0, the last to the end).

    The windows (and their spans) are set on `request`, which becomes their parent; returns the windows.
    """
    ids = request.prompt_token_ids
    head = ids[:1] if ids[0] in special_ids else []
    tail = ids[-1:] if ids[-1] in special_ids and len(ids) > len(head) else []
    body = ids[len(head) : len(ids) - len(tail)]
    width = max_model_len - len(head) - len(tail)
    stride = width - overlap
    if stride < 1:
        raise ValueError(f"window_overlap={overlap} leaves no room in windows of {width} tokens")
    starts = list(range(0, max(len(body) - overlap, 1), stride))
    if starts[-1] + width < len(body):
        starts.append(starts[-1] + stride)
    keep_from = [0] + [s + overlap // 2 for s in starts[1:]]
    keep_to = keep_from[1:] + [len(body)]
    spec = request.spec
    if spec.task in ("embed", "classify"):  # windows return raw pooled vectors; the head runs once on their mean
        spec = PoolingSpec(task=spec.task, pooling=spec.pooling, raw=True)
    elif not head:  # a window then starts inside the text: its first row is a content token, whatever its id
        spec = dataclasses.replace(spec, first_kept=True)
    # an instruction prompt left out of pooling (include_prompt: false) is in the first window only
    first = dataclasses.replace(spec, skip_first=request.spec.skip_first) if spec is not request.spec else spec
    windows, spans = [], []
    for k, s in enumerate(starts):
        window_ids = head + body[s : s + width] + tail
        windows.append(
            Request(
                request_id=f"{request.request_id}#w{k}",
                prompt_token_ids=window_ids,
                token_type_ids=None,
                params=request.params,
                spec=spec if k else first,
                num_input_tokens=len(window_ids),
                parent=request,
            )
        )
        spans.append((s, keep_from[k], keep_to[k]))
    request.windows, request.window_spans = windows, spans
    request.num_input_tokens = len(ids)
    request.token_type_ids = None
    return windows


def merge_windows(parent: Request, pooler: Pooler, special_ids: Collection[int]) -> torch.Tensor:
    """The parent's output from its finished windows (see `split_windows`); releases the windows' results.

    Sequence tasks: the token-weighted mean of the windows' pooled vectors, through the task's head.
    Token tasks: each content token from the window that keeps it, [CLS] from the first, [SEP] from the last.
    """
    windows, spans = parent.windows, parent.window_spans
    assert windows is not None and spans is not None  # set together by split_windows
    results = [w.window_output for w in windows]
    if parent.spec.task in ("embed", "classify"):
        weights = torch.tensor([float(w.num_tokens - w.spec.skip_first) for w in windows])
        pooled = (torch.stack(results) * weights.unsqueeze(1)).sum(0) / weights.sum()
        data = pooler.apply_head(parent.spec, pooled).cpu()  # outputs are returned on the CPU
    else:
        ids = parent.prompt_token_ids
        n_head = 1 if ids[0] in special_ids else 0
        n_tail = 1 if ids[-1] in special_ids and len(ids) > n_head else 0
        # bge-m3's token vectors leave out a window's leading <s>, as they leave out the input's
        at = n_head - pooler.drops_first(parent.spec, ids)
        pieces = [results[0][:at]]  # [CLS] from the first window, [SEP] from the last
        for (s, lo, hi), rows in zip(spans, results):
            pieces.append(rows[at + lo - s : at + hi - s])
        pieces.append(results[-1][len(results[-1]) - n_tail :])
        data = torch.cat(pieces)
    for w in windows:
        w.window_output = None
    return data
