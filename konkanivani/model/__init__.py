"""The networks: masks, the Conformer encoder, the Transformer decoder, the hybrid CTC/attention
model (``asr``) and the language model of shallow fusion (``lm``)."""
