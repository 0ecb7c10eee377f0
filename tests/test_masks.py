import torch

from konkanivani.data.frames import subsampled_lengths
from konkanivani.model.masks import causal_mask, pad_mask, valid_mask


def test_pad_mask_marks_padding():
    mask = pad_mask(torch.tensor([3, 1, 4]), 4)
    assert mask.tolist() == [[False, False, False, True],
                             [False, True, True, True],
                             [False, False, False, False]]


def test_valid_mask_is_negation_and_max_len_defaults_to_longest():
    lengths = torch.tensor([2, 5])
    assert valid_mask(lengths).shape == (2, 5)
    assert torch.equal(valid_mask(lengths), ~pad_mask(lengths))
    assert valid_mask(lengths).sum(1).tolist() == [2, 5]


def test_causal_mask_lower_triangular():
    m = causal_mask(4)
    assert m.dtype == torch.bool
    for i in range(4):
        for j in range(4):
            assert bool(m[i, j]) == (j <= i)


def test_subsampled_lengths_match_convolution_output():
    conv = torch.nn.Sequential(torch.nn.Conv2d(1, 1, 3, stride=2), torch.nn.Conv2d(1, 1, 3, stride=2))
    for t in [7, 8, 9, 10, 33, 100, 101]:
        out = conv(torch.zeros(1, 1, t, 80))
        assert out.shape[2] == int(subsampled_lengths(torch.tensor(t)))
