"""Qwen2-VL's language side: where image features go in a token sequence and the positions they get.

A prompt holds each image as <|vision_start|> <|image_pad|> x n <|vision_end|>, n the image's merged tokens
(grid h x w / merge²). The image pads' embeddings are replaced by the vision tower's output (models/
qwen2_vl_vision.py), and every token gets three rotary positions (temporal, height, width), which the decoder
shares out among its frequencies (`DecoderArgs.mrope_section`): text tokens count up by one on all three; an
image's tokens sit at (start, start + row, start + column) on its merged grid, and the text after it resumes at
start + max(rows, columns) (transformers' `get_rope_index` for images).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def mrope_positions(
    input_ids: Sequence[int], image_token_id: int, grids: Sequence[tuple[int, int, int]], merge_size: int
) -> torch.Tensor:
    """[3, T] positions of one sequence; `grids` are the images' (t, h, w) patch grids, in prompt order."""
    rows: list[torch.Tensor] = []
    pos, i, n, image = 0, 0, len(input_ids), 0
    while i < n:
        j = i
        if input_ids[i] != image_token_id:
            while j < n and input_ids[j] != image_token_id:
                j += 1
            rows.append(torch.arange(pos, pos + j - i).expand(3, -1))
            pos += j - i
        else:
            if image >= len(grids):
                raise ValueError(f"the prompt has more image placeholders than the {len(grids)} images given")
            t, h, w = grids[image]
            h, w = h // merge_size, w // merge_size
            tt, hh, ww = torch.meshgrid(
                torch.zeros(t, dtype=torch.long), torch.arange(h), torch.arange(w), indexing="ij"
            )
            block = torch.stack([tt, hh, ww]).reshape(3, -1) + pos
            while j < n and input_ids[j] == image_token_id and j - i < block.shape[1]:
                j += 1
            if j - i != block.shape[1]:
                raise ValueError(f"image {image} has {block.shape[1]} tokens but the prompt holds {j - i} placeholders")
            rows.append(block)
            pos += max(h, w)
            image += 1
        i = j
    if image != len(grids):
        raise ValueError(f"{len(grids)} images given, {image} placeholders in the prompt")
    return torch.cat(rows, dim=1) if rows else torch.zeros(3, 0, dtype=torch.long)
