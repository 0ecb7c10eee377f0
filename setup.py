from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="konkanivani",
    version="0.1.0",
    description="Compact Conformer CTC/attention speech recognition training for low-resource languages",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["konkanivani", "konkanivani.*"]),
    python_requires=">=3.10",
    install_requires=[
        # Ranges, so Colab's preinstalled torch/torchaudio pair is kept.
        "torch>=2.3",
        "torchaudio>=2.3",
        "sentencepiece>=0.1.99",
        "jiwer>=3.0",
        "soundfile>=0.12",
        "numpy>=1.23",
        "scipy>=1.9",
        "tqdm>=4.60",
    ],
    extras_require={
        "dev": ["pytest>=7", "hypothesis>=6", "matplotlib>=3.6"],
        # --optimizer adamw_8bit; without it training falls back to standard AdamW with a warning.
        "8bit": ["bitsandbytes>=0.50"],
    },
)
