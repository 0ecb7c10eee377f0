"""The recognition server (``konkanivani-serve``): a checkpoint (or its ONNX export) loaded once
behind an ASGI app.

- ``limits``: what one client may ask of the server (upload size, streams, their length and idle
  time, frame size, the least rates of bodies and streams, places per client address), with their
  defaults;
- ``engine``: the recognizer (a checkpoint's, or an export folder's on onnxruntime) and how the
  server decodes with it, off the event loop;
- ``app``: the Starlette app: ``POST /transcribe``, the WebSocket ``/stream``, the page at ``/``,
  ``/health`` and ``/metrics``, and the origin and token checks;
- ``openai_api``: OpenAI's dialect on the same app: ``POST /v1/audio/transcriptions`` (json, text,
  srt, vtt, verbose_json; the prompt and hotwords as hotwords) and ``GET /v1/models``, refusals in
  OpenAI's error JSON, for OpenAI's clients with the token as their API key;
- ``uploads``: what the upload endpoints share: an upload's body and form read within the limits,
  and ``Refused``, the answer of a request refused;
- ``static/``: the page's files, served from the package (no build step, nothing from elsewhere).

The protocol, the limits and how to call it: docs/serving.md.
"""
