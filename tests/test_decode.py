"""Decoding on a tiny trained model: each search against an independent computation of its score."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from decode_helpers import decode_features  # noqa: E402

from konkanivani.config import ConfigError
from konkanivani.data.dataset import ASRDataset, collate, load_utterances
from konkanivani.data.tokenizer import BLANK_ID, SOS_EOS_ID
from konkanivani.decoding.recognizer import Recognizer
from konkanivani.decoding.search import (
    METHODS,
    CTCBestPath,
    CTCPrefixBeam,
    attention_beam_search,
    attention_rescoring,
    attention_scores,
    ctc_greedy,
    ctc_prefix_beam_search,
)
from konkanivani.decoding.settings import DecodingConfig


@pytest.fixture(scope="module")
def trained(tiny_run, tiny_corpus):
    rec = Recognizer.from_checkpoint(tiny_run / "latest.pt")
    utts, _ = load_utterances(tiny_corpus / "valid.jsonl", rec.tokenizer)
    waveforms = collate([ASRDataset(utts[:4]).__getitem__(i) for i in range(min(4, len(utts)))])
    feats, feat_lens = waveforms.features(rec.frontend)
    batch = SimpleNamespace(feats=feats, feat_lens=feat_lens, indices=waveforms.indices)
    with torch.inference_mode():
        enc, enc_lens = rec.model.encode(batch.feats, batch.feat_lens)
    return rec.model, batch, enc, enc_lens


@pytest.fixture(autouse=True)
def _inference():
    with torch.inference_mode():
        yield


def ctc_logprob(log_probs, length, tokens):
    """log P(tokens | x) by the CTC forward algorithm of torch."""
    if not tokens:
        return float(log_probs[:length, BLANK_ID].sum())
    loss = F.ctc_loss(log_probs[:length, None], torch.tensor([tokens]), torch.tensor([length]),
                      torch.tensor([len(tokens)]), blank=BLANK_ID, reduction="sum")
    return -float(loss)


def test_ctc_prefix_beam_search_beam_1_equals_greedy(trained):
    model, _, enc, enc_lens = trained
    log_probs = model.ctc_log_probs(enc)
    greedy = ctc_greedy(log_probs, enc_lens)
    for b in range(enc.shape[0]):
        assert ctc_prefix_beam_search(log_probs[b], int(enc_lens[b]), 1)[0].tokens == greedy[b]


def test_ctc_prefix_beam_search_without_pruning_is_exact():
    """With every prefix kept, each score is log P(prefix) summed over all alignments."""
    log_probs = torch.randn(7, 4).log_softmax(-1)
    nbest = ctc_prefix_beam_search(log_probs, 7, beam_size=10_000)
    assert len(nbest) > 100
    for h in nbest:
        assert h.score == pytest.approx(ctc_logprob(log_probs, 7, h.tokens), abs=1e-4)
    assert torch.tensor([h.score for h in nbest]).logsumexp(0) == pytest.approx(0.0, abs=1e-4)


def test_prefixes_are_equal_by_their_tokens_alone():
    """Prefix beam search keys its dictionaries by linked prefixes: equal tokens, equal keys."""
    from konkanivani.decoding.search import _Prefix

    def build(tokens, root=None):
        node = root or _Prefix()
        for tok in tokens:
            node = _Prefix(node, tok)
        return node

    root = _Prefix()
    a, b = build([5, 7, 5], root), build([5, 7], build([], root))
    b = _Prefix(b, 5)
    assert (
        a == b
        and hash(a) == hash(b)
        and len({a, b, build([5, 7, 5])}) == 1
        and a.tokens() == [5, 7, 5]
    )
    assert _Prefix() == root and root.tokens() == [] and root.token is None
    others = [build([5, 7]), build([7, 5, 5]), build([5, 7, 5, 5]), build([5, 7, 6])]
    assert all(a != o for o in others) and len({a, *others}) == 5 and a != (5, 7, 5)


@pytest.mark.parametrize("pieces", [[23], [1] * 23, [5, 0, 7, 11], [2, 3, 18]])
def test_the_search_fed_frames_piece_by_piece_equals_the_search_over_all_of_them(trained, pieces):
    """A stream's CTC prefix beam search: the same n-best, scores and token frames however the
    frames come."""
    model, _, enc, enc_lens = trained
    log_probs = model.ctc_log_probs(enc)[0, :23]
    whole = CTCPrefixBeam(5)
    whole.advance(log_probs)
    parts, start = CTCPrefixBeam(5), 0
    for n in pieces:
        parts.advance(log_probs[start:start + n])
        start += n
        assert parts.frames == start
    assert parts.hypotheses() == whole.hypotheses() == ctc_prefix_beam_search(log_probs, 23, 5)


@pytest.mark.parametrize("pieces", [[40], [1] * 40, [16, 16, 8], [3, 0, 29, 8]])
def test_a_streams_best_path_is_the_whole_inputs_greedy_text_however_the_frames_come(pieces):
    """A stream's greedy search (``CTCBestPath``): the tokens ``ctc_greedy`` gives all the frames
    at once, the path's log-probability, and each token at its peak, on frames where a repeated
    token and blank nearly tie (where a prefix beam one prefix wide can keep the repeat)."""
    gen = torch.Generator().manual_seed(7)
    log_probs = torch.log_softmax(torch.randn(40, 6, generator=gen), -1)
    # token 1 likeliest on five frames, blank close behind on some: the best path spells 1 once;
    # a prefix beam one prefix wide, which sums each prefix's paths, comes to "1 1" through the
    # paths with a blank between
    run = torch.tensor([[0.01, 0.99, 0.0], [0.25, 0.74, 0.01], [0.37, 0.63, 0.0],
                        [0.40, 0.45, 0.15], [0.08, 0.85, 0.07]])
    log_probs[30:35] = torch.log(F.pad(run, (0, 3)) + 1e-6)
    log_probs[29, 1] = log_probs[35, 1] = -20.0  # the run alone
    search, start = CTCBestPath(), 0
    for n in pieces:
        search.advance(log_probs[start:start + n])
        start += n
    [best] = search.hypotheses()
    [greedy] = ctc_greedy(log_probs[None], torch.tensor([40]))
    assert best.tokens == greedy and len(greedy) > 10
    assert best.score == pytest.approx(log_probs.max(-1).values.sum().item(), abs=1e-4)
    path = log_probs.argmax(-1).tolist()
    for tok, frame in zip(best.tokens, best.frames):
        assert path[frame] == tok
        beside = [t for t in (frame - 1, frame + 1) if 0 <= t < 40 and path[t] == tok]
        assert all(log_probs[frame, tok] >= log_probs[t, tok] for t in beside)
    beam1 = CTCPrefixBeam(1)
    beam1.advance(log_probs)
    assert beam1.hypotheses()[0].tokens != greedy  # the case this search exists for
    assert beam1.hypotheses()[0].tokens.count(1) == greedy.count(1) + 1


def test_each_token_carries_the_frame_where_it_was_likeliest():
    tokens, at = [3, 5, 3], [2, 6, 7]  # frames where each token is spoken; blank elsewhere
    log_probs = torch.full((10, 6), -8.0)
    log_probs[:, BLANK_ID] = 0.0
    for tok, t in zip(tokens, at):
        log_probs[t, tok], log_probs[t, BLANK_ID] = 0.0, -8.0
    # the first 3 held for two frames, likeliest at 2
    log_probs[3, 3], log_probs[3, BLANK_ID] = -0.5, -1.0
    best = ctc_prefix_beam_search(log_probs.log_softmax(-1), 10, 4)[0]
    assert best.tokens == tokens and best.frames == at


def test_ctc_prefix_beam_search_nbest_on_the_model(trained):
    model, _, enc, enc_lens = trained
    log_probs = model.ctc_log_probs(enc)
    for b in range(enc.shape[0]):
        nbest = ctc_prefix_beam_search(log_probs[b], int(enc_lens[b]), 6)
        assert len(nbest) == 6 and len({tuple(h.tokens) for h in nbest}) == 6
        assert [h.score for h in nbest] == sorted((h.score for h in nbest), reverse=True)
        for h in nbest:  # pruning can only lose alignments
            assert h.score <= ctc_logprob(log_probs[b], int(enc_lens[b]), h.tokens) + 1e-3


def test_attention_beam_1_is_greedy_attention_decoding(trained):
    model, _, enc, enc_lens = trained
    hyps = attention_beam_search(model, enc, enc_lens, beam_size=1)
    for b in range(enc.shape[0]):
        ys = [SOS_EOS_ID]
        with torch.inference_mode():
            while len(ys) <= int(enc_lens[b]):
                logits = model.decoder(
                    torch.tensor([ys]),
                    torch.tensor([len(ys)]),
                    enc[b : b + 1, : enc_lens[b]],
                    enc_lens[b : b + 1],
                )[0, -1]
                logits[BLANK_ID] = float("-inf")
                nxt = int(logits.argmax())
                if nxt == SOS_EOS_ID:
                    break
                ys.append(nxt)
        assert hyps[b].tokens == ys[1:]


@pytest.mark.parametrize("ctc_weight", [0.0, 0.3, 0.7])
def test_beam_and_joint_scores_match_an_independent_rescoring(trained, ctc_weight):
    """The score the search reports for its best hypothesis equals λ log P_ctc + (1-λ) log P_att
    of that hypothesis, computed from scratch (full CTC forward, teacher-forced decoder)."""
    model, _, enc, enc_lens = trained
    hyps = attention_beam_search(model, enc, enc_lens, beam_size=4, ctc_weight=ctc_weight)
    att = attention_scores(model, enc, enc_lens, [h.tokens for h in hyps])
    log_probs = model.ctc_log_probs(enc)
    for b, h in enumerate(hyps):
        expected = (1 - ctc_weight) * float(att[b])
        if ctc_weight:
            expected += ctc_weight * ctc_logprob(log_probs[b], int(enc_lens[b]), h.tokens)
        assert h.score == pytest.approx(expected, abs=2e-3)


def test_batched_search_equals_one_utterance_at_a_time(trained):
    model, _, enc, enc_lens = trained
    together = attention_beam_search(model, enc, enc_lens, beam_size=3, ctc_weight=0.3)
    for b in range(enc.shape[0]):
        alone = attention_beam_search(
            model, enc[b : b + 1, : enc_lens[b]], enc_lens[b : b + 1], beam_size=3, ctc_weight=0.3
        )[0]
        assert alone.tokens == together[b].tokens
        assert alone.score == pytest.approx(together[b].score, abs=1e-3)


def test_rescoring(trained):
    model, _, enc, enc_lens = trained
    log_probs = model.ctc_log_probs(enc)
    pure_ctc = attention_rescoring(model, enc, enc_lens, beam_size=5, ctc_weight=1.0)
    for b, h in enumerate(pure_ctc):
        assert h.tokens == ctc_prefix_beam_search(log_probs[b], int(enc_lens[b]), 5)[0].tokens
    rescored = attention_rescoring(model, enc, enc_lens, beam_size=5, ctc_weight=0.3)
    for b, h in enumerate(rescored):
        nbest = ctc_prefix_beam_search(log_probs[b], int(enc_lens[b]), 5)
        att = attention_scores(
            model, enc[[b] * len(nbest)], enc_lens[[b] * len(nbest)], [n.tokens for n in nbest]
        )
        combined = [0.3 * n.score + 0.7 * float(a) for n, a in zip(nbest, att)]
        assert h.score == pytest.approx(max(combined), abs=1e-4)


def test_every_method_decodes_a_batch_and_an_unknown_one_is_refused(trained):
    model, batch, _, _ = trained
    for method in METHODS:
        hyps = decode_features(model, batch.feats, batch.feat_lens, method, beam_size=3)
        assert len(hyps) == len(batch.indices) and all(
            isinstance(t, int) and t > SOS_EOS_ID for h in hyps for t in h
        )
    with pytest.raises(ConfigError, match="--method viterbi: unknown"):
        DecodingConfig(method="viterbi").check()


def test_incremental_decoder_steps_equal_the_full_forward():
    torch.manual_seed(0)
    from konkanivani.config import model_config_from_preset
    from konkanivani.model.asr import ASRModel

    model = ASRModel(model_config_from_preset("tiny", vocab_size=40)).eval()
    memory, memory_lens = torch.randn(3, 17, 48), torch.tensor([17, 12, 5])
    tokens = torch.randint(3, 40, (3, 6))
    tokens[:, 0] = SOS_EOS_ID
    full = model.decoder(tokens, torch.full((3,), 6), memory, memory_lens)  # (3, 6, V)
    for hyps in (1, 3):  # hypotheses per utterance share its cross-attention keys and values
        state = model.decoder.init_state(memory, memory_lens)
        rows = tokens.repeat_interleave(hyps, dim=0)
        for i in range(6):
            logits, state = model.decoder.step(rows[:, i], state)
            torch.testing.assert_close(
                logits, full[:, i].repeat_interleave(hyps, dim=0), atol=1e-5, rtol=1e-5
            )
