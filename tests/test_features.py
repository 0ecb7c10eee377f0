"""Log-mel features of a padded batch (``LogMel.batch``, what the training step computes on its
device) equal those of each waveform alone (``LogMel``, what the data workers computed before and
decoding computes now), with and without VTLP."""
import math

import pytest
import torch

from konkanivani.data.augment import vtlp_warp_matrices
from konkanivani.data.features import LogMel


def _waveforms(lengths: list[int]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    t = torch.arange(max(lengths)) / 16000
    # a tone that comes and goes
    voice = torch.sin(2 * math.pi * 220 * t) * torch.sin(2 * math.pi * 3 * t)
    return [0.3 * voice[:n] + 0.05 * torch.randn(n, generator=g) for n in lengths]


def _padded(wavs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.nn.utils.rnn.pad_sequence(wavs, batch_first=True), torch.tensor(
        [len(w) for w in wavs]
    )


# lengths around the hop (160) and the window (400), the shortest a batch may hold (201) and longer
# ones
LENGTHS = [16000, 201, 400, 401, 12345, 3361, 160 * 37]


def test_a_batch_has_the_features_of_each_waveform_alone():
    log_mel, wavs = LogMel(), _waveforms(LENGTHS)
    feats, frames = log_mel.batch(*_padded(wavs))
    assert feats.shape == (len(wavs), 1 + max(LENGTHS) // 160, 80) and feats.dtype == torch.float32
    for i, wav in enumerate(wavs):
        alone = log_mel(wav)
        assert frames[i] == len(alone) == 1 + len(wav) // 160
        torch.testing.assert_close(feats[i, :len(alone)], alone, atol=2e-4, rtol=1e-4)
        assert not feats[i, len(alone):].any()  # zero padding, as the batches were padded before


def test_vtlp_warps_each_utterance_of_a_batch_by_its_own_factor():
    log_mel, wavs = LogMel(), _waveforms(LENGTHS[:4])
    alphas = torch.tensor([0.9, float("nan"), 1.07, 1.0])  # NaN and 1: not warped
    feats, _ = log_mel.batch(*_padded(wavs), alphas)
    for i, (wav, alpha) in enumerate(zip(wavs, alphas.tolist())):
        warp = None if math.isnan(alpha) else vtlp_warp_matrices(torch.tensor([alpha]),
                                                                 log_mel.n_freqs)[0]
        alone = log_mel(wav, warp)
        torch.testing.assert_close(feats[i, :len(alone)], alone, atol=2e-4, rtol=1e-4)


def test_the_warp_matrices_of_a_batch_are_the_single_ones():
    alphas = torch.tensor([0.9, 0.95, 1.02, 1.1])
    batch = vtlp_warp_matrices(alphas, 201)
    for alpha, matrix in zip(alphas, batch):
        assert torch.equal(matrix, vtlp_warp_matrices(alpha[None], 201)[0])
        # each output bin reads one interpolated input
        assert torch.allclose(matrix.sum(1), torch.ones(201))


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_features_stay_float32_under_autocast(dtype):
    log_mel, wavs = LogMel(), _waveforms([8000, 4000])
    with torch.autocast("cpu", dtype=dtype):
        feats, _ = log_mel.batch(*_padded(wavs))
    assert feats.dtype == torch.float32
    torch.testing.assert_close(feats, log_mel.batch(*_padded(wavs))[0])
