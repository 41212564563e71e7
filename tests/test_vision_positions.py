"""Prefix keys and the reuse rule for image runs (vision/positions.py), and the cache's next
MRoPE position."""

import numpy as np
import pytest

from edge_llm.errors import ImageError
from edge_llm.kvcache import ImageSpan, next_position
from edge_llm.vision.positions import (
    KEY_BIT,
    expand_placeholders,
    image_key_ids,
    plan_prompt,
)
from edge_llm.vision.preprocess import PreparedImage

PAD = 7


def img(digest_byte: int, gh: int = 4, gw: int = 6) -> PreparedImage:
    return PreparedImage(np.zeros((gh * gw, 1), np.float32), (1, gh, gw), bytes([digest_byte]) * 32, 2)


def test_keys_depend_on_the_image_and_never_collide_with_vocabulary_ids():
    a, b = img(1), img(2)
    toks = [1, 2] + [PAD] * 6 + [3]
    ka, kb = plan_prompt(toks, [a], PAD).keys, plan_prompt(toks, [b], PAD).keys
    assert ka[:2] == kb[:2] == [1, 2] and ka[-1] == kb[-1] == 3
    assert all(k >= KEY_BIT for k in ka[2:8]) and all(x != y for x, y in zip(ka[2:8], kb[2:8]))
    assert len(set(ka[2:8])) == 6  # one id per row: a partial run matches only row by row
    assert np.array_equal(image_key_ids(a.digest, 6), ka[2:8])


def test_positions_continue_after_the_largest_grid_position():
    plan = plan_prompt([1, 2] + [PAD] * 6 + [3, 4], [img(1)], PAD)  # llm grid 1 x 2 x 3
    assert plan.positions[:, :2].tolist() == [[0, 1]] * 3
    assert plan.positions[0, 2:8].tolist() == [2] * 6
    assert plan.positions[1, 2:8].tolist() == [2, 2, 2, 3, 3, 3]
    assert plan.positions[2, 2:8].tolist() == [2, 3, 4, 2, 3, 4]
    assert plan.positions[:, 8:].tolist() == [[5, 6]] * 3  # 2 + max(2, 3)
    (span,) = plan.spans
    assert (span.start, span.end, span.next_pos) == (2, 8, 5)
    assert next_position(10, plan.spans) == 7 and next_position(2, plan.spans) == 2


def test_reuse_never_ends_inside_an_image_run_nor_uses_another_image():
    plan = plan_prompt([1, 2] + [PAD] * 6 + [3, 4], [img(1)], PAD)
    same, other = plan.spans, [ImageSpan(2, (1, 2, 3), 2, bytes([9]) * 32)]
    assert plan.reusable(10, same) == 10
    assert plan.reusable(5, same) == 2  # inside the run: back to its start
    assert plan.reusable(10, other) == 2  # same rows but another digest: never reused
    assert plan.reusable(2, []) == 2


def test_placeholders_must_match_images():
    assert expand_placeholders([1, PAD, 2], [img(1)], PAD) == [1] + [PAD] * 6 + [2]
    with pytest.raises(ImageError, match="placeholder"):
        expand_placeholders([1, PAD, PAD, 2], [img(1)], PAD)
    with pytest.raises(ImageError, match="placeholder"):
        plan_prompt([1, PAD, 2], [], PAD)
    with pytest.raises(ImageError, match="needs 6"):
        plan_prompt([1, PAD, PAD, 2], [img(1)], PAD)
