"""benchmarks/pretrain.py's table across seeds: each seed's record kept in OUT/seed-S.json, the
table gives every seed's row and their mean, the gap share of each and of the means, and chance
from the pretrained run's own codebook."""
import json
import math

from benchmark_modules import load

pretrain = load("pretrain")
KEYS = [f"{s}_{m}" for s in pretrain.SPLITS for m in ("greedy", "joint")]


def _record(out, seed: int, scratch: float, tuned: float, full: float, codes: int) -> None:
    cers = {name: dict.fromkeys(KEYS, cer)
            for name, cer in (("scratch", scratch), ("tuned", tuned), ("full", full))}
    (out / f"seed-{seed}.json").write_text(json.dumps(
        {"seed": seed, "cpu": "a CPU", "cers": cers, "masked": [[100, 5.5], [200, 5.25]],
         "chance": math.log(codes), "seconds": {"pretraining": 0.3, "scratch": 0.5}}))


def test_the_table_holds_each_seed_their_mean_and_the_gap_of_the_means(tmp_path):
    _record(tmp_path, 1235, scratch=20.0, tuned=16.0, full=10.0, codes=512)
    _record(tmp_path, 1234, scratch=16.0, tuned=17.0, full=6.0, codes=512)
    recs = pretrain.records(tmp_path)
    assert [r["seed"] for r in recs] == [1234, 1235]
    args = pretrain.parse_args(["--out", str(tmp_path), "--pretrain_steps", "200"])
    text = pretrain.table(args, recs)
    assert "seeds 1234, 1235" in text
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| tuned")]
    assert [(r[1], r[3]) for r in rows] == [("1234", "17.00"), ("1235", "16.00"),
                                            ("mean", "16.50")]
    # the gap: seed 1234 -10%, seed 1235 +40%; of the means (18 - 16.5) / (18 - 8) = 15%
    assert "- test_joint: -10% (seed 1234), 40% (seed 1235); of the means 15%" in text
    assert "chance log(512) = 6.24" in text
    pretrain.plot(recs, tmp_path / "pretrain.png")
    assert (tmp_path / "pretrain.png").stat().st_size > 0


def test_chance_is_the_log_of_the_pretrained_runs_codebook(tmp_path):
    (tmp_path / "config.yaml").write_text("model:\n  d_model: 64\n  codebook_size: 256\n")
    assert pretrain.chance(tmp_path) == math.log(256)
