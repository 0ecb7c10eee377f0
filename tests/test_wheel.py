"""The package as a user installs it: a wheel in a fresh virtual environment, used from
elsewhere."""
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_wheel_installs_and_trains_from_an_unrelated_directory(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(ROOT),
            "--no-deps",
            "--no-build-isolation",
            "--quiet",
            "-w",
            str(wheels),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    [wheel] = wheels.glob("konkanivani-*.whl")
    # Beside the torch already installed (system site packages), nothing of the checkout.
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    python, bin_dir = env_dir / "bin" / "python", env_dir / "bin"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            # an installed konkanivani of the same version (the checkout's editable install, seen
            # through the system site packages) would make pip skip the wheel
            "--ignore-installed",
            "--quiet",
            str(wheel),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": ""}

    def run(*cmd):
        result = subprocess.run(
            cmd, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return result

    where = run(str(python), "-c", "import konkanivani; print(konkanivani.__file__)").stdout.strip()
    assert where.startswith(str(env_dir)), where  # the wheel's copy, not the checkout's
    run(
        str(bin_dir / "konkanivani-demo-corpus"),
        "--output_dir",
        "corpus",
        "--num_utterances",
        "40",
        "--max_sentences",
        "20",
    )
    assert (elsewhere / "corpus" / "train.jsonl").is_file()
    run(
        str(bin_dir / "konkanivani-train"),
        "--train_manifest",
        "corpus/train.jsonl",
        "--valid_manifest",
        "corpus/valid.jsonl",
        "--preset",
        "tiny",
        "--tokenizer_type",
        "char",
        "--max_steps",
        "3",
        "--num_workers",
        "0",
        "--output_dir",
        "run",
        "--no_progress",
    )
    assert (elsewhere / "run" / "latest.pt").is_file()
    for tool in (
        "transcribe",
        "evaluate",
        "average",
        "validate",
        "plan-memory",
        "prepare",
        "plot",
        "export",
        "serve",
        "pseudolabel",
    ):
        assert "usage:" in run(str(bin_dir / f"konkanivani-{tool}"), "--help").stdout
