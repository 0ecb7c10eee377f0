import doctest

import pytest
import torch

from konkanivani.data.frames import subsampled_lengths
from konkanivani.model import masks
from konkanivani.model.masks import causal_mask, chunk_mask, pad_mask


def test_the_doctests_hold():
    assert doctest.testmod(masks).failed == 0


def test_pad_mask_marks_padding():
    mask = pad_mask(torch.tensor([3, 1, 4]), 4)
    assert mask.tolist() == [[False, False, False, True],
                             [False, True, True, True],
                             [False, False, False, False]]


def test_pad_mask_max_len_defaults_to_the_longest():
    lengths = torch.tensor([2, 5])
    assert pad_mask(lengths).shape == (2, 5)
    assert (~pad_mask(lengths)).sum(1).tolist() == [2, 5]


def test_causal_mask_lower_triangular():
    m = causal_mask(4)
    assert m.dtype == torch.bool
    for i in range(4):
        for j in range(4):
            assert bool(m[i, j]) == (j <= i)


@pytest.mark.parametrize(
    "size,chunk,left", [(1, 1, -1), (7, 1, 0), (7, 3, -1), (7, 3, 1), (10, 4, 0), (10, 2, 2)]
)
def test_chunk_mask_allows_the_own_chunk_and_the_left_ones(size, chunk, left):
    mask = chunk_mask(size, chunk, left)
    for i in range(size):
        for j in range(size):
            behind = i // chunk - j // chunk
            assert bool(mask[i, j]) == (0 <= behind and (left < 0 or behind <= left)), (i, j)


def test_subsampled_lengths_match_convolution_output():
    conv = torch.nn.Sequential(
        torch.nn.Conv2d(1, 1, 3, stride=2), torch.nn.Conv2d(1, 1, 3, stride=2)
    )
    for t in [7, 8, 9, 10, 33, 100, 101]:
        out = conv(torch.zeros(1, 1, t, 80))
        assert out.shape[2] == int(subsampled_lengths(torch.tensor(t)))
