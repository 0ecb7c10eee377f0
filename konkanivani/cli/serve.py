"""Serve a konkanivani checkpoint or its ONNX export over HTTP and WebSocket, with a page to try it
(``konkanivani-serve``).

    konkanivani-serve checkpoints/streaming/best.pt                # http://127.0.0.1:8000/
    konkanivani-serve checkpoints/run/best.pt --host 0.0.0.0 --token "$(openssl rand -hex 16)"
    konkanivani-serve checkpoints/streaming/model_export           # a konkanivani-export folder
    (ONNX)

``POST /transcribe`` takes a recording and answers its text, segments with times, duration and
decode time; the WebSocket ``/stream`` takes 16 kHz 16-bit PCM (or float32, any rate it declares)
and answers partial and final results as they come (a checkpoint trained with ``--causal_conv``, or
an export made with ``--streaming``); ``GET /`` is a page with the microphone and a file drop;
``/health`` and ``/metrics`` (Prometheus). It listens on 127.0.0.1 unless ``--host`` says otherwise;
with ``--token`` (or ``KONKANIVANI_TOKEN``) every request needs it. An export folder
(``konkanivani-export``) is served on onnxruntime with CTC search alone (greedy or beam): its
attention decoder is not exported. docs/serving.md has the protocol and the limits.
"""
from __future__ import annotations

import importlib.util
import ipaddress
import logging
import os
import re
import socket
import sys
from dataclasses import fields
from pathlib import Path

from ..checkpoint import CheckpointError
from ..config import ConfigError
from ..decoding.settings import add_decoding_flags, decoding_config_from_args
from . import Parser, fail, setup_logging, tool

TOKEN_ENV = "KONKANIVANI_TOKEN"
# a host name or address as a browser writes it in Host and Origin: ASCII (an IDN as punycode), no
# wildcard; an IPv6 address in brackets
_HOST = r"(?:[a-z0-9](?:[a-z0-9-]*[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]*[a-z0-9])?)*|\[[0-9a-f:.]+\])"
_ORIGIN = re.compile(rf"https?://{_HOST}(?::(?P<port>[0-9]{{1,5}}))?/?", re.IGNORECASE)
# the open files the server keeps besides its connections' (the model's, threads', the log's)
FILES_BESIDES = 256
# The DecodingConfig fields konkanivani-serve takes as flags (docs/generate_flags.py reads them):
# a streaming checkpoint streams in --chunk_size chunks, an export in its own.
DECODING_FIELDS = ("method", "beam_size", "ctc_weight", "chunk_size", "left_chunks", "endpoint_ms",
                   "device")


@tool
def main(argv: list[str] | None = None) -> int:
    from ..serving.limits import Limits

    parser = _parser(Limits)
    args = parser.parse_args(argv)
    if not args.host.strip():  # the socket would listen on every interface, the warnings name none
        parser.error(f"--host {args.host!r} is empty: give 0.0.0.0 (or ::) to listen on every "
                     "interface, or leave it out for this machine alone (127.0.0.1)")
    if not args.checkpoint.is_file() and not args.checkpoint.is_dir():
        parser.error(f"checkpoint {args.checkpoint}: file not found")
    try:
        limits = Limits(**{f.name: getattr(args, f.name) for f in fields(Limits)})
    except ValueError as e:
        parser.error(f"--{e}")
    decoding = decoding_config_from_args(args)
    try:  # how the model decodes them is checked once it is loaded (Engine)
        decoding.check(streams=None)
    except ConfigError as e:
        parser.error(str(e))
    threads = 1 if args.threads is None else args.threads
    for name, value, least in (("--workers", args.workers, 1), ("--threads", threads, 1),
                               ("--port", args.port, 0)):
        if value < least:
            parser.error(f"{name} must be at least {least}, got {value}")
    for origin in args.allow_origin:
        found = _ORIGIN.fullmatch(origin)
        if not found or not 0 < int(found["port"] or 80) <= 65535:
            parser.error(f"--allow_origin {origin!r}: an origin is scheme://host[:port] (http or "
                         "https, no path, no wildcard, a port from 1 to 65535), as a browser sends "
                         "it")
    for host in args.allow_host:
        if not re.fullmatch(_HOST, host, re.IGNORECASE):
            parser.error(f"--allow_host {host!r}: a host name or address as clients write it in "
                         "Host, without a port or a wildcard (an IPv6 address in brackets)")
    args.trust_proxy = [a.strip() for value in args.trust_proxy for a in value.split(",")]
    for address in args.trust_proxy:
        try:
            ipaddress.ip_network(address, strict=False)
        except ValueError:
            parser.error(f"--trust_proxy {address!r}: an IP address or network (10.0.0.0/8)")
    # an HTTP header carries visible ASCII alone: another token could never be sent
    if args.token and not re.fullmatch(r"[!-~]+", args.token):
        parser.error(f"--token (or ${TOKEN_ENV}) must be visible ASCII characters (! to ~, no "
                     "spaces): a header cannot carry others")
    setup_logging()
    return _serve(args, decoding, limits)


def _parser(limits_class) -> Parser:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "checkpoint",
        type=Path,
        metavar="MODEL",
        help=(
            "a checkpoint (best.pt, latest.pt, an average), or a folder konkanivani-export wrote "
            "(ONNX, on onnxruntime: greedy or beam, no attention rescoring)"
        ),
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help=(
            "the address to listen on (default: %(default)s, this machine only; 0.0.0.0: every "
            "interface, with --token)"
        ),
    )
    parser.add_argument(
        "--port", type=int, default=8000, help="default: %(default)s; 0: a free one, printed"
    )
    parser.add_argument("--allow_host", action="append", default=[], metavar="NAME",
                        help="a host name (or address) clients reach the server by, besides "
                             "--host, localhost, 127.0.0.1 and [::1]; repeatable. A request "
                             "whose Host header names another is 400 (DNS rebinding)")
    parser.add_argument("--trust_proxy", action="append", default=[], metavar="ADDR",
                        help="a proxy's address (or network) whose X-Forwarded-For and "
                             "X-Forwarded-Proto are believed; repeatable, or a comma list. By "
                             "default none: a client is its connection's address")
    parser.add_argument("--allow_origin", action="append", default=[], metavar="ORIGIN",
                        help="a page of this origin (scheme://host[:port]) may use the server "
                             "besides its own page; repeatable. Requests without Origin (curl, "
                             "programs) need none; a browser's from any other origin get 403")
    parser.add_argument(
        "--token",
        default=os.environ.get(TOKEN_ENV) or None,
        help=(
            f"a secret every request must carry (default: ${TOKEN_ENV}, else none): the header "
            "'Authorization: Bearer TOKEN' or ?token=TOKEN; the page opened as /?token=TOKEN"
        ),
    )
    parser.add_argument("--model_name", default=None, metavar="NAME",
                        help="the model's name in /health and /v1/models, the one OpenAI's "
                             "clients may give as model (default: its folder and file, "
                             "e.g. streaming/best.pt)")
    add_decoding_flags(parser, DECODING_FIELDS)
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="decode threads (default: %(default)s; PyTorch's own threads use the cores)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="PyTorch's threads (default: its own choice)"
    )
    parser.add_argument(
        "--batch_streams", action="store_true", default=True,
        help="encode the chunks of concurrent streams together, one batched forward at a time "
             "(default; an export's streams are encoded one by one)"
    )
    parser.add_argument(
        "--no_batch_streams", dest="batch_streams", action="store_false",
        help="encode each stream's chunks alone, one forward a chunk"
    )
    group = parser.add_argument_group("limits")
    for f in fields(limits_class):
        group.add_argument(f"--{f.name}", type=type(f.default), default=f.default,
                           help=f"{f.metadata['help']} (default: %(default)s)")
    return parser


def _serve(args, decoding, limits) -> int:
    try:
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn
    except ImportError as e:
        return fail(
            "konkanivani-serve needs its extra: pip install 'konkanivani[serve]' (missing:"
            f" {e.name})"
        )
    import torch

    from ..decoding.onnx_recognizer import ExportedRecognizer
    from ..decoding.recognizer import Recognizer
    from ..serving.app import create_app, model_label
    from ..serving.connections import protocol
    from ..serving.engine import Engine

    if args.threads:
        torch.set_num_threads(args.threads)
    exported = args.checkpoint.is_dir()  # a konkanivani-export folder
    if exported and importlib.util.find_spec("onnxruntime") is None:
        return fail(f"{args.checkpoint} is an export folder: serving ONNX needs onnxruntime: "
                    "pip install 'konkanivani[export]' (or serve the checkpoint itself)")
    if exported and decoding.device not in ("auto", "cpu"):
        return fail(f"--device {decoding.device}: an ONNX export is served on onnxruntime's CPU "
                    "provider (--device cpu)")
    try:
        if exported:
            recognizer = ExportedRecognizer(args.checkpoint)
        else:
            recognizer = Recognizer.from_checkpoint(args.checkpoint, decoding.device)
        engine = Engine(recognizer, decoding, args.workers, batch_streams=args.batch_streams)
    except (CheckpointError, RuntimeError, ValueError) as e:
        return fail(str(e))
    streaming, method = engine.streaming, engine.decoding.method
    try:
        sock = _listen(args.host, args.port)
    except OSError as e:
        return fail(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}")
    bound = f"[{args.host}]" if ":" in args.host else args.host
    app = create_app(engine, limits, args.token,
                     args.model_name or model_label(str(args.checkpoint)), args.allow_origin,
                     [bound, *args.allow_host])
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    _open_files(limits.max_connections)
    if not args.token and not _loopback(args.host):
        print(
            f"warning: listening on {args.host} without --token: anyone who can reach this machine"
            " can use the model",
            file=sys.stderr,
        )
    kind = ("ONNX, " if exported else "") + ("streaming, " if streaming else "")
    print(f"serving {args.checkpoint} ({kind}{method}) at http://{shown}:{port}/"
          + (" (token required)" if args.token else ""), file=sys.stderr, flush=True)
    config = uvicorn.Config(
        app,
        http=protocol(limits.header_timeout, limits.max_connections, limits.retry_after_s),
        log_level="warning",
        access_log=False,
        ws_max_size=4 * limits.max_frame_bytes,
        ws_ping_interval=20.0,
        ws_ping_timeout=20.0,
        timeout_graceful_shutdown=5,
        # the client's address is its connection's unless a trusted proxy's header says otherwise
        proxy_headers=bool(args.trust_proxy),
        forwarded_allow_ips=args.trust_proxy or None,
    )
    _filter_logs()  # after Config, which sets up uvicorn's loggers
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def _filter_logs() -> None:
    """The server's logs as a client cannot flood or forge them."""
    from ..serving.app import DenialLogFilter, EscapeFields
    from ..serving.connections import OncePerInterval
    from ..serving.uploads import PARSER_LOGGERS

    logging.getLogger("uvicorn.error").addFilter(DenialLogFilter())
    # what comes once per socket (asyncio's failed accepts, uvicorn's bad requests, the
    # connections' refusals): once a minute
    for name in ("asyncio", "uvicorn.error", "konkanivani.connections"):
        logging.getLogger(name).addFilter(OncePerInterval())
    for handler in logging.getLogger("konkanivani").handlers:
        handler.addFilter(EscapeFields())
    # the form parser's warning for each error it raises, unformatted: the refusal's line says it
    for name in PARSER_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)  # connections wait in the backlog from now on, before the app has started
    sock.set_inheritable(True)
    return sock


def _open_files(connections: int) -> None:
    """The soft limit of open files raised to what ``connections`` and the server's own files need,
    where the hard limit allows (Go's runtime raises it at start too): each connection is one. A
    warning line where it cannot be."""
    try:
        import resource
    except ImportError:  # not a Unix: no such limit to raise
        return
    wanted = connections + FILES_BESIDES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return
    new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    if new < wanted:
        print(f"warning: this process may open {new} files (ulimit -n), fewer than the {wanted} "
              f"--max_connections {connections} and the server's own files need: beyond, "
              "connections wait unaccepted (logged once a minute)", file=sys.stderr)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


if __name__ == "__main__":
    sys.exit(main())
