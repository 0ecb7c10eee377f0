"""konkanivani: a compact Conformer CTC/attention ASR trainer for low-resource languages."""
from .config import PRESETS, ModelConfig, TrainConfig, model_config_from_preset
from .data.tokenizer import Tokenizer, normalize_text, train_tokenizer
from .model.asr import ASRModel

__version__ = "0.1.0"
__all__ = ["PRESETS", "ModelConfig", "TrainConfig", "model_config_from_preset", "ASRModel", "Tokenizer",
           "normalize_text", "train_tokenizer", "__version__"]
