"""From a trained checkpoint to text: the settings (``settings.DecodingConfig``, with the flags of
the decoding tools), the searches (greedy, CTC prefix beam, attention, joint, rescoring, LM fusion)
and the attention searches' beam and scorers (``beam``), the ``Recognizer``, evaluation with
WER/CER, and ONNX/TorchScript export."""
